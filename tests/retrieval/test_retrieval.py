"""Retrieval components: InfoNCE vs hand-computed values and sentence-transformers, GradCache exactness,
mining (window, false-negative filter, positives never negatives), metrics vs a hand-computed ranking,
BEIR readers and leak-free query splits."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from judgeloop.io import DataError
from judgeloop.retrieval.beir import (
    BeirData,
    LeakageError,
    check_query_split,
    load_beir,
    load_pairs,
    load_qrels,
    split_queries,
)
from judgeloop.retrieval.gradcache import grad_cache_step, split_features
from judgeloop.retrieval.losses import info_nce_loss
from judgeloop.retrieval.metrics import evaluate_run, per_query_metrics, retrieve
from judgeloop.retrieval.mining import (
    MiningConfig,
    exact_topk,
    load_negatives,
    mine_hard_negatives,
    save_negatives,
)


# ------------------------------------------------------------------------------------------- InfoNCE
def _lse(xs: list[float]) -> float:
    m = max(xs)
    return m + math.log(sum(math.exp(x - m) for x in xs))


def test_info_nce_in_batch_hand_computed():
    q = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    p = torch.tensor([[0.8, 0.6], [0.6, 0.8]])
    tau = 0.5
    # scores q.p / tau: row 0 -> [1.6, 1.2], row 1 -> [1.2, 1.6]
    expected = 0.5 * ((_lse([1.6, 1.2]) - 1.6) + (_lse([1.2, 1.6]) - 1.6))
    got = info_nce_loss(q, p, tau=tau)
    assert got.item() == pytest.approx(expected, abs=1e-6)


def test_info_nce_hard_negatives_hand_computed():
    q = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    p = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    n = torch.tensor([[0.5, 0.5], [-1.0, 0.0]])  # one hard negative per query (any order)
    tau = 1.0
    # row 0 scores: pos 1, in-batch 0, negs 0.5, -1 ; row 1: 0, pos 1, 0.5, 0
    l0 = _lse([1.0, 0.0, 0.5, -1.0]) - 1.0
    l1 = _lse([0.0, 1.0, 0.5, 0.0]) - 1.0
    assert info_nce_loss(q, p, n, tau=tau).item() == pytest.approx((l0 + l1) / 2, abs=1e-6)


def test_info_nce_symmetric_hand_computed():
    q = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    p = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    # q->d rows: [1, 1], [0, 1]; d->q rows (p_j . q_i): p0 -> [1, 0], p1 -> [1, 1]
    qd = ((_lse([1.0, 1.0]) - 1.0) + (_lse([0.0, 1.0]) - 1.0)) / 2
    dq = ((_lse([1.0, 0.0]) - 1.0) + (_lse([1.0, 1.0]) - 1.0)) / 2
    assert info_nce_loss(q, p, tau=1.0, symmetric=True).item() == pytest.approx((qd + dq) / 2, abs=1e-6)


def test_info_nce_mask_drops_a_known_positive_from_the_negatives():
    q = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    p = torch.tensor([[1.0, 0.0], [0.9, 0.1]])  # doc 1 is also relevant to query 0
    mask = torch.tensor([[True, True], [False, True]])
    got = info_nce_loss(q, p, tau=1.0, mask=mask)
    l0 = 0.0  # only its own positive remains in the denominator
    l1 = _lse([0.0, 0.1]) - 0.1
    assert got.item() == pytest.approx((l0 + l1) / 2, abs=1e-6)


def test_info_nce_equals_sentence_transformers_mnrl():
    from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss

    g = torch.Generator().manual_seed(0)
    q, p, n1, n2 = (F.normalize(torch.randn(4, 8, generator=g), dim=-1) for _ in range(4))
    ref = MultipleNegativesRankingLoss(model=None, scale=20.0).compute_loss_from_embeddings(
        [q, p, n1, n2], labels=None
    )
    ours = info_nce_loss(q, p, torch.cat([n1, n2]), tau=0.05)
    assert ours.item() == pytest.approx(ref.item(), abs=1e-5)


def test_info_nce_rejects_bad_tau():
    with pytest.raises(ValueError, match="tau=0"):
        info_nce_loss(torch.ones(2, 2), torch.ones(2, 2), tau=0)


# ------------------------------------------------------------------------------------------ GradCache
def test_gradcache_gives_the_full_batch_gradient():
    from judgeloop.retrieval.encoder import BiEncoder

    enc = BiEncoder.from_pretrained("judgeloop-tiny/encoder", max_length=32)
    enc.eval()  # no dropout: the two paths see the same network
    queries = ["a cat", "the dog barks", "heart pumps blood", "rain in the forest"]
    docs = ["a cat sat on a mat", "dogs bark loudly", "the heart is a pump", "forests get rain"]
    negs = ["stock market news", "quantum bits", "coffee beans", "moons of mars"]
    qf, pf, nf = enc.tokenize(queries, True), enc.tokenize(docs), enc.tokenize(negs)

    def loss_fn(q, p, n):
        return info_nce_loss(q, p, n, tau=0.1)

    enc.zero_grad()
    direct = loss_fn(enc(**qf), enc(**pf), enc(**nf))
    direct.backward()
    ref = {k: v.grad.clone() for k, v in enc.named_parameters() if v.grad is not None}
    enc.zero_grad()
    cached = grad_cache_step(lambda f: enc(**f), [split_features(x, 3) for x in (qf, pf, nf)], loss_fn)
    assert cached.item() == pytest.approx(direct.item(), abs=1e-6)
    for name, g in ref.items():
        torch.testing.assert_close(dict(enc.named_parameters())[name].grad, g, atol=1e-5, rtol=1e-4)


def test_split_features_rejects_zero_chunk():
    with pytest.raises(ValueError, match="chunk_size=0"):
        split_features({"input_ids": torch.ones(2, 2)}, 0)


# --------------------------------------------------------------------------------------------- mining
def _unit(*xs: float) -> list[float]:
    v = torch.tensor(xs)
    return (v / v.norm()).tolist()


def test_exact_topk_matches_a_full_sort():
    g = torch.Generator().manual_seed(1)
    q, c = torch.randn(7, 5, generator=g), torch.randn(50, 5, generator=g)
    s, i = exact_topk(q, c, 10, chunk_size=3)
    full = q @ c.T
    ref_s, ref_i = full.topk(10, dim=1)
    torch.testing.assert_close(s, ref_s)
    assert torch.equal(i, ref_i)


def test_faiss_topk_and_mining_match_the_exact_path():
    pytest.importorskip("faiss")
    from judgeloop.retrieval.mining import faiss_topk

    g = torch.Generator().manual_seed(2)
    q = torch.nn.functional.normalize(torch.randn(9, 16, generator=g), dim=-1)
    c = torch.nn.functional.normalize(torch.randn(80, 16, generator=g), dim=-1)
    s, i = faiss_topk(q, c, 12)
    ref_s, ref_i = exact_topk(q, c, 12, chunk_size=7)
    torch.testing.assert_close(s, ref_s, atol=1e-5, rtol=1e-5)
    assert torch.equal(i, ref_i)
    doc_ids = [f"d{j}" for j in range(80)]
    qids = [f"q{j}" for j in range(9)]
    positives = {f"q{j}": {f"d{j}"} for j in range(9)}
    kw = {"num_negatives": 3, "range_max": 10, "relative_margin": 0.95}
    exact = mine_hard_negatives(qids, q, doc_ids, c, positives, MiningConfig(**kw))
    fast = mine_hard_negatives(qids, q, doc_ids, c, positives, MiningConfig(**kw, use_faiss=True))
    assert [[d for d, _ in exact[x]] for x in qids] == [[d for d, _ in fast[x]] for x in qids]


def _mining_case():
    # one query, scores against docs: pos 0.8, a 0.79 (near-duplicate), b 0.7, c 0.5, d 0.2
    query = torch.tensor([[1.0, 0.0]])
    scores = {"pos": 0.8, "a": 0.79, "b": 0.7, "c": 0.5, "d": 0.2}
    doc_ids = list(scores)
    docs = torch.tensor([[s, math.sqrt(1 - s * s)] for s in scores.values()])
    return query, doc_ids, docs


def test_false_negative_filter_absolute_margin():
    query, doc_ids, docs = _mining_case()
    cfg = MiningConfig(num_negatives=3, range_max=4, margin=0.05, relative_margin=None)
    got = mine_hard_negatives(["q"], query, doc_ids, docs, {"q": {"pos"}}, cfg)
    # drop if score > 0.8 - 0.05 = 0.75 -> 'a' goes, b/c/d stay
    assert [d for d, _ in got["q"]] == ["b", "c", "d"]
    assert got["q"][0][1] == pytest.approx(0.7, abs=1e-6)


def test_false_negative_filter_relative_margin():
    query, doc_ids, docs = _mining_case()
    cfg = MiningConfig(num_negatives=3, range_max=4, margin=None, relative_margin=0.9)
    got = mine_hard_negatives(["q"], query, doc_ids, docs, {"q": {"pos"}}, cfg)
    # drop if score > 0.8 * 0.9 = 0.72 -> 'a' goes, 'b' (0.70) stays
    assert [d for d, _ in got["q"]] == ["b", "c", "d"]
    cfg = MiningConfig(num_negatives=2, range_max=4, margin=None, relative_margin=0.85)
    # 0.8 * 0.85 = 0.68 -> 'a' and 'b' go
    got = mine_hard_negatives(["q"], query, doc_ids, docs, {"q": {"pos"}}, cfg)
    assert [d for d, _ in got["q"]] == ["c", "d"]


def test_mining_window_and_random_sampling_are_deterministic():
    query, doc_ids, docs = _mining_case()
    cfg = MiningConfig(num_negatives=1, range_min=1, range_max=3, relative_margin=None)
    got = mine_hard_negatives(["q"], query, doc_ids, docs, {"q": {"pos"}}, cfg)
    assert [d for d, _ in got["q"]] == ["b"]  # rank 0 ('a') skipped by range_min
    rcfg = MiningConfig(num_negatives=2, range_max=4, relative_margin=None, sampling="random", seed=3)
    a = mine_hard_negatives(["q"], query, doc_ids, docs, {"q": {"pos"}}, rcfg)
    b = mine_hard_negatives(["q"], query, doc_ids, docs, {"q": {"pos"}}, rcfg)
    assert a == b and len(a["q"]) == 2
    assert [s for _, s in a["q"]] == sorted((s for _, s in a["q"]), reverse=True)


def test_known_positives_are_never_negatives():
    g = torch.Generator().manual_seed(0)
    q = F.normalize(torch.randn(20, 16, generator=g), dim=-1)
    docs = F.normalize(torch.randn(200, 16, generator=g), dim=-1)
    doc_ids = [f"d{i}" for i in range(200)]
    q_ids = [f"q{i}" for i in range(20)]
    # each query's 5 nearest docs are declared positive: they top the ranking and must all be skipped
    top = (q @ docs.T).topk(5, dim=1).indices
    positives = {qid: {doc_ids[j] for j in top[i].tolist()} for i, qid in enumerate(q_ids)}
    cfg = MiningConfig(num_negatives=5, range_max=20, relative_margin=None)
    got = mine_hard_negatives(q_ids, q, doc_ids, docs, positives, cfg)
    for qid in q_ids:
        assert len(got[qid]) == 5
        assert not {d for d, _ in got[qid]} & positives[qid]


def test_negatives_roundtrip(tmp_path):
    negs = {"q1": [("d1", 0.5), ("d2", 0.25)], "q2": []}
    save_negatives(tmp_path / "n.jsonl", negs)
    assert load_negatives(tmp_path / "n.jsonl") == negs
    (tmp_path / "bad.jsonl").write_text(json.dumps({"query_id": "q", "negatives": [{"doc": "x"}]}) + "\n")
    with pytest.raises(DataError, match="doc_id"):
        load_negatives(tmp_path / "bad.jsonl")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_negatives": 0}, "num_negatives=0"),
        ({"range_min": 5, "range_max": 5}, "range_min=5"),
        ({"num_negatives": 5, "range_max": 3}, "widen range_max"),
        ({"relative_margin": 1.5}, "relative_margin=1.5"),
        ({"margin": -0.1}, "margin=-0.1"),
    ],
)
def test_mining_config_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        MiningConfig(**kwargs)


# -------------------------------------------------------------------------------------------- metrics
def test_metrics_match_a_hand_computed_ranking():
    qrels = {"q1": {"d1": 1, "d3": 1}, "q2": {"d2": 1}}
    run = {"q1": {"d1": 0.9, "d2": 0.8, "d3": 0.7}, "q2": {"d1": 0.5, "d3": 0.4, "d2": 0.3}}
    got = evaluate_run(run, qrels, ["ndcg@10", "recall@1", "recall@10", "mrr@10", "map@100"])
    # q1: relevant at ranks 1 and 3; q2: relevant at rank 3
    ndcg_q1 = (1 + 1 / math.log2(4)) / (1 + 1 / math.log2(3))
    ndcg_q2 = (1 / math.log2(4)) / 1.0
    assert got["ndcg@10"] == pytest.approx((ndcg_q1 + ndcg_q2) / 2)
    assert got["recall@1"] == pytest.approx((0.5 + 0.0) / 2)
    assert got["recall@10"] == pytest.approx(1.0)
    assert got["mrr@10"] == pytest.approx((1.0 + 1 / 3) / 2)
    assert got["map@100"] == pytest.approx(((1 + 2 / 3) / 2 + 1 / 3) / 2)


def test_metrics_count_a_missing_query_as_zero_and_retrieve_builds_runs():
    got = evaluate_run({"q1": {"d1": 1.0}}, {"q1": {"d1": 1}, "q2": {"d2": 1}}, ["ndcg@10"])
    assert got["ndcg@10"] == pytest.approx(0.5)
    run = retrieve(["q"], torch.tensor([[1.0, 0.0]]), ["a", "b"], torch.tensor([[0.0, 1.0], [1.0, 0.0]]), k=1)
    assert run == {"q": {"b": 1.0}}
    with pytest.raises(ValueError, match="no query with a relevant"):
        evaluate_run({"q": {"a": 1.0}}, {"q": {"a": 0}})


def test_per_query_metrics_hand_case_and_ranx_means():
    got = per_query_metrics(
        [["d1", "d2", "d3"], ["d1", "d3", "d2"], []], [{"d1": 1, "d3": 1}, {"d2": 1}, {"d9": 1}], k=10
    )
    ndcg_q1 = (1 + 1 / math.log2(4)) / (1 + 1 / math.log2(3))
    assert got["ndcg@10"].tolist() == pytest.approx([ndcg_q1, 1 / math.log2(4), 0.0])
    assert got["recall@10"].tolist() == [1.0, 1.0, 0.0]  # an empty ranking (abstention) scores 0
    assert per_query_metrics([["d2", "d1"]], [{"d1": 1}], k=1)["recall@1"].tolist() == [0.0]
    # random graded runs: the means are ranx's (trec_eval's)
    rng = torch.Generator().manual_seed(0)
    docs = [f"d{i}" for i in range(30)]
    ranked, qrels = [], []
    for _ in range(40):
        perm = torch.randperm(30, generator=rng).tolist()
        ranked.append([docs[j] for j in perm[:15]])
        qrels.append({docs[j]: int(1 + j % 2) for j in torch.randperm(30, generator=rng)[:3].tolist()})
    mine = per_query_metrics(ranked, qrels, k=10)
    run = {f"q{i}": {d: 1.0 / (r + 1) for r, d in enumerate(ids)} for i, ids in enumerate(ranked)}
    ref = evaluate_run(run, {f"q{i}": g for i, g in enumerate(qrels)}, ["ndcg@10", "recall@10"])
    assert float(mine["ndcg@10"].mean()) == pytest.approx(ref["ndcg@10"])
    assert float(mine["recall@10"].mean()) == pytest.approx(ref["recall@10"])
    with pytest.raises(ValueError, match="query 0 has no relevant document"):
        per_query_metrics([["a"]], [{"a": 0}])
    with pytest.raises(ValueError, match="2 rankings for 1 queries"):
        per_query_metrics([["a"], ["b"]], [{"a": 1}])


# ----------------------------------------------------------------------------------------------- BEIR
def _write_beir(root: Path, qrels_rows: list[str] | None = None) -> tuple[Path, Path, Path]:
    root.mkdir(parents=True, exist_ok=True)
    corpus, queries, qrels = root / "corpus.jsonl", root / "queries.jsonl", root / "qrels.tsv"
    corpus.write_text(
        "\n".join(json.dumps({"_id": f"d{i}", "title": f"T{i}", "text": f"text {i}"}) for i in range(4))
        + "\n"
    )
    queries.write_text("\n".join(json.dumps({"_id": f"q{i}", "text": f"query {i}"}) for i in range(4)) + "\n")
    rows = qrels_rows or ["q0\td0\t1", "q1\td1\t1", "q1\td2\t0", "q2\td2\t2"]
    qrels.write_text("query-id\tcorpus-id\tscore\n" + "\n".join(rows) + "\n")
    return corpus, queries, qrels


def test_load_beir(tmp_path):
    data = load_beir(*_write_beir(tmp_path))
    assert set(data.queries) == {"q0", "q1", "q2"}  # q3 has no judgement
    assert data.corpus["d1"] == {"title": "T1", "text": "text 1"}
    assert data.qrels["q1"] == {"d1": 1, "d2": 0}
    assert data.positives() == {"q0": {"d0"}, "q1": {"d1"}, "q2": {"d2"}}


def test_load_beir_rejects_unknown_doc(tmp_path):
    with pytest.raises(DataError, match="judges doc 'd9'"):
        load_beir(*_write_beir(tmp_path, ["q0\td9\t1"]))


def test_load_beir_rejects_unknown_query(tmp_path):
    with pytest.raises(DataError, match="not in"):
        load_beir(*_write_beir(tmp_path, ["q7\td0\t1"]))


@pytest.mark.parametrize("score", ["inf", "-inf", "nan", "1e999", "high"])
def test_a_qrels_score_that_is_not_a_finite_number_is_one_line_naming_the_line(tmp_path, score):
    """``inf`` was an OverflowError traceback from int(float(...)); every non-finite score is a DataError."""
    qrels = _write_beir(tmp_path, ["q0\td0\t1", f"q1\td1\t{score}"])[2]
    with pytest.raises(DataError) as err:
        load_qrels(qrels)
    assert str(err.value) == (
        f"{qrels}:3: score '{score}' is not a finite number; a qrels score is a relevance grade (e.g. 0, 1, 2)"
    )


def test_load_pairs(tmp_path):
    path = tmp_path / "pairs.jsonl"
    rows = [
        {"query": "a?", "positive": "A."},
        {"query": "a?", "positive": "A2."},
        {"query": "b?", "positive": "A."},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    data = load_pairs(path)
    assert len(data.queries) == 2 and len(data.corpus) == 2
    assert sorted(len(v) for v in data.qrels.values()) == [1, 2]


def test_split_queries_is_deterministic_disjoint_and_order_free():
    ids = [f"q{i}" for i in range(200)]
    train, held = split_queries(ids, 0.2, salt="s")
    assert not set(train) & set(held) and len(train) + len(held) == 200
    assert 20 <= len(held) <= 60
    train2, held2 = split_queries(list(reversed(ids)), 0.2, salt="s")
    assert set(held2) == set(held) and set(train2) == set(train)


def test_split_queries_keeps_duplicate_text_together():
    ids = [f"q{i}" for i in range(100)]
    texts = {q: f"claim {int(q[1:]) % 10}" for q in ids}  # ten texts, ten copies each
    train, held = split_queries(ids, 0.3, queries=texts)
    assert not {texts[q] for q in train} & {texts[q] for q in held}


def test_split_and_leakage_errors():
    with pytest.raises(ValueError, match="eval_fraction=1.5"):
        split_queries(["a", "b"], 1.5)
    with pytest.raises(ValueError, match="left an empty side"):
        split_queries(["a"], 0.5)
    with pytest.raises(LeakageError, match="query id 'a'"):
        check_query_split(["a", "b"], ["a"])
    with pytest.raises(LeakageError, match="same text"):
        check_query_split(["a"], ["b"], {"a": "Same  claim", "b": "same claim"})


def test_beirdata_subset_shares_the_corpus():
    data = BeirData(
        corpus={"d": {"title": "", "text": "x"}}, queries={"a": "1", "b": "2"}, qrels={"a": {"d": 1}}
    )
    sub = data.subset(["a"])
    assert sub.corpus is data.corpus and sub.queries == {"a": "1"} and sub.qrels == {"a": {"d": 1}}
