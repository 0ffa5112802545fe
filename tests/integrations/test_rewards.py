"""Groupwise rewards from pairwise judgements (judgeloop.rewards) with real judges: an objective
length judge (shorter is better: a planted ranking), the tiny choice judge (pairwise, both orders)."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.special import expit

from judgeloop.calibration import IdentityCalibrator, PlattCalibrator
from judgeloop.judges import JudgeConfig
from judgeloop.judges.calibrated import CalibratedJudge
from judgeloop.rewards import (
    EmptyLoses,
    Group,
    RewardConfig,
    bradley_terry,
    design,
    group_rewards,
    score_groups,
)

ARTICLE = "the council met on monday and voted to expand the city park by ten acres next spring"
# shorter is better for the length judge: the planted ranking is c1 > c2 > ... > c5
COMPLETIONS = [
    "park grows",
    "the park grows soon",
    "the council votes the park grows",
    "the council met and voted so the park grows by ten acres",
    "on monday the council met and voted to expand the city park by ten acres next spring",
]


def _platt(a: float) -> PlattCalibrator:
    cal = PlattCalibrator()
    return cal.load_state_dict(
        {
            "method": "platt",
            "symmetric": True,
            "min_points": 10,
            "n_fit_": 100,
            "params": {"a_": a, "b_": 0.0, "fit_intercept": False, "target_smoothing": False},
        }
    )


@pytest.fixture(scope="module")
def length_judge() -> CalibratedJudge:
    return CalibratedJudge(JudgeConfig(type="objective", signal="length", scale=0.5), _platt(0.7))


@pytest.mark.parametrize("scheme", ["all_pairs", "round_robin", "anchor"])
@pytest.mark.parametrize("aggregate", ["win_rate", "bradley_terry"])
def test_a_planted_ranking_is_recovered_and_the_order_of_completions_does_not_matter(
    length_judge, scheme, aggregate
):
    anchor = "the council voted to expand the park"
    settings = RewardConfig(scheme, aggregate, m=2)
    rewards = group_rewards(length_judge, ARTICLE, COMPLETIONS, settings, anchor=anchor)
    assert all(r is not None for r in rewards)
    assert np.argsort(rewards).tolist() == [4, 3, 2, 1, 0]  # shorter wins
    rng = np.random.default_rng(0)
    for _ in range(3):
        perm = rng.permutation(len(COMPLETIONS))
        shuffled = group_rewards(
            length_judge, ARTICLE, [COMPLETIONS[i] for i in perm], settings, anchor=anchor
        )
        assert shuffled == [rewards[i] for i in perm]  # exactly: the design depends on content only


def test_round_robin_grows_with_k_not_k_squared():
    assert len(design(16, "all_pairs")) == 120
    assert len(design(16, "round_robin", m=2)) == 32
    assert len(design(3, "round_robin", m=5)) == 3  # never more than every pair


def test_identical_completions_tie_exactly_and_need_no_judge_call(length_judge):
    calls = length_judge.calls
    assert group_rewards(length_judge, ARTICLE, ["same text"] * 4) == [0.5] * 4
    assert length_judge.calls == calls  # nothing to judge
    r = group_rewards(
        length_judge, ARTICLE, ["a b", "a b c d", "a b"], RewardConfig(aggregate="bradley_terry")
    )
    assert r[0] == r[2] and r[0] > r[1]


def test_bradley_terry_equals_an_independent_logistic_regression_fit():
    """The MAP strengths under the prior equal an L2 logistic regression on the comparison design
    (rows e_i - e_j, each soft outcome as two weighted hard rows, no intercept, C = 1 / prior)."""
    from sklearn.linear_model import LogisticRegression

    rng = np.random.default_rng(1)
    n, prior = 6, 0.1
    comps = design(n, "all_pairs") + design(n, "round_robin", m=1)
    p = rng.uniform(0.05, 0.95, len(comps))
    theta = bradley_terry(n, comps, p, prior)
    X = np.zeros((len(comps), n))
    for row, (i, j) in enumerate(comps):
        X[row, i], X[row, j] = 1.0, -1.0
    lr = LogisticRegression(C=1 / prior, fit_intercept=False, tol=1e-12, max_iter=10_000)
    lr.fit(np.vstack([X, X]), np.r_[np.ones(len(p)), np.zeros(len(p))], sample_weight=np.r_[p, 1 - p])
    np.testing.assert_allclose(theta, lr.coef_[0], atol=1e-6)
    assert abs(theta.sum()) < 1e-9
    # one completion winning everything stays finite
    assert np.isfinite(bradley_terry(3, [(0, 1), (0, 2), (1, 2)], [1.0, 1.0, 0.5], prior)).all()


def test_a_failed_comparison_is_dropped_and_counted_and_an_unjudged_completion_gets_none(length_judge):
    scores = score_groups(length_judge, [Group(ARTICLE, ["short", " ", "a longer one here"])])
    rewards = scores.rewards[0]
    assert rewards[1] is None and rewards[0] is not None and rewards[0] > rewards[2]
    assert scores.failed == [2] and scores.comparisons == [3] and scores.statuses["empty_summary"] == 2


def test_raw_and_calibrated_rewards_differ_only_through_the_calibrator(length_judge):
    raw_judge = CalibratedJudge(length_judge.config, IdentityCalibrator(), judge=length_judge.judge)
    for aggregate in ("win_rate", "bradley_terry"):
        calibrated = RewardConfig(aggregate=aggregate)
        as_raw = group_rewards(
            length_judge, ARTICLE, COMPLETIONS, RewardConfig(aggregate=aggregate, probability="raw")
        )
        identity = group_rewards(raw_judge, ARTICLE, COMPLETIONS, calibrated)
        assert as_raw == identity
        assert group_rewards(length_judge, ARTICLE, COMPLETIONS, calibrated) != as_raw
    # win rate by hand: the mean calibrated p of beating the others
    out = length_judge.compare([ARTICLE], [COMPLETIONS[0]], [COMPLETIONS[1]])
    assert out.p[0] == pytest.approx(float(expit(0.7 * out.logit[0])))


def test_a_batch_of_groups_is_one_judge_call(length_judge):
    calls = length_judge.calls
    groups = [Group(ARTICLE, COMPLETIONS), Group(ARTICLE, COMPLETIONS[:3]), Group("other", ["x y", "x"])]
    scores = score_groups(length_judge, groups)
    assert length_judge.calls - calls == scores.judge_calls == 1
    assert scores.comparisons == [10, 3, 1]


def test_a_pairwise_judge_that_does_not_debias_is_asked_both_orders():
    judge = CalibratedJudge(
        JudgeConfig(type="choice", model="judgeloop-tiny/causal-lm", position_debias=False, max_length=256),
        IdentityCalibrator(),
    )
    assert judge.pairwise and not judge.debiases
    before = judge.judge.stats.cache_misses
    scores = score_groups(judge, [Group(ARTICLE, COMPLETIONS[:3])])
    assert judge.judge.stats.cache_misses - before == 2 * 3  # 3 comparisons x 2 orders
    assert np.isfinite(scores.position_bias)
    assert 0.0 <= scores.order_agreement <= 1.0 and 0.0 <= scores.mean_margin <= 0.5
    # an empty side is answered without the judge, and its +-inf logits leave the position bias finite
    with_empty = score_groups(EmptyLoses(judge), [Group(ARTICLE, COMPLETIONS[:3] + [" "])])
    assert judge.judge.stats.cache_misses - before == 2 * 3 and np.isfinite(with_empty.position_bias)
    assert with_empty.rewards[0][3] == 0.0 and with_empty.order_agreement == scores.order_agreement
    rewards = scores.rewards[0]
    # the two orders averaged: win rates of a 3-group sum to 3/2 exactly as p(i, j) + p(j, i) = 1
    assert sum(rewards) == pytest.approx(1.5)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"scheme": "anchor"}, "scheme=anchor needs an anchor"),
    ],
)
def test_bad_settings_are_one_line_errors(length_judge, kwargs, message):
    with pytest.raises(ValueError, match=message):
        group_rewards(length_judge, ARTICLE, COMPLETIONS, RewardConfig(**kwargs))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            {"scheme": "pairs"},
            r"'rewards.scheme' must be one of \['all_pairs', .*got 'pairs'; did you mean 'all_pairs'",
        ),
        (
            {"aggregate": "elo"},
            r"'rewards.aggregate' must be one of \['win_rate', 'bradley_terry'\], got 'elo'",
        ),
        (
            {"probability": "logit"},
            r"'rewards.probability' must be one of \['calibrated', 'raw'\], got 'logit'",
        ),
        (
            {"m": 0},
            r"'rewards.m'=0 must be >= 1 \(round_robin compares each completion with the next m; e.g. 2\)",
        ),
        ({"m": 1.5}, r"'rewards.m' expects an integer, got 1.5"),
        ({"m": True}, r"'rewards.m' expects an integer, got True"),
        ({"m": 2**70}, r"'rewards.m'=1180591620717411303424 does not fit in 64 bits; give a smaller integer"),
        ({"prior": 0}, r"'rewards.prior'=0 must be >= 1e-09 \(the Bradley-Terry prior precision; e.g. 0.1\)"),
        ({"prior": -1.0}, r"'rewards.prior'=-1.0 must be >= 1e-09"),
        ({"prior": 1e-300}, r"'rewards.prior'=1e-300 must be >= 1e-09"),  # a singular Newton step
        (
            {"prior": float("inf")},
            r"'rewards.prior'=inf is not a finite number; give a finite number",
        ),  # NaN rewards
        ({"prior": float("nan")}, r"'rewards.prior'=nan is not a finite number"),
        ({"prior": "0.1"}, r"'rewards.prior' expects a number, got '0.1'"),
    ],
)
def test_reward_config_refuses_at_construction_what_the_config_loader_refuses(kwargs, message):
    """RewardConfig built in Python checks what its ``rewards:`` section checks when a config loads, with
    the same one-line message (the key, the value, the fix); nothing reaches the judge."""
    with pytest.raises(ValueError, match=message) as err:
        RewardConfig(**kwargs)
    assert "\n" not in str(err.value)


def test_a_prior_at_the_bound_and_numpy_numbers_are_accepted(length_judge):
    """At the smallest prior the Bradley-Terry fit still converges where a completion loses every
    comparison (an empty one: its strength runs off); numpy scalars become Python numbers."""
    cfg = RewardConfig(aggregate="bradley_terry", prior=1e-9, m=np.int64(3))
    assert type(cfg.m) is int and cfg.m == 3
    rewards = group_rewards(EmptyLoses(length_judge), ARTICLE, COMPLETIONS + [""], cfg)
    assert all(np.isfinite(rewards)) and rewards[-1] == min(rewards)


def test_the_loader_gives_the_same_messages_for_a_rewards_section():
    from judgeloop.config import ConfigError, load_config
    from judgeloop.integrations.grpo import GrpoTrlConfig

    for override, message in [
        ("rewards.prior=inf", r"'rewards.prior'=inf is not a finite number"),
        ("rewards.prior=0", r"'rewards.prior'=0.0 must be >= 1e-09 \(the Bradley-Terry"),
        ("rewards.m=0", r"'rewards.m'=0 must be >= 1 \(round_robin"),
        ("rewards.scheme=pairs", r"'rewards.scheme' must be one of"),
    ]:
        with pytest.raises(ConfigError, match=message):
            load_config(GrpoTrlConfig, None, ["judge_path=runs/x", override])


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"num_generations": 0}, r"num_generations=0; use TRL's num_generations \(an integer >= 1\) or None"),
        ({"num_generations": 2.5}, r"num_generations=2.5; use TRL's num_generations \(an integer"),
        ({"num_generations": True}, r"num_generations=True"),
        (
            {"keep_history": -1},
            r"keep_history=-1; use the number of calls to keep \(an integer >= 0; 0: none\)",
        ),
        ({"keep_history": 1.5}, r"keep_history=1.5"),
        ({"source_column": ""}, r"source_column=''; give a non-empty string"),
        ({"anchor_column": 3}, r"anchor_column=3; give a dataset column's name or None"),
        ({"empty": "skip"}, r"empty='skip'; use lose"),
        ({"rewards": RewardConfig(scheme="anchor")}, r"scheme=anchor needs anchor_column"),
    ],
)
def test_judge_reward_refuses_bad_arguments_at_construction(length_judge, kwargs, message):
    from judgeloop.integrations.trl import JudgeReward

    with pytest.raises(ValueError, match=message):
        JudgeReward(length_judge, **kwargs)
    assert JudgeReward(length_judge, num_generations=np.int64(4)).num_generations == 4
