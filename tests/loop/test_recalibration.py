"""Recalibration (judgeloop.loop.recalibration): the schedule, the ECE monitor and the refit."""

from __future__ import annotations

import numpy as np
import pytest

from judgeloop.config import load_config
from judgeloop.loop.config import FeedbackLoopConfig, LoopCalibrationConfig
from judgeloop.loop.pairs import CalibrationPairs
from judgeloop.loop.recalibration import monitor_due, recalibration_reason
from loop_common import TINY


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
