"""The retrieval agent's loop (retrieval/agent.py), its policies (retrieval/agent_policies.py) and the
``judgeloop agent`` command's refusals: on a tiny corpus with the tiny encoder and the tiny causal LM
(real models built from config; greedy decoding)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from judgeloop.retrieval.agent import (
    AgentState,
    Budget,
    ScriptedPolicy,
    draft_answer,
    query_key,
    replay,
    run_episode,
)
from judgeloop.retrieval.agent_policies import (
    ActionValueController,
    LearnedPolicy,
    action_reward,
    feature_vector,
)
from judgeloop.retrieval.escalation import expand_query

DOCS = [
    "The Normans settled in Normandy in the tenth century.",
    "Rollo was a Viking leader who founded the duchy of Normandy.",
    "A Turing machine is a model of computation.",
    "Complexity theory classifies problems by the resources they need.",
    "Jersey and Guernsey are islands in the English Channel.",
    "The treaty of Saint-Clair-sur-Epte granted land to Rollo.",
    "Graph isomorphism is a problem in computer science.",
    "Norman architecture has round arches.",
]
QUESTIONS = ["Who founded the duchy of Normandy?", "What is a Turing machine?"]


@pytest.fixture(scope="module")
def lm():
    from judgeloop.models import load_causal_lm, load_tokenizer

    return load_causal_lm("judgeloop-tiny/causal-lm"), load_tokenizer("judgeloop-tiny/causal-lm")


def _toolbox(lm, cache_path=None):
    from judgeloop.retrieval.agent_tools import CorpusToolbox, LMCache, LMSettings
    from judgeloop.retrieval.bm25 import build_bm25
    from judgeloop.retrieval.encoder import BiEncoder

    enc = BiEncoder.from_pretrained("judgeloop-tiny/encoder", normalize=True, max_length=32)

    def encode(texts):
        return enc.encode(list(texts), batch_size=8, is_query=True).numpy()

    corpus = enc.encode(DOCS, batch_size=8).numpy()
    settings = LMSettings(4, 6, 6, 4, 4, 16, "Answer briefly.")
    model, tok = lm
    return CorpusToolbox(
        [f"d{i}" for i in range(len(DOCS))],
        DOCS,
        corpus,
        encode,
        build_bm25(DOCS),
        model,
        tok,
        LMCache(cache_path, "judgeloop-tiny/causal-lm"),
        settings,
    )


ALL = ["dense", "fuse", "rewrite", "hyde", "decompose", "bm25"]


def _drafting(state, toolbox, budget):
    """An observer that drafts an answer at every window (charged), as the confidence policies do."""
    out = draft_answer(state, toolbox, budget) if state.rankings else None
    return {} if out is None else {"drafted": 1.0}


def test_the_budget_is_never_exceeded(lm):
    tb = _toolbox(lm)
    unlimited = run_episode(QUESTIONS[0], tb, ScriptedPolicy(ALL), Budget(max_rounds=6), _drafting)
    assert unlimited.rounds == 6 and unlimited.tokens > 0
    cut_short = 0
    for max_rounds in (1, 2, 4):
        for max_tokens in (0, 40, 120, unlimited.tokens // 2, None):
            b = Budget(max_rounds=max_rounds, max_tokens=max_tokens)
            st = run_episode(QUESTIONS[0], tb, ScriptedPolicy(ALL), b, _drafting)
            assert st.rounds <= max_rounds
            assert max_tokens is None or st.tokens <= max_tokens, (max_rounds, max_tokens, st.tokens)
            for step in st.steps:  # never over the limit along the way either
                assert step.budget["rounds"] <= max_rounds
                assert max_tokens is None or step.budget["tokens"] <= max_tokens
            cut_short += st.tokens < unlimited.tokens
            if max_tokens == 0:  # no LM call fits: evidence from the retrievers only, then a refusal
                assert st.lm_calls == 0 and st.refused and "answer" not in st.actions
    assert cut_short >= 10  # the limits bit: most runs stopped before the unlimited one


def test_a_repeated_query_is_caught_and_not_run(lm):
    tb = _toolbox(lm)
    # fuse after dense runs only BM25 (its dense probe repeats); bm25 after fuse repeats every probe
    st = run_episode(QUESTIONS[0], tb, ScriptedPolicy(["dense", "fuse", "bm25"]), Budget(max_rounds=3))
    fuse, bm25 = st.steps[1], st.steps[2]
    assert [p["repeated"] for p in fuse.probes] == [True, False]
    assert [p["repeated"] for p in bm25.probes] == [True]
    assert bm25.reason.startswith("repeated query")
    assert st.retrievals == 2 and st.repeats == 2 and len(st.rankings) == 2
    # a rewrite that only repeats or reorders the question's words is the same query
    q = QUESTIONS[0]
    assert query_key("dense", expand_query(q, "normandy founded duchy")) == query_key("dense", q)
    assert query_key("dense", expand_query(q, "Viking Rollo")) != query_key("dense", q)
    assert query_key("bm25", q) != query_key("dense", q)


def test_a_trace_replays_to_the_same_answer(lm, tmp_path):
    tb = _toolbox(lm, tmp_path / "lm_cache.jsonl")
    b = Budget(max_rounds=4, max_tokens=2000)
    st = run_episode(QUESTIONS[1], tb, ScriptedPolicy(["dense", "rewrite", "hyde", "decompose"]), b)
    assert st.answer is not None and st.lm_calls == 4
    trace = json.loads(json.dumps(st.trace()))  # what traces.jsonl holds
    # a fresh toolbox (a restarted run) reads the LM outputs from the cache file
    again = replay(trace, _toolbox(lm, tmp_path / "lm_cache.jsonl"), b)
    assert again.answer == trace["answer"]
    assert again.window() == trace["window"] and again.actions == trace["actions"]
    assert again.tokens == trace["used"]["tokens"]
    assert [p["candidates"] for s in again.trace()["steps"] for p in s["probes"] if "candidates" in p] == [
        p["candidates"] for s in trace["steps"] for p in s["probes"] if "candidates" in p
    ]


def test_the_reward_and_the_learned_policy_by_hand():
    costs = {"dense": 0.0, "rewrite": 0.03, "hyde": 0.05, "answer": 0.01}
    assert action_reward(0.7, ["dense", "rewrite", "answer"], costs, False, 0.2) == pytest.approx(0.66)
    assert action_reward(0.7, ["dense", "hyde", "refuse"], costs, True, 0.2) == pytest.approx(0.15)
    # a controller on rows whose reward is linear in one feature recovers it exactly (l2=0)
    rng = np.random.default_rng(0)
    X = rng.normal(size=(60, len(feature_vector({}))))
    acts = ["answer"] * 30 + ["rewrite"] * 30
    r = np.where(np.asarray(acts) == "answer", 0.5 + 0.1 * X[:, 0], 0.2 - 0.3 * X[:, 0])
    c = ActionValueController(l2=0.0).fit(X, acts, r)
    x = np.zeros(X.shape[1])
    x[0] = 2.0
    pred = c.predict(x)
    assert pred["answer"] == pytest.approx(0.7) and pred["rewrite"] == pytest.approx(-0.4)
    pol = LearnedPolicy(c, refuse_reward=0.75, name="learned")
    st = AgentState("q", steps=[object()])  # after the first retrieval
    signals = {"top1": 2.0}
    assert pol.choose(st, signals, ["rewrite", "answer", "refuse"]) == "refuse"  # 0.75 > 0.7
    pol.refuse_reward = 0.1
    assert pol.choose(st, signals, ["rewrite", "answer", "refuse"]) == "answer"


def test_controller_rows_are_the_judged_quality_minus_costs(lm):
    """The study's training rows on a constructed case: reward-to-go of each explored action, by hand."""
    from judgeloop.studies.agent import AgentConfig, Outcome, controller_rows

    cfg = AgentConfig(data={"format": "squad2", "path": "x.jsonl"})  # type: ignore[arg-type]
    c = cfg.costs
    root = Outcome(
        0, ("dense",), AgentState("q"), "a", -1.0, {"top1": 0.5}, judged={"calibrated": 0.4, "raw": 0.9}
    )
    hyde = Outcome(
        0,
        ("dense", "hyde"),
        AgentState("q"),
        "b",
        -1.0,
        {"top1": 0.8},
        judged={"calibrated": 0.7, "raw": 0.6},
    )
    other = Outcome(
        1, ("dense",), AgentState("q2"), "c", -1.0, {"top1": 0.1}, judged={"calibrated": 0.3, "raw": 0.5}
    )
    X, acts, rewards = controller_rows(cfg, [root, hyde, other], {0}, "calibrated")
    assert acts == ["answer", "answer", "hyde"]
    assert rewards == pytest.approx([0.4 - c.answer, 0.7 - c.answer, 0.7 - c.hyde - c.answer])
    assert X[2][0] == 0.5  # the hyde row is read at the root's state
    _, _, raw = controller_rows(cfg, [root, hyde, other], {0}, "raw")
    assert raw == pytest.approx([0.9 - c.answer, 0.6 - c.answer, 0.6 - c.hyde - c.answer])


@pytest.mark.parametrize(
    "override, names",
    [
        ("max_rounds=0", "max_rounds"),
        ("actions=[bm25,fuse]", "dense"),
        ("data.format=squad2", "data.path"),
        ("gate_escalation=dense", "gate_escalation"),
        ("escalation_order=[fuse,rerank]", "escalation_order"),
        ("max_tokens=-5", "max_tokens"),
    ],
)
def test_a_bad_setting_is_one_line_and_exit_2(tmp_path, capsys, override, names):
    from judgeloop.cli import main

    rc = main(["agent", "--config", "configs/agent/scifact.yaml", f"output_dir={tmp_path / 'out'}", override])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert names in err[0] and err[0].startswith("judgeloop agent: config error")
    assert not (tmp_path / "out").exists()


def test_the_oracle_takes_the_best_quality_minus_cost_and_drops_the_leafs_terminal_step():
    from judgeloop.studies.agent import AgentConfig, AgentData, Outcome, oracle_script

    cfg = AgentConfig(data={"format": "squad2", "path": "x.jsonl"})  # type: ignore[arg-type]
    data = AgentData("squad2", ["a"], ["q"], [["rollo"]], [{0}], ["p0"], ["Rollo."])

    def leaf(actions, quality):
        st = AgentState("q")
        st.steps = [type("S", (), {"action": a})() for a in actions]  # what the exploration leaves hold
        return Outcome(0, tuple(actions[:-1]), st, "x", -1.0, scores={"quality": quality})

    root = leaf(["dense", "refuse"], 0.5)
    rewrite = leaf(["dense", "rewrite", "refuse"], 0.5 + cfg.costs.rewrite / 2)  # gains less than it costs
    fuse = leaf(["dense", "fuse", "refuse"], 0.6)
    assert oracle_script(cfg, data, [root, rewrite], 0) == ["dense", "answer"]
    assert oracle_script(cfg, data, [root, rewrite, fuse], 0) == ["dense", "fuse", "answer"]
    assert oracle_script(cfg, data, [leaf(["dense", "refuse"], 0.0)], 0) == ["refuse"]
