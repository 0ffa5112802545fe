"""RAFT builder: oracle rate, verbatim quotes, split leakage, distractor guards, determinism, chunking."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest

from judgeloop.config import ConfigError, load_config
from judgeloop.data.splits import LeakageError
from judgeloop.models import load_tokenizer
from judgeloop.raft.builder import BuildRaftConfig, build_raft, save_raft
from judgeloop.raft.chunking import ChunkConfig, chunk_text, oracle_chunk
from judgeloop.raft.distractors import DistractorConfig
from judgeloop.raft.leakage import check_raft_leakage
from judgeloop.raft.readers import RaftDataConfig, RaftQuestion, read_pubmedqa, read_scifact, read_squad
from judgeloop.raft.splitting import RaftSplitConfig
from judgeloop.raft.targets import (
    TargetConfig,
    extract_quotes,
    parse_answer,
    quotes_are_verbatim,
    select_quotes,
)

TINY = "judgeloop-tiny/causal-lm"
SHARED = Path(__file__).resolve().parents[3] / "shared" / "data"
REPO = Path(__file__).resolve().parents[2]

TOPICS = ["cardiology", "oncology", "neurology", "nephrology", "dermatology", "hepatology"]
WORDS = [
    "alpha",
    "beta",
    "gamma",
    "delta",
    "kappa",
    "sigma",
    "omega",
    "theta",
    "lambda",
    "zeta",
    "rho",
    "tau",
]


def _synthetic(path: Path, n: int, seed: int = 0) -> Path:
    """``n`` generic-JSONL questions, each with its own oracle paragraph (4 sentences) and topic."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        topic = TOPICS[i % len(TOPICS)]
        a, b, c = rng.sample(WORDS, 3)
        pct = rng.randint(3, 97)
        oracle = (
            f"Study {i} enrolled {a} patients treated in {topic} clinics. "
            f"The {b} marker of cohort {i} rose by {pct} percent after therapy. "
            f"Adverse events in cohort {i} were rare and mostly {c} in nature. "
            f"Follow-up for study {i} lasted {pct % 12 + 1} months in {topic} units."
        )
        rows.append(
            {
                "id": f"q{i:04d}",
                "question": f"Does therapy raise the {b} marker in {topic} cohort {i}?",
                "oracle": oracle,
                "answer": ["yes", "no", "maybe"][i % 3],
                "long_answer": f"In cohort {i} the {b} marker rose by {pct} percent after therapy.",
                "topic": topic,
            }
        )
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _cfg(data_path: Path, tmp_path: Path, **kw) -> BuildRaftConfig:
    sources = kw.pop("sources", {"random": 0.4, "same_source": 0.3, "bm25": 0.3})
    return BuildRaftConfig(
        data=RaftDataConfig(format="jsonl", path=str(data_path), corpus_path=kw.pop("corpus_path", None)),
        chunk=ChunkConfig(tokenizer=TINY, chunk_tokens=kw.pop("chunk_tokens", 48), overlap_tokens=8),
        split=RaftSplitConfig(eval_fraction=0.25),
        distractors=DistractorConfig(num_distractors=kw.pop("k", 3), sources=sources, candidate_depth=10),
        target=TargetConfig(),
        p_oracle=kw.pop("p_oracle", 0.8),
        seed=kw.pop("seed", 0),
        max_length=None,
        output_dir=str(tmp_path / "out"),
        **kw,
    )


@pytest.fixture(scope="module")
def synth(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("raft")
    path = _synthetic(tmp / "qa.jsonl", 150)
    build = build_raft(_cfg(path, tmp))
    return path, tmp, build


def _all_rows(build):
    return build.rows["train"] + build.rows["eval"]


# ------------------------------------------------------------------------------------------- oracle rate


@pytest.mark.parametrize("p", [0.8, 0.3])
def test_oracle_rate_matches_p_oracle_within_sampling_error(synth, tmp_path, p):
    path, _, build = synth
    if p != 0.8:
        build = build_raft(_cfg(path, tmp_path, p_oracle=p))
    rows = _all_rows(build)
    n = len(rows)
    rate = sum(r["meta"]["oracle_present"] for r in rows) / n
    # Bernoulli(p): the realized rate is within 4 standard errors of p (fails with prob. < 1e-4).
    assert abs(rate - p) < 4 * math.sqrt(p * (1 - p) / n)
    assert build.stats["p_oracle"] == p
    assert build.stats["oracle_rate"] == pytest.approx(
        sum(r["meta"]["oracle_present"] for r in build.rows["train"]) / len(build.rows["train"])
    )
    # The oracle is in the prompt exactly when the row says so.
    for r in rows:
        m = r["meta"]
        assert (m["oracle_chunk_id"] in m["doc_order"]) == m["oracle_present"]
        assert (f'id="{m["oracle_chunk_id"]}"' in r["messages"][1]["content"]) == m["oracle_present"]


def test_p_oracle_extremes(synth, tmp_path):
    path, _, _ = synth
    assert build_raft(_cfg(path, tmp_path, p_oracle=1.0)).stats["oracle_rate"] == 1.0
    zero = build_raft(_cfg(path, tmp_path, p_oracle=0.0))
    assert zero.stats["oracle_rate"] == 0.0
    for r in zero.rows["train"]:
        assert parse_answer(r["messages"][2]["content"]) == "The documents do not contain the answer."


# ------------------------------------------------------------------------------------------------ quotes


def test_quotes_are_verbatim_substrings_of_the_oracle(synth):
    _, _, build = synth
    n_present = 0
    for r in _all_rows(build):
        m = r["meta"]
        target = r["messages"][2]["content"]
        assert [msg["role"] for msg in r["messages"]] == ["system", "user", "assistant"]
        assert parse_answer(target) == m["target_answer"]
        if not m["oracle_present"]:
            assert extract_quotes(target) == []
            continue
        n_present += 1
        quotes = extract_quotes(target)
        assert quotes and quotes == m["quotes"]
        for q in quotes:
            assert q in m["oracle_text"]
        assert quotes_are_verbatim(target, m["oracle_text"])
        assert m["oracle_text"] in r["messages"][1]["content"]
        assert parse_answer(target) == m["answer"]
    assert n_present > 100


def test_quote_check_rejects_paraphrase_and_missing_quotes():
    oracle = "The marker rose by 12 percent after therapy."
    assert quotes_are_verbatim("x ##begin_quote##rose by 12 percent##end_quote## y", oracle)
    assert not quotes_are_verbatim("x ##begin_quote##rose by twelve percent##end_quote##", oracle)
    assert not quotes_are_verbatim("no quote at all", oracle)
    assert not quotes_are_verbatim(
        "##begin_quote##rose by 12 percent##end_quote## ##begin_quote##fell##end_quote##", oracle
    )


def test_oracle_chunk_holds_the_known_evidence_span():
    tok = load_tokenizer(TINY)
    text = " ".join(f"Sentence number {i} talks about topic {i}." for i in range(40))
    answer = "Sentence number 31 talks about topic 31."
    start = text.find(answer)
    chunks = chunk_text(tok, "d", text, 32, 8)
    assert len(chunks) > 3
    q = RaftQuestion(
        id="q",
        question="What does 31 say?",
        oracle_ids=["d"],
        answer="topic 31",
        kind="span",
        evidence=(start, start + len(answer)),
    )
    best = oracle_chunk(q, chunks)
    assert best.start <= start and start + len(answer) <= best.end
    quotes = select_quotes(q, best, 1)
    assert quotes == [answer]


# --------------------------------------------------------------------------------------------- leakage


def test_no_leakage_across_splits(synth):
    _, _, build = synth
    train, ev = build.rows["train"], build.rows["eval"]
    assert train and ev
    assert not {r["meta"]["question_id"] for r in train} & {r["meta"]["question_id"] for r in ev}
    eval_oracle_docs = {d for r in ev for d in r["meta"]["oracle_ids"]}
    eval_questions = [r["meta"]["question"].lower() for r in ev]
    eval_long = [r["meta"]["long_answer"] for r in ev]
    for r in train:
        shown = r["meta"]["doc_order"]
        assert not {c.split("#")[0] for c in shown} & eval_oracle_docs
        user = r["messages"][1]["content"]
        docs_text = user.rsplit("Question:", 1)[0].lower()
        assert not any(q in docs_text for q in eval_questions)
        assert not any(a.lower() in docs_text for a in eval_long)
    check_raft_leakage(train, ev)  # the builder's own guard agrees


def test_leakage_guard_names_the_eval_question():
    _path_rows = {
        "question_id": "e1",
        "question": "Is the sky green today?",
        "oracle_text": "Sky colour report.",
        "long_answer": "The sky was not green at all today.",
        "answer": "no",
    }
    ev = [{"meta": _path_rows}]
    train = [
        {
            "meta": {
                "question_id": "t1",
                "question": "Other?",
                "oracle_present": True,
                "oracle_text": "x",
                "distractor_texts": ["Notes: the sky was not green at all today. End."],
            }
        }
    ]
    with pytest.raises(LeakageError, match="eval question e1"):
        check_raft_leakage(train, ev)
    train[0]["meta"]["question_id"] = "e1"
    with pytest.raises(LeakageError, match="both the train and eval splits"):
        check_raft_leakage(train, ev)


def test_duplicate_questions_removed(tmp_path):
    path = _synthetic(tmp_path / "qa.jsonl", 60)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    dup = dict(rows[5], id="dup-of-5", question=rows[5]["question"].upper() + "  ")
    path.write_text("".join(json.dumps(r) + "\n" for r in [*rows, dup]))
    build = build_raft(_cfg(path, tmp_path))
    assert build.stats["counts"]["duplicates_removed"] == 1
    assert "dup-of-5" not in {r["meta"]["question_id"] for r in _all_rows(build)}


# ------------------------------------------------------------------------------------------ distractors


def test_distractors_are_never_the_oracle_and_sources_are_reported(synth):
    _, _, build = synth
    for r in _all_rows(build):
        m = r["meta"]
        assert len(m["distractor_ids"]) == 3
        assert len(set(m["distractor_ids"])) == 3
        assert not {c.split("#")[0] for c in m["distractor_ids"]} & set(m["oracle_ids"])
        assert m["oracle_text"] not in m["distractor_texts"]
    realized = build.stats["distractor_sources_realized"]
    assert set(realized) <= {"random", "same_source", "bm25"} and realized.get("same_source", 0) > 0
    assert sum(realized.values()) == 3 * build.stats["num_examples"]


def test_same_source_distractors_share_the_topic(synth, tmp_path):
    path, _, _ = synth
    build = build_raft(_cfg(path, tmp_path, sources={"same_source": 1.0}))
    topics = {json.loads(line)["id"]: json.loads(line)["topic"] for line in path.read_text().splitlines()}
    for r in build.rows["train"]:
        m = r["meta"]
        for cid, src in zip(m["distractor_ids"], m["distractor_sources"]):
            if src == "same_source":
                other_q = cid.split(":oracle")[0]
                assert topics[other_q] == topics[m["question_id"]]


def test_bm25_distractors_rank_lexically_close_chunks(synth, tmp_path):
    path, _, _ = synth
    build = build_raft(_cfg(path, tmp_path, sources={"bm25": 1.0}, k=2))
    assert build.stats["distractor_sources_realized"] == {"bm25": 2 * build.stats["num_examples"]}
    # BM25 picks chunks sharing the question's rare words more often than chance (marker word b and topic).
    hits = 0
    for r in build.rows["train"]:
        words = set(r["meta"]["question"].lower().replace("?", "").split()[4:6])
        hits += any(any(w in t.lower() for w in words) for t in r["meta"]["distractor_texts"])
    assert hits / len(build.rows["train"]) > 0.9


@pytest.mark.slow
def test_hard_distractors_are_never_the_oracle_even_when_duplicated(tmp_path):
    pytest.importorskip("judgeloop.retrieval.mining")
    path = _synthetic(tmp_path / "qa.jsonl", 40)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    # A copy of question 0's oracle under another id: the miner cannot know it is the oracle, the builder must.
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(json.dumps({"id": "copy-of-q0", "text": rows[0]["oracle"]}) + "\n")
    cfg = _cfg(path, tmp_path, sources={"hard": 1.0}, k=3, corpus_path=str(corpus), chunk_tokens=400)
    cfg.distractors.hard.encoder = "judgeloop-tiny/encoder"
    cfg.distractors.hard.mining = {"relative_margin": None}
    build = build_raft(cfg)
    assert build.stats["distractor_sources_realized"].get("hard", 0) > 0
    for r in _all_rows(build):
        m = r["meta"]
        assert not {c.split("#")[0] for c in m["distractor_ids"]} & set(m["oracle_ids"])
        assert m["oracle_text"] not in m["distractor_texts"]
        if m["question_id"] == "q0000":
            assert not any(c.startswith("copy-of-q0") for c in m["distractor_ids"])


# ---------------------------------------------------------------------------------------- determinism


def test_same_seed_same_data_and_other_seed_differs(synth, tmp_path):
    path, _, build = synth
    again = build_raft(_cfg(path, tmp_path))
    assert json.dumps(again.rows, sort_keys=True) == json.dumps(build.rows, sort_keys=True)
    other = build_raft(_cfg(path, tmp_path, seed=1))
    assert json.dumps(other.rows, sort_keys=True) != json.dumps(build.rows, sort_keys=True)
    # The split does not depend on the seed (it hashes the question group), only the sampling does.
    assert [r["meta"]["question_id"] for r in other.rows["eval"]] == [
        r["meta"]["question_id"] for r in build.rows["eval"]
    ]


def test_saved_outputs(synth, tmp_path):
    from datasets import load_from_disk

    _, _, build = synth
    out = save_raft(build, tmp_path / "saved")
    stats = json.loads((out / "stats.json").read_text())
    assert {"num_examples", "oracle_rate", "p_oracle"} <= set(stats)
    lines = (out / "train.jsonl").read_text().splitlines()
    assert len(lines) == stats["num_train"]
    row = json.loads(lines[0])
    assert set(row) == {"messages", "meta"}
    assert {"question_id", "oracle_ids", "distractor_ids"} <= set(row["meta"])
    dd = load_from_disk(str(out / "dataset"))
    assert len(dd["train"]) == stats["num_train"] and len(dd["eval"]) == stats["num_eval"]
    assert dd["train"][0]["messages"] == row["messages"]


# -------------------------------------------------------------------------------------------- chunking


def test_chunks_are_verbatim_token_windows_with_overlap():
    tok = load_tokenizer(TINY)
    text = "  ".join(f"Word{i} means a thing, and it is tested here." for i in range(30))
    chunks = chunk_text(tok, "doc", text, 24, 6)
    assert len(chunks) > 2
    for c in chunks:
        assert text[c.start : c.end] == c.text and c.text == c.text.strip()
        assert c.num_tokens <= 24
        assert (
            len(tok(c.text, add_special_tokens=False)["input_ids"]) <= 24 + 2
        )  # re-tokenizing may merge edges
    for a, b in zip(chunks, chunks[1:]):
        assert b.start < a.end  # overlapping windows
    assert chunks[0].start == 0 and chunks[-1].end == len(text.rstrip())
    assert [c.id for c in chunks] == [f"doc#{i}" for i in range(len(chunks))]


def test_chunk_config_errors():
    with pytest.raises(ValueError, match="overlap_tokens=32 must be in"):
        ChunkConfig(chunk_tokens=32, overlap_tokens=32)
    with pytest.raises(ValueError, match="chunk_tokens=4 is too small"):
        ChunkConfig(chunk_tokens=4, overlap_tokens=0)


# ----------------------------------------------------------------------------------------- config errors


def test_config_errors_name_the_parameter():
    with pytest.raises(ValueError, match=r"p_oracle=1.5 must be in \[0, 1\]"):
        BuildRaftConfig(p_oracle=1.5)
    with pytest.raises(ValueError, match=r"unknown source\(s\) \['bm52'\]"):
        DistractorConfig(sources={"bm52": 1.0})
    with pytest.raises(ValueError, match="non-negative weights with a positive sum"):
        DistractorConfig(sources={"random": 0.0})
    with pytest.raises(ValueError, match="eval_fraction=1.0 must be in"):
        RaftSplitConfig(eval_fraction=1.0)
    with pytest.raises(ValueError, match="data.path is not set"):
        RaftDataConfig(format="pubmedqa")
    with pytest.raises(ValueError, match="max_quotes=0"):
        TargetConfig(max_quotes=0)
    with pytest.raises(ConfigError, match="did you mean 'p_oracle'"):
        load_config(BuildRaftConfig, REPO / "configs/raft/pubmedqa.yaml", ["p_orcle=0.5"])


def test_empty_split_is_an_error(tmp_path):
    path = _synthetic(tmp_path / "qa.jsonl", 3)
    cfg = _cfg(path, tmp_path)
    cfg.split.eval_fraction = 0.01
    with pytest.raises(ValueError, match="left the eval split empty"):
        build_raft(cfg)


# --------------------------------------------------------------------------------------- real data sets


def _need(path: Path) -> Path:
    if not path.exists():
        pytest.skip(f"shared data {path} is absent (read-only data lives beside the repo)")
    return path


def test_pubmedqa_reader_and_overrides(tmp_path):
    path = _need(SHARED / "pubmedqa" / "pubmedqa_dev.jsonl")
    res = read_pubmedqa(path)
    assert len(res.questions) == 493
    q = res.questions[0]
    assert q.answer in {"yes", "no", "maybe"} and q.long_answer and q.oracle_ids[0] in res.corpus
    cfg = load_config(
        BuildRaftConfig,
        REPO / "configs/raft/pubmedqa.yaml",
        [
            "data.format=pubmedqa",
            f"data.path={path}",
            f"output_dir={tmp_path}",
            "data.max_questions=30",
            f"chunk.tokenizer={TINY}",
            "distractors.sources={random: 1.0}",
        ],
    )
    build = build_raft(cfg)
    assert build.stats["num_examples"] == 30
    for r in _all_rows(build):
        if r["meta"]["oracle_present"]:
            assert quotes_are_verbatim(r["messages"][2]["content"], r["meta"]["oracle_text"])


def test_squad_and_scifact_readers():
    squad = read_squad(_need(SHARED / "squad2_sample" / "squad2_sample.jsonl"))
    assert squad.skipped["unanswerable"] > 0 and len(squad.questions) > 200
    q = squad.questions[0]
    a, b = q.evidence
    assert squad.corpus[q.oracle_ids[0]].text[a:b] == q.answer
    sci = read_scifact(_need(SHARED / "scifact"))
    assert len(sci.questions) > 300 and len(sci.corpus) > 5000
    assert all(d in sci.corpus for qq in sci.questions for d in qq.oracle_ids)


def test_lm_generator_falls_back_to_template_when_quotes_are_not_verbatim(tmp_path):
    """A random tiny LM never quotes verbatim: every present example falls back, and is counted."""
    path = _synthetic(tmp_path / "qa.jsonl", 12)
    cfg = _cfg(path, tmp_path, sources={"random": 1.0}, k=1)
    cfg.target.generator = "lm"
    cfg.target.lm_model = TINY
    cfg.target.lm_max_new_tokens = 8
    build = build_raft(cfg)
    present = sum(r["meta"]["oracle_present"] for r in _all_rows(build))
    assert build.stats["lm_generated"] == present
    assert build.stats["lm_fallbacks_to_template"] == present
    for r in _all_rows(build):
        if r["meta"]["oracle_present"]:
            assert quotes_are_verbatim(r["messages"][2]["content"], r["meta"]["oracle_text"])
