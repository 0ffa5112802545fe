"""Confidence routing: answer scoring, verbalized-confidence parsing, threshold choice, baselines, readers."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from judgeloop.routing import (
    ConfidenceRouter,
    RoutingOutcomes,
    exact_match,
    passage_pool,
    read_pubmedqa,
    read_squad2,
    routing_table,
    token_f1,
)
from judgeloop.routing.llm import parse_verbalized

DATA = Path(__file__).resolve().parents[3] / "shared" / "data"


def test_squad_scoring_hand_computed():
    assert exact_match("The Normans.", ["Normans"]) == 1.0
    assert exact_match("Normandy", ["Normans", "France"]) == 0.0
    # pred "in northern france" vs gold "france": common 1, P = 1/3, R = 1 -> F1 = 0.5
    assert token_f1("in northern France", ["France"]) == pytest.approx(0.5)
    assert token_f1("x", ["France", "x y"]) == pytest.approx(2 / 3)  # best gold: P = 1, R = 1/2
    assert exact_match("", []) == 1.0 and token_f1("something", []) == 0.0  # unanswerable


@pytest.mark.parametrize(
    "raw,answer,conf",
    [
        ('{"answer": "Paris", "confidence": 0.8}', "Paris", 0.8),
        ('Sure! {"answer": "Rollo", "confidence": "90%"} done', "Rollo", 0.9),
        ('{"answer": "x", "confidence": 75}', "x", 0.75),
        ('{"answer": "x"}', "x", math.nan),
        ('{"answer": "x", "confidence": 7000}', "x", math.nan),
        ('{"answer": "x", "confidence": "high"}', "x", math.nan),
        ("Paris, I think", "Paris, I think", math.nan),
        ('{"answer": broken', '{"answer": broken', math.nan),
    ],
)
def test_parse_verbalized(raw, answer, conf):
    a, c = parse_verbalized(raw)
    assert a == answer
    assert (math.isnan(c) and math.isnan(conf)) or c == pytest.approx(conf)


def _outcomes(conf, f1_closed, f1_rag):
    n = len(conf)
    return RoutingOutcomes(
        confidence=np.asarray(conf, dtype=float),
        em_closed=np.asarray(f1_closed, dtype=float),
        f1_closed=np.asarray(f1_closed, dtype=float),
        em_rag=np.asarray(f1_rag, dtype=float),
        f1_rag=np.asarray(f1_rag, dtype=float),
        tokens_probe=np.full(n, 10.0),
        tokens_rag=np.full(n, 100.0),
        latency_probe=np.full(n, 0.1),
        latency_rag=np.full(n, 1.0),
        passages_rag=np.full(n, 2.0),
    )


def test_router_threshold_hand_case():
    # confident answers are right, unsure ones are wrong and fixed by retrieval
    conf = [0.9, 0.8, 0.3, 0.2, math.nan]
    f1_closed = [1, 1, 0, 0, 0]
    f1_rag = [1, 0, 1, 1, 1]
    r = ConfidenceRouter().fit(np.asarray(conf), np.asarray(f1_closed), np.asarray(f1_rag))
    # any threshold in (0.3, 0.8] gives F1 1.0; the lowest retrieval rate (3/5) is at t just above 0.3
    assert r.selection_f1_ == 1.0 and r.selection_retrieval_rate_ == pytest.approx(0.6)
    assert 0.3 < r.threshold_ <= 0.8
    np.testing.assert_array_equal(r.predict(np.asarray(conf)), [False, False, True, True, True])
    # NaN always retrieves, even with t = -inf
    assert ConfidenceRouter.route(np.asarray([math.nan, 0.0]), -math.inf).tolist() == [True, False]
    # a budget of 40% retrieval: best reachable is retrieving NaN + 0.2 (F1 0.8)
    b = ConfidenceRouter(max_retrieval_rate=0.4).fit(
        np.asarray(conf), np.asarray(f1_closed), np.asarray(f1_rag)
    )
    assert b.selection_retrieval_rate_ == pytest.approx(0.4) and b.selection_f1_ == pytest.approx(0.8)
    with pytest.raises(
        ValueError, match="no threshold keeps the retrieval rate within max_retrieval_rate=0.1"
    ):
        ConfidenceRouter(max_retrieval_rate=0.1).fit(np.asarray([math.nan] * 5), np.zeros(5), np.ones(5))
    with pytest.raises(RuntimeError, match="not fitted"):
        ConfidenceRouter().predict(np.zeros(2))
    clone = ConfidenceRouter().load_state_dict(r.state_dict())
    assert clone.threshold_ == r.threshold_


def test_routing_baselines():
    o = _outcomes([0.9, 0.8, 0.3, 0.2], [1, 0, 0, 1], [0, 1, 1, 1])
    retrieve = np.asarray([False, False, True, True])
    t = routing_table(o, retrieve)
    assert t["never"]["f1"] == 0.5 and t["never"]["retrieval_rate"] == 0.0
    assert t["never"]["total_tokens"] == 40 and t["never"]["passages_retrieved"] == 0
    assert t["always"]["f1"] == 0.75 and t["always"]["total_tokens"] == 400
    assert t["always"]["passages_retrieved"] == 8 and t["always"]["latency_s_per_question"] == pytest.approx(
        1.0
    )
    # router: closed for q0, q1 (1, 0), rag for q2, q3 (1, 1); pays probe + rag on the retrieved ones
    assert t["router"]["f1"] == 0.75 and t["router"]["retrieval_rate"] == 0.5
    assert t["router"]["total_tokens"] == 10 + 10 + 110 + 110
    # random with 2 of 4 retrieved: expectation 0.5 * never + 0.5 * always
    assert t["random_matched"]["f1"] == pytest.approx(0.625)
    assert t["random_matched"]["total_tokens"] == pytest.approx(220)
    # oracle: retrieve only where rag is strictly better (q1, q2): F1 = 1
    assert t["oracle"]["f1"] == 1.0 and t["oracle"]["retrieval_rate"] == 0.5
    # oracle is an upper bound for every policy's F1
    assert all(t["oracle"]["f1"] >= v["f1"] for v in t.values())


def test_random_matched_is_the_mean_of_random_subsets():
    rng = np.random.default_rng(0)
    o = _outcomes(rng.random(12), rng.integers(0, 2, 12), rng.integers(0, 2, 12))
    retrieve = np.zeros(12, bool)
    retrieve[:5] = True
    expected = routing_table(o, retrieve)["random_matched"]["f1"]
    from itertools import combinations

    f1s = []
    for subset in combinations(range(12), 5):
        r = np.zeros(12, bool)
        r[list(subset)] = True
        f1s.append(np.where(r, o.f1_rag, o.f1_closed).mean())
    assert expected == pytest.approx(np.mean(f1s))


def test_readers_on_shared_data():
    squad = DATA / "squad2_sample" / "squad2_sample.jsonl"
    pubmed = DATA / "pubmedqa" / "pubmedqa_dev.jsonl"
    if not squad.is_file() or not pubmed.is_file():
        pytest.skip(f"shared data not found under {DATA}")
    ex = read_squad2(squad)
    assert len(ex) == 293 and all(e.answers for e in ex)
    assert len(read_squad2(squad, answerable_only=False)) == 626
    assert len(passage_pool(read_squad2(squad, answerable_only=False))) == 87
    pm = read_pubmedqa(pubmed)
    assert len(pm) == 493 and {e.answers[0] for e in pm} <= {"yes", "no", "maybe"}


def test_reader_errors(tmp_path):
    from judgeloop.io import DataError

    p = tmp_path / "bad.jsonl"
    p.write_text(
        json.dumps({"id": "1", "question": "q", "context": "c", "answers": [], "is_impossible": False}) + "\n"
    )
    with pytest.raises(DataError, match="answerable question '1' has no answers"):
        read_squad2(p)
    p.write_text(
        json.dumps({"id": "1", "question": "q", "contexts": ["c"], "final_decision": "perhaps"}) + "\n"
    )
    with pytest.raises(DataError, match="final_decision='perhaps'"):
        read_pubmedqa(p)


def test_routing_and_raft_read_pubmedqa_alike(tmp_path):
    """One reader (judgeloop.data.pubmedqa) under both: the same question, abstract and answer, the first row
    of a repeated id."""
    from judgeloop.raft.readers import read_pubmedqa as raft_read

    row = {
        "id": "7",
        "question": " Q? ",
        "contexts": [" A.", "", "B. "],
        "long_answer": "L.",
        "final_decision": "Yes",
    }
    p = tmp_path / "pm.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in [row, row, {**row, "id": "8"}]) + "\n")
    routed, raft = read_pubmedqa(p), raft_read(p)
    assert [(e.id, e.question, e.answers, e.gold_passages) for e in routed] == [
        ("7", "Q?", ["yes"], ["A. B."]),
        ("8", "Q?", ["yes"], ["A. B."]),
    ]
    assert [(q.id, q.question, q.answer, raft.corpus[q.oracle_ids[0]].text) for q in raft.questions] == [
        (e.id, e.question, e.answers[0], e.gold_passages[0]) for e in routed
    ]


def test_route_command_end_to_end_tiny(tmp_path):
    """The whole command on a tiny random LM and BM25 (answers are noise; the plumbing is what is tested)."""
    from judgeloop.commands.route import RouteConfig, run
    from judgeloop.config import load_config

    towns = ["Alder", "Brin", "Cask", "Dun", "East", "Fallow", "Glen", "Holl"]
    people = ["Amira", "Bodo", "Carys", "Dalin", "Edda", "Farrel", "Greta", "Hosk"]
    rows = []
    for i, (town, who) in enumerate(zip(towns, people)):
        ctx = f"The river town of {town}mere was founded by {who} the settler in the year {1000 + i}."
        rows.append(
            {
                "id": str(i),
                "title": "t",
                "paragraph_index": i,
                "context": ctx,
                "question": f"Who founded {town}mere?",
                "answers": [who],
                "is_impossible": False,
            }
        )
    path = tmp_path / "squad.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    cfg = load_config(
        RouteConfig,
        None,
        [
            f"data.path={path}",
            "data.max_questions=null",
            "model.name=judgeloop-tiny/causal-lm",
            "model.max_new_tokens=4",
            "retriever.type=bm25",
            "retriever.top_k=1",
            f"output_dir={tmp_path / 'out'}",
            "cache_dir=null",
        ],
    )
    report = run(cfg)
    assert set(report["test"]) == {"router", "never", "always", "random_matched", "oracle"}
    assert report["retrieval_recall_at_k"] == 1.0  # BM25 finds the right passage for these questions
    assert report["data"]["num_selection"] == 4 and report["data"]["num_test"] == 4
    saved = json.loads((tmp_path / "out" / "report.json").read_text())
    assert saved["test"]["always"]["retrieval_rate"] == 1.0
    assert (tmp_path / "out" / "report.md").read_text().startswith("# Confidence routing report")
    assert len((tmp_path / "out" / "predictions.jsonl").read_text().splitlines()) == 8


@pytest.mark.parametrize("command, config", [("route", "squad2.yaml"), ("answer", "squad2_abstain.yaml")])
def test_an_answer_given_as_a_string_stops_the_command_before_any_work(tmp_path, capsys, command, config):
    """A string answer was scored letter by letter (each character one gold answer)."""
    from judgeloop.cli import main

    row = {"id": "q0", "question": "Who?", "context": "Town 0.", "answers": "Ann", "is_impossible": False}
    data = tmp_path / "squad.jsonl"
    data.write_text(json.dumps(row) + "\n")
    root = Path(__file__).resolve().parents[2]
    argv = [
        command,
        "--config",
        str(root / "configs/routing" / config),
        f"data.path={data}",
        f"output_dir={tmp_path / 'out'}",
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"judgeloop {command}: error: {data}:1: field 'answers' must be a list of strings, got string 'Ann'; "
        "fix the row or map another field (data.fields.*)"
    ]
    assert not (tmp_path / "out").exists()


# --- the published account's statistics: Holm, paired intervals, diagnostics ---------------------------


def test_holm_hand_computed():
    from judgeloop.studies.stats import holm

    # sorted: 0.005 * 4 = 0.02, 0.01 * 3 = 0.03, 0.03 * 2 = 0.06, 0.04 * 1 = 0.04 -> running max 0.06
    assert holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    # None is no test: m = 2
    assert holm([0.2, None, 0.01]) == [pytest.approx(0.2), None, pytest.approx(0.02)]
    assert holm([0.6, 0.7]) == [1.0, 1.0]  # 0.6 * 2 clipped at 1; monotone
    with pytest.raises(ValueError, match="p-value 1.5 at position 0"):
        holm([1.5])


def test_paired_bootstrap_p_value_hand_cases():
    from judgeloop.studies.stats import paired_bootstrap_test

    d, p = paired_bootstrap_test(np.asarray([0.5, 1.0, 0.25, 0.75]), n_boot=999, seed=0)
    # every replicate mean is > 0: p = 2 * (1 + 0) / (999 + 1)
    assert d.delta == pytest.approx(0.625) and p == pytest.approx(0.002)
    d, p = paired_bootstrap_test(np.zeros(5), n_boot=99)
    assert d.delta == 0.0 and p == 1.0  # identical policies
    assert paired_bootstrap_test(np.asarray([1.0]))[1] is None  # one question: no interval, no test


def test_compare_policies_pairs_every_policy_with_the_baselines():
    from judgeloop.studies.routing import compare_policies

    o = _outcomes([0.9, 0.8, 0.3, 0.2, 0.1, 0.7], [1, 0, 0, 1, 0, 1], [0, 1, 1, 1, 1, 0])
    retrieve = np.asarray([False, False, True, True, True, False])
    c = compare_policies(o, retrieve, num_bootstrap=200)
    rows = c["rows"]
    assert list(rows) == [
        "router - never",
        "router - always",
        "router - random_matched",
        "oracle - never",
        "oracle - always",
        "oracle - random_matched",
        "always - never",
    ]
    assert c["family_size"] == 7
    # router F1 = (1 + 0 + 1 + 1 + 1 + 1) / 6, never = 3/6, always = 4/6; random at rate 1/2: 3.5/6
    assert rows["router - never"]["delta"] == pytest.approx(2 / 6)
    assert rows["router - always"]["delta"] == pytest.approx(1 / 6)
    assert rows["router - random_matched"]["delta"] == pytest.approx(1.5 / 6)
    # the oracle retrieves on q1, q2, q4 (rate 1/2) and reaches F1 1
    assert rows["oracle - random_matched"]["delta"] == pytest.approx(1 - 3.5 / 6)
    for r in rows.values():
        assert r["p_holm"] >= r["p"] and r["significant"] == (r["p_holm"] <= 0.05)


def test_confidence_diagnostics_on_a_constructed_case():
    from judgeloop.routing.diagnostics import confidence_diagnostics

    conf = np.asarray([0.9, 0.9, 0.1, 0.1, math.nan])
    f1_closed = np.asarray([1.0, 1.0, 0.0, 0.0, 0.0])
    f1_rag = np.asarray([1.0, 1.0, 1.0, 1.0, 1.0])
    d = confidence_diagnostics(conf, f1_closed, f1_rag, num_bootstrap=200)
    assert d["n"] == 4 and d["missing"] == 1
    # two bins: confidence 0.9 right 2 of 2 (gap 0.1), confidence 0.1 right 0 of 2 (gap 0.1)
    assert d["ece"]["value"] == pytest.approx(0.1)
    assert d["spearman_rho"]["value"] == pytest.approx(1.0)
    # retrieval helps exactly where the confidence is low: uncertainty ranks them perfectly
    assert d["auroc_uncertainty_retrieval_helps"]["value"] == pytest.approx(1.0)
    lo, hi = d["ece"]["ci95"]
    assert lo <= 0.1 + 1e-9 <= hi + 1e-9
    # an overconfident probe: says 0.8 everywhere, right half the time -> ECE 0.3, rho undefined
    flat = confidence_diagnostics(
        np.full(4, 0.8), np.asarray([1.0, 0, 1, 0]), np.asarray([0.0, 1, 0, 1]), num_bootstrap=200
    )
    assert flat["ece"]["value"] == pytest.approx(0.3)
    assert flat["spearman_rho"]["value"] is None and "constant" in flat["spearman_rho"]["why_none"]
    assert flat["auroc_uncertainty_retrieval_helps"]["value"] == pytest.approx(0.5)  # all tied: chance
    none = confidence_diagnostics(np.full(3, math.nan), np.zeros(3), np.ones(3))
    assert none["n"] == 0 and none["ece"]["value"] is None
    assert none["ece"]["why_none"] == "no question has a confidence"
    with pytest.raises(ValueError, match=r"confidence must lie in \[0, 1\]"):
        confidence_diagnostics(np.asarray([1.5]), np.zeros(1), np.zeros(1))
