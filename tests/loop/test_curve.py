"""The validation curve (judgeloop.loop.curve): its points, their intervals, the judge's signal, a resume."""

from __future__ import annotations

import json

import numpy as np
import pytest

from judgeloop.config import ConfigError, load_config
from judgeloop.loop.config import FeedbackLoopConfig
from judgeloop.loop.curve import curve_point
from loop_common import FAST, TINY, same_row

CURVE = ["curve.every_n_steps=2", "curve.num_articles=3", "eval_every_n_steps=0"]


@pytest.mark.slow
def test_the_curve_has_a_point_per_interval_on_fixed_articles_and_resumes_exactly(tmp_path):
    from judgeloop.recipes import train

    full = train(load_config(FeedbackLoopConfig, TINY, [*FAST, *CURVE, f"output_dir={tmp_path / 'full'}"]))
    curve = full["curve"]
    assert [p["step"] for p in curve] == [0, 2, 4]
    state = json.loads((tmp_path / "full" / "report.json").read_text())
    assert state["curve"] == curve
    assert (tmp_path / "full" / "curve.png").stat().st_size > 0
    table = (tmp_path / "full" / "curve.md").read_text()
    assert "| 4 |" in table and "gain from step 0" in table
    # step 0's gain is zero on every article; each later gain is the mean of the paired differences
    assert curve[0]["rouge_l_neutral_gain"]["mean"] == 0.0
    assert all(p["rouge_l_neutral"]["n"] == 3 for p in curve)
    # the judge's signal is the mean |target - 0.5| of the DPO rows between two points
    log = full["train_log"]
    want = np.mean([r["target_margin"] for r in log if 2 < r["step"] <= 4])
    assert curve[2]["signal"] == {"key": "target_margin", "mean": pytest.approx(want), "steps": 2}
    assert all(0.0 <= r["target_margin"] <= 0.5 for r in log)
    assert "signal" not in curve[0]  # no training before step 0

    # stopped at step 2 and resumed: the same curve as the uninterrupted run
    cut = [*FAST, *CURVE, f"output_dir={tmp_path / 'cut'}"]
    part = train(load_config(FeedbackLoopConfig, TINY, [*cut, "stop_after_n_steps=2"]))
    resumed = train(load_config(FeedbackLoopConfig, TINY, [*cut, f"resume_from={part['checkpoint']}"]))
    assert [p["step"] for p in resumed["curve"]] == [0, 2, 4]
    for a, b in zip(resumed["curve"], curve):
        for key in ("rouge_l_neutral", "rouge_l_neutral_gain", "kl", "rouge_l_extractive"):
            same_row(a[key], b[key])


def test_curve_point_pairs_the_gain_on_the_article():
    start = [
        {"id": i, "rouge_l_neutral": v, "sampled_rouge_l_neutral": v} for i, v in enumerate([0.1, 0.5, 0.3])
    ]
    later = [
        {"id": i, "rouge_l_neutral": v, "sampled_rouge_l_neutral": None}
        for i, v in enumerate([0.2, 0.6, 0.4])
    ]
    log = [{"step": s, "target_margin": m} for s, m in ((1, 0.1), (2, 0.3), (3, 0.5))]
    p = curve_point(later, start, log, since_step=1, step=3, ece=0.05)
    # every article gained exactly 0.1: the paired interval is a point, the unpaired one is wide
    assert p["rouge_l_neutral_gain"]["mean"] == pytest.approx(0.1)
    assert p["rouge_l_neutral_gain"]["ci95"] == pytest.approx([0.1, 0.1])
    lo, hi = p["rouge_l_neutral"]["ci95"]
    assert hi - lo > 0.1
    assert p["sampled_rouge_l_neutral"]["n"] == 0  # missing values are not zeros
    assert p["signal"] == {"key": "target_margin", "mean": pytest.approx(0.4), "steps": 2}
    assert p["ece"] == 0.05


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (["curve.every_n_steps=-1"], "curve.every_n_steps"),
        (["curve.num_articles=0"], "curve.num_articles"),
        (["curve.every_n_steps=2", "num_validation_articles=0"], "num_validation_articles=0"),
    ],
)
def test_bad_curve_settings_are_one_line(overrides, needle):
    with pytest.raises((ConfigError, ValueError)) as err:
        load_config(FeedbackLoopConfig, TINY, overrides)
    msg = str(err.value)
    assert needle in msg and "\n" not in msg


@pytest.mark.slow
def test_under_grpo_the_curve_shows_the_advantage_spread(tmp_path):
    from test_grpo import GRPO

    from judgeloop.recipes import train

    cfg = load_config(
        FeedbackLoopConfig,
        TINY,
        [*GRPO, "curve.every_n_steps=2", "curve.num_articles=2", f"output_dir={tmp_path}"],
    )
    report = train(cfg)
    assert [p["step"] for p in report["curve"]] == [0, 2]
    want = np.mean([r["advantage_abs_mean"] for r in report["train_log"]])
    assert report["curve"][1]["signal"] == {
        "key": "advantage_abs_mean",
        "mean": pytest.approx(want),
        "steps": 2,
    }
