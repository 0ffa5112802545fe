"""The served judge's label-probability routes against the loopback server answering in each server's shape
(``testing/openai_compat.py`` over the tiny Llama): ``generative_scoring`` (vLLM 0.32), ``systemone`` (vLLM
0.32's structured decisions) and ``decisions`` (OpenAI's Decisions shape, vLLM 0.33; SGLang 0.5's own). The
decision routes accept only Qwen3-family models in vLLM (``READ_STRATEGIES``), none of which installs here,
so they are tested against this server only; ``generative_scoring`` also against a real vLLM
(``test_served_vllm.py``)."""

from __future__ import annotations

import math
import threading

import numpy as np
import pytest

from judgeloop.judges import JudgeConfig, ServerConfig, build_judge
from judgeloop.judges.served_client import Question, parse_decisions
from judgeloop.testing.openai_compat import LocalModel, make_server

TINY = "judgeloop-tiny/causal-lm"
ARTICLES = ["The cat sat on the mat today. It was warm and the sun was out."] * 3 + ["Rain fell all day."]
A = ["A cat sat.", "The mat was warm.", "Cat.", "It rained."]
B = ["It was warm.", "A cat.", "The cat sat on the mat.", "Sun all day."]


@pytest.fixture(scope="module")
def tiny_lm():
    return LocalModel(TINY)


def _serve(lm, routes):
    srv = make_server(lm, routes=routes)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, f"http://127.0.0.1:{srv.server_port}"


def _judge(url, **server):
    return build_judge(
        JudgeConfig(type="served", model=TINY, server=ServerConfig(base_url=url, model=TINY, **server))
    )


def _reference(lm, question: Question, json_values: bool = False) -> tuple[float, float]:
    """``(log p_A - log p_B, label mass)`` of the server's own prompt for ``question``, computed here."""
    tok = lm.tokenizer
    names = [f'"{o}"' if json_values else o for o in question.options]
    content = "\n".join(
        [
            f"{question.state}\n\nQuestion: {question.instructions}",
            f"A: {names[0]}",
            f"B: {names[1]}",
            "Answer with the letter of one option only.",
        ]
    )
    if getattr(tok, "chat_template", None):
        text = tok.apply_chat_template(
            [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
        )
        ids = list(tok.encode(text, add_special_tokens=False))
    else:
        ids = list(tok.encode(content + "\n\nAnswer:", add_special_tokens=False))
    lp = lm.next_logprobs(ids)
    la, lb = (float(lp[tok.encode(x, add_special_tokens=False)[-1]]) for x in "AB")
    return la - lb, math.exp(la) + math.exp(lb)


def test_generative_scoring_equals_the_vllm_route_in_two_requests(tiny_lm):
    srv, url = _serve(tiny_lm, ("completions", "generative_scoring"))
    try:
        want = _judge(url, route="vllm")(ARTICLES, A, B)
        before = srv.requests
        judge = _judge(url, route="generative_scoring")
        out = judge(ARTICLES, A, B)
        assert srv.requests - before == 2  # 8 prompts (both orders of 4 pairs), one request per verdict token
        assert out.status == ["ok"] * 4
        np.testing.assert_allclose(out.forward, want.forward, atol=1e-6)
        np.testing.assert_allclose(out.scores, want.scores, atol=1e-6)
        assert len(judge.stats.label_mass) == 8
    finally:
        srv.shutdown()


@pytest.mark.parametrize("route", ["systemone", "decisions", "sglang_decisions"])
def test_a_decision_route_reads_the_servers_prompt_both_orders_in_one_request(tiny_lm, route):
    srv, url = _serve(tiny_lm, (route,))
    try:
        judge = _judge(url, route="decisions" if route == "sglang_decisions" else route)
        out = judge(ARTICLES, A, B)
        # two articles: one request each carries both orders of its pairs (SGLang refuses OpenAI's shape with
        # a 400: both first requests, in flight together, are sent again in its own, kept for the run)
        assert srv.requests == (4 if route == "sglang_decisions" else 2)
        assert out.status == ["ok"] * 4
        from judgeloop.judges.base import Pair

        forward, masses = [], []
        for x, a, b in zip(ARTICLES, A, B):
            f, m = _reference(tiny_lm, judge.question(Pair(x, a, b)), json_values=route == "decisions")
            r, _ = _reference(tiny_lm, judge.question(Pair(x, b, a)), json_values=route == "decisions")
            forward.append(f)
            masses.append(m)
            assert (f - r) / 2 == pytest.approx(out.scores[len(forward) - 1], abs=1e-5)
        np.testing.assert_allclose(out.forward, forward, atol=1e-5)
        assert judge.stats.label_mass[:1] == pytest.approx(masses[:1], abs=1e-6)
        # the tiny random model puts little mass on A and B: a threshold above it flags them, scored
        flagged = _judge(url, route=judge.route, min_label_mass=1.0)(ARTICLES, A, B)
        assert flagged.status == ["low_label_mass"] * 4 and np.isfinite(flagged.scores).all()
    finally:
        srv.shutdown()


def test_route_auto_tries_the_routes_in_the_stated_order(tiny_lm):
    """A server with only a decision route: ``auto`` probes vllm, sglang, generative_scoring, top_logprobs
    (each a 404 here), then decisions; with the completions route too it stops at the first, vllm."""
    srv, url = _serve(tiny_lm, ("systemone",))
    try:
        judge = _judge(url)
        assert judge(ARTICLES[:1], A[:1], B[:1]).status == ["ok"] and judge.route == "systemone"
    finally:
        srv.shutdown()
    srv, url = _serve(tiny_lm, ("completions", "generative_scoring", "systemone"))
    try:
        judge = _judge(url)
        judge(ARTICLES[:1], A[:1], B[:1])
        assert judge.route == "vllm"
    finally:
        srv.shutdown()


def test_the_graded_extractor_refuses_a_decision_route_in_one_line():
    with pytest.raises(ValueError, match="judge.server.route='systemone' with judge.extractor=graded"):
        JudgeConfig(
            type="served",
            model=TINY,
            extractor="graded",
            server=ServerConfig(base_url="http://x", model=TINY, route="systemone"),
        )


@pytest.mark.parametrize(
    "answer",
    [
        {"answers": {"q0": {"probabilities": {"Summary A": 0.7}, "label_mass": 0.5}}},  # an option missing
        {"answers": {"q0": {"probabilities": {"Summary A": 0.7, "Summary B": 1.3}, "label_mass": 0.5}}},
        {"answers": {"q0": {"probabilities": {"Summary A": 0.7, "Summary B": 0.3}, "label_mass": "x"}}},
        {"answers": [{"name": "other", "probabilities": [], "confidence": 0.1}]},
        {
            "answers": {"q0": {"probabilities": {"Summary A": 0.7, "Summary B": 0.3}}}
        },  # no mass, no confidence
    ],
)
def test_a_decision_answer_of_another_shape_is_an_error(answer):
    q = Question("art", "which?", ("Summary A", "Summary B"))
    with pytest.raises((ValueError, KeyError, TypeError)):
        parse_decisions("decisions", answer, [q])


def test_a_served_judge_has_no_prefetch_work():
    """The training loop prefetches a judge's article-side work when it has some (``Judge._prepare``); the
    served judges have none (a set-up method of theirs once took that name, and ``judgeloop train`` with
    prefetching failed with a TypeError: found by ``test_served_vllm.py``'s train run)."""
    from judgeloop.judges.base import Judge
    from judgeloop.judges.served import GradedJudge, ServedJudge, ServedLikelihoodJudge

    for cls in (ServedJudge, GradedJudge, ServedLikelihoodJudge):
        assert cls._prepare is Judge._prepare, cls
