"""Recalibration (judgeloop.loop.recalibration): the schedule, the ECE monitor, leakage, fresh pairs."""

from __future__ import annotations

import numpy as np
import pytest

from judgeloop.config import load_config
from judgeloop.data import LeakageError, SummExample
from judgeloop.loop.config import FeedbackLoopConfig, LoopCalibrationConfig
from judgeloop.loop.recalibration import (
    CalibrationPairs,
    check_calibration_disjoint,
    monitor_due,
    recalibration_reason,
)
from loop_common import FAST, TINY


def test_recalibration_schedule_fires_when_it_should():
    cfg = LoopCalibrationConfig(
        method="platt", recalibrate_every_n_steps=3, monitor_every_n_steps=2, ece_threshold=0.1
    )
    fired = [s for s in range(1, 10) if recalibration_reason(s, cfg, None)]
    assert fired == [3, 6, 9]
    assert recalibration_reason(4, cfg, 0.25) == "ece"  # monitored ECE above threshold
    assert recalibration_reason(4, cfg, 0.05) is None
    assert recalibration_reason(3, cfg, 0.25) == "schedule"
    assert [s for s in range(1, 7) if monitor_due(s, cfg)] == [2, 4, 6]
    raw = LoopCalibrationConfig(method="raw", recalibrate_every_n_steps=1, monitor_every_n_steps=1)
    assert recalibration_reason(3, raw, 0.9) is None and not monitor_due(2, raw)
    oracle = LoopCalibrationConfig(method="oracle", recalibrate_every_n_steps=1)
    assert recalibration_reason(1, oracle, None) is None


def test_maybe_recalibrate_refits_on_high_monitored_ece():
    from judgeloop.calibration import make_calibrator
    from judgeloop.loop.recalibration import maybe_recalibrate
    from judgeloop.loop.state import LoopState

    rng = np.random.default_rng(0)
    n = 80
    s = rng.normal(0, 3, n)
    y = (rng.random(n) < 1 / (1 + np.exp(-s / 3))).astype(int)  # the raw logit is over-confident by 3x
    pairs = CalibrationPairs(
        [f"c{i}" for i in range(n)],
        ["art"] * n,
        [f"a{i}" for i in range(n)],
        [f"b{i}" for i in range(n)],
        s.tolist(),
        y.tolist(),
    )
    cfg = load_config(
        FeedbackLoopConfig,
        TINY,
        [
            "calibration.recalibrate_every_n_steps=0",
            "calibration.monitor_every_n_steps=2",
            "calibration.ece_threshold=0.05",
            "calibration.min_points=10",
        ],
    )
    calls = []

    def collect(step):
        calls.append(step)
        return pairs

    cal = make_calibrator("platt").fit(s, y)
    cal.a_ = 3.0  # an over-confident calibrator: the monitor must catch it
    state = LoopState()
    out = maybe_recalibrate(1, state, cal, collect, cfg)
    assert out is cal and calls == [] and state.refits == []  # not due
    out = maybe_recalibrate(2, state, cal, collect, cfg)
    assert calls == [2] and len(state.refits) == 1 and state.refits[0]["reason"] == "ece"
    rec = state.refits[0]
    assert rec["refit"] and rec["ece_after"] < rec["ece_before"]
    assert out is not cal and out.a_ == pytest.approx(1 / 3, abs=0.2)


def test_leakage_check_raises_on_training_articles_in_calibration():
    train = [
        SummExample("t1", "Alpha beta gamma.", {"neutral": ["a"]}),
        SummExample("t2", "Delta.", {"neutral": ["d"]}),
    ]
    calib_ok = [SummExample("c1", "Epsilon zeta.", {"neutral": ["e"]})]
    check_calibration_disjoint(train, calib_ok)
    with pytest.raises(LeakageError, match="calibration articles overlap the policy's training articles"):
        check_calibration_disjoint(train, [*calib_ok, SummExample("t2", "Other text.", {"neutral": ["o"]})])
    with pytest.raises(LeakageError, match="identical article text"):
        check_calibration_disjoint(train, [SummExample("c9", "alpha  beta gamma.", {"neutral": ["x"]})])


def test_calibration_collection_draws_more_articles_when_ties_leave_too_few_pairs():
    """Ties carry no label; when fewer than min_points pairs remain to fit on, more calibration articles
    are drawn (up to extra_rounds more batches), and never when there are enough."""
    from accelerate import Accelerator

    from judgeloop.judges import build_judge
    from judgeloop.loop.policy import load_policy
    from judgeloop.loop.recalibration import collect_calibration_pairs
    from judgeloop.loop.rollout import PromptBuilder
    from judgeloop.loop.state import load_splits

    def collect(*over: str):
        cfg = load_config(
            FeedbackLoopConfig,
            TINY,
            [
                *FAST,
                "policy.sft_steps=0",
                "calibration.num_articles=4",
                "calibration.pairs_per_article=1",
                *over,
            ],
        )
        splits = load_splits(cfg)
        model, tok, _ = load_policy(cfg.policy, 0)
        judge = build_judge(cfg.judge)
        pairs = collect_calibration_pairs(
            Accelerator(cpu=True),
            model,
            tok,
            PromptBuilder(tok, cfg.policy),
            judge,
            splits.calibration,
            cfg,
            1,
        )
        calib_ids = {e.id for e in splits.calibration}
        assert set(pairs.article_ids) <= calib_ids  # only calibration articles, in every round
        return pairs

    enough = collect("calibration.min_points=1")
    assert len(enough) >= 1 and len(enough) + enough.ties_dropped == 4  # one round: 4 articles x 1 pair
    capped = collect("calibration.min_points=1000", "calibration.extra_rounds=0")
    assert len(capped) + capped.ties_dropped == 4 and capped.article_ids == enough.article_ids
    more = collect("calibration.min_points=1000", "calibration.extra_rounds=2")
    assert len(more) + more.ties_dropped == 12  # two more batches of 4 articles, labeled or tied
    assert more.article_ids[: len(enough)] == enough.article_ids  # the first round is unchanged
