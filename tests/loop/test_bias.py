"""Judges with a known bias: the style dial, the extractive target, and the label-free arm that removes a
style term."""

from __future__ import annotations

import numpy as np
import pytest

from judgeloop.calibration import StyleResidualCalibrator, calibrator_from_state
from judgeloop.data import SummExample
from judgeloop.judges import JudgeConfig, Pair, StyledJudge, build_judge, references_for, style_feature
from judgeloop.judges.embedding import EmbeddingJudge
from judgeloop.metrics.text import copy_rate

ENCODER = "judgeloop-tiny/encoder"
ARTICLE = (
    "The city council approved a new budget on Tuesday. It raises spending on parks and schools. "
    "The mayor said the plan would be paid for by a small tax on hotel rooms."
)
PAIRS = [
    Pair(
        ARTICLE, "The city council approved a new budget on Tuesday.", "Parks get money.", ("Budget passes.",)
    ),
    Pair(
        ARTICLE, "A hotel tax funds the plan.", "It raises spending on parks and schools.", ("Tax funds it.",)
    ),
    Pair(ARTICLE, "", "The mayor said the plan would be paid for.", ("x",)),  # empty: not scored
]


def _example(i: int = 0) -> SummExample:
    return SummExample(
        f"ex{i}",
        ARTICLE,
        {"neutral": ["A hotel tax will fund more parks."], "extractive": [ARTICLE.split(". ")[0]]},
    )


@pytest.mark.parametrize("feature", ["copy_rate", "log_length_ratio", "novel_bigram"])
@pytest.mark.parametrize("debias", [False, True])
def test_styled_judge_moves_the_logit_by_exactly_weight_times_d(feature, debias):
    base = build_judge(JudgeConfig(type="embedding", model=ENCODER, position_debias=debias))
    styled = build_judge(
        JudgeConfig(
            type="embedding", model=ENCODER, position_debias=debias, style_weight=2.5, style_feature=feature
        )
    )
    assert isinstance(styled, StyledJudge) and not isinstance(base, StyledJudge)
    b, s = base.score(PAIRS), styled.score(PAIRS)
    d = np.array([style_feature(feature, p.article, p.a, p.b) for p in PAIRS])
    np.testing.assert_array_equal(s.scores[:2], b.scores[:2] + 2.5 * d[:2])
    assert (
        np.isnan(s.scores[2]) and s.status == b.status
    )  # a failed item stays failed, never gets the style term
    if debias:  # each order is shifted by its own d, so the debiased score moves by w * d too
        np.testing.assert_array_equal(s.reverse[:2], b.reverse[:2] - 2.5 * d[:2])
    # the copy-rate feature is the difference the name says
    if feature == "copy_rate":
        p = PAIRS[0]
        assert d[0] == pytest.approx(copy_rate(p.a, ARTICLE) - copy_rate(p.b, ARTICLE)) and d[0] > 0


def test_style_weight_zero_is_the_base_judge():
    judge = build_judge(JudgeConfig(type="embedding", model=ENCODER, style_weight=0.0))
    assert not isinstance(judge, StyledJudge)


def test_extractive_target_reads_the_extractive_references():
    ext = build_judge(JudgeConfig(type="embedding", model=ENCODER, embedding_target="extractive"))
    refs = build_judge(JudgeConfig(type="embedding", model=ENCODER, embedding_target="references"))
    ex = _example()
    assert references_for(ext, [ex]) == [tuple(ex.extractive)]
    assert references_for(refs, [ex]) == [tuple(ex.neutral)]
    a, b = "The city council approved a new budget on Tuesday.", "A hotel tax will fund more parks."
    got = ext([ex.article], [a], [b], references_for(ext, [ex])).scores[0]
    # the same as a references judge handed the extractive references, and not what it gives on the neutral ones
    assert got == pytest.approx(refs([ex.article], [a], [b], [tuple(ex.extractive)]).scores[0])
    assert got != pytest.approx(refs([ex.article], [a], [b], [tuple(ex.neutral)]).scores[0])
    assert got > 0  # the lead sentence is the extractive reference itself
    # the loop's judge step hands it the extractive references as well
    from judgeloop.loop.rollout import Rollout
    from judgeloop.loop.steps import PairBatch, judge_step

    roll = Rollout(prompts=[[1]], a_ids=[[1]], b_ids=[[1]], articles=[ex.article], a_text=[a], b_text=[b])
    assert judge_step(ext, PairBatch(1, [ex], rollout=roll)).scores[0] == pytest.approx(got)
    assert isinstance(ext, EmbeddingJudge) and ext.reference_style == "extractive"
    styled = build_judge(
        JudgeConfig(type="embedding", model=ENCODER, embedding_target="extractive", style_weight=1.0)
    )
    assert references_for(styled, [ex]) == [tuple(ex.extractive)]


# --- the label-free arm ----------------------------------------------------------------------------


def _synthetic(n: int, style: float, seed: int = 0):
    rng = np.random.default_rng(seed)
    f = np.stack([rng.normal(0, 0.4, n), rng.normal(0, 0.2, n)], axis=1)  # log length ratio, copy-rate diff
    t = rng.normal(0, 1.0, n)  # the style-free part of the judge's preference
    s = t + style * f[:, 1]
    return s, f, t


def test_label_free_arm_removes_a_planted_linear_style_term():
    s, f, t = _synthetic(400, style=6.0)
    cal = StyleResidualCalibrator(min_points=10).fit(s, None, f)
    assert cal.beta_[1] == pytest.approx(6.0, abs=0.5) and abs(cal.beta_[0]) < 0.5
    p = cal.predict_proba(s, f)
    # what is left is the style-free logit (up to the estimation error of beta)
    np.testing.assert_allclose(np.log(p / (1 - p)), t, atol=0.6)
    # antisymmetric: P(a over b) = 1 - P(b over a)
    np.testing.assert_allclose(cal.predict_proba(-s, -f), 1 - p)
    # and it round-trips through its state
    again = calibrator_from_state(cal.state_dict())
    np.testing.assert_array_equal(again.predict_proba(s, f), p)


def test_label_free_arm_leaves_a_style_free_judge_unchanged():
    s, f, _ = _synthetic(400, style=0.0, seed=3)
    cal = StyleResidualCalibrator(min_points=10).fit(s, None, f)
    assert cal.wald_p_ > 0.05
    np.testing.assert_array_equal(cal.beta_, 0.0)
    from scipy.special import expit

    np.testing.assert_array_equal(cal.predict_proba(s, f), expit(s))  # exactly the raw arm


def test_label_free_arm_reads_no_labels():
    s, f, _ = _synthetic(200, style=4.0, seed=5)
    a = StyleResidualCalibrator().fit(s, np.ones(200), f)
    b = StyleResidualCalibrator().fit(s, np.zeros(200), f)  # one class, any labels: the same fit
    np.testing.assert_array_equal(a.beta_, b.beta_)
