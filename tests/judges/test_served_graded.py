"""The served judge's pointwise rubric extractor (``judge.extractor: graded``) against a real HTTP server on
a loopback port (judgeloop's ``testing/openai_compat.py`` over the tiny Llama): the expected grade equals
the one computed from the same model in process, pairs are exact differences, every route reads it."""

from __future__ import annotations

import math

import numpy as np
import pytest

from judgeloop.judges import JudgeConfig, ServerConfig, build_judge
from judgeloop.judges.served import GradedJudge, expected_grade
from judgeloop.judges.served_client import Reply
from served_common import ARTICLES, TINY, A, B, calibrate_served_tiny, start_server, stop_server


def _graded(url, grades=5, **server):
    cfg = JudgeConfig(
        type="served",
        model=TINY,
        extractor="graded",
        grades=grades,
        server=ServerConfig(base_url=url, model=TINY, **server),
    )
    return build_judge(cfg)


def _in_process(lm, judge, article, summary):
    """The expected grade from the same model's next-token log-probabilities, computed here."""
    ids, _ = judge.prompt_ids(article, summary)
    lp = lm.next_logprobs(ids)
    p = np.exp(np.array([float(lp[t]) for t in judge.grade_ids]))
    return float((np.arange(1, judge.grades + 1) * p).sum() / p.sum())


@pytest.mark.parametrize("route", ["vllm", "sglang", "top_logprobs"])
def test_the_expected_grade_equals_the_in_process_one_on_every_route(tiny_server, tiny_lm, route):
    extra = (
        {"top_logprobs": len(tiny_lm.tokenizer)} if route == "top_logprobs" else {}
    )  # k: the whole vocabulary
    judge = _graded(tiny_server, route=route, **extra)
    assert isinstance(judge, GradedJudge) and not judge.position_debias
    out = judge(ARTICLES, A, B)
    assert out.status == ["ok"] * 4
    want = [
        _in_process(tiny_lm, judge, x, a) - _in_process(tiny_lm, judge, x, b)
        for x, a, b in zip(ARTICLES, A, B)
    ]
    np.testing.assert_allclose(out.scores, want, atol=1e-5)
    assert all(-4 <= s <= 4 for s in out.scores)  # a difference of two grades in [1, 5]
    # pointwise: the swapped pairs are the exact negatives, and no summary is graded twice
    calls = judge.client.calls
    np.testing.assert_array_equal(judge(ARTICLES, B, A).scores, -out.scores)
    assert judge.client.calls == calls
    assert judge.describe()["extractor"] == "graded" and len(judge.describe()["verdict_token_ids"]) == 5


def test_grades_outside_the_top_k_are_counted_and_a_text_grade_is_a_hard_value():
    ids = (11, 12, 13)
    assert expected_grade(
        Reply({11: math.log(0.5), 12: math.log(0.25), 13: math.log(0.25)}, None, ""), ids
    ) == (
        pytest.approx(1.75),
        "ok",
    )
    value, status = expected_grade(Reply({11: math.log(0.2), 13: math.log(0.6)}, -3.0, ""), ids)
    assert status == "outside_topk" and value == pytest.approx((1 * 0.2 + 3 * 0.6) / 0.8)
    assert expected_grade(Reply({99: -0.1}, -3.0, ""), ids)[1] == "unparsed"
    assert expected_grade(Reply(None, None, " 2 "), ids) == (2.0, "text_only")
    assert expected_grade(Reply(None, None, "7"), ids)[1] == "unparsed"  # not a grade of 1..3
    assert expected_grade(Reply(error="HTTP 500"), ids)[1] == "failed"


def test_a_dead_server_masks_the_pairs_and_asks_again_next_time(tiny_lm):
    srv, url = start_server(tiny_lm)
    judge = _graded(url, route="vllm", max_retries=0, timeout_s=2)
    stop_server(srv)
    out = judge(ARTICLES[:2], A[:2], B[:2])
    assert out.status == ["failed", "failed"] and np.isnan(out.scores).all()
    assert not [v for v in judge._values.values() if v[1] == "failed"]  # never remembered


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            {"type": "choice", "extractor": "graded"},
            "judge.extractor='graded' is read by the served judge only",
        ),
        ({"grades": 12}, r"judge.grades=12 must be in \[2, 9\]"),
        ({"position_debias": True}, "no order to debias"),
    ],
)
def test_bad_graded_settings_are_one_line(overrides, message):
    base = {
        "type": "served",
        "model": TINY,
        "extractor": "graded",
        "server": ServerConfig(base_url="http://x", model="m"),
    }
    if overrides.get("type") == "choice":
        base.pop("server")
    with pytest.raises(ValueError, match=message):
        JudgeConfig(**{**base, **overrides})


def test_calibrate_fits_and_saves_the_graded_served_judge(tiny_server, tmp_path):
    from judgeloop.judges.calibrated import CalibratedJudge

    out = tmp_path / "run"
    rc = calibrate_served_tiny(tiny_server, out, "judge.extractor=graded", "judge.position_debias=null")
    assert rc == 0
    judge = CalibratedJudge.from_pretrained(out / "calibrated_judge" / "platt")
    assert isinstance(judge.judge, GradedJudge)
    comp = judge.compare(ARTICLES, A, B)
    assert comp.status == ["ok"] * 4 and np.isfinite(comp.p).all()
    np.testing.assert_allclose(judge.compare(ARTICLES, B, A).logit, -comp.logit)
