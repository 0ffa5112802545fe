"""The arms table (judgeloop.loop.arms) and the settings that use the calibrated ordering at full strength:
confidence-weighted pairs, sharpened targets, the ceiling's labeled training pairs."""

from __future__ import annotations

import math
from typing import get_args

import numpy as np
import pytest
import torch

from judgeloop.config import ConfigError, load_config
from judgeloop.judges.base import JudgeOutput
from judgeloop.loop.config import Arm, FeedbackLoopConfig, LossConfig
from loop_common import FAST, TINY


def _batch(p: list[float]):
    from judgeloop.loop.steps import PairBatch

    batch = PairBatch(step=1, examples=[])
    n = len(p)
    batch.judged = JudgeOutput(scores=np.zeros(n), status=["ok"] * n, forward=np.zeros(n))
    batch.p = np.asarray(p, dtype=float)
    return batch


def test_the_config_names_every_arm_of_the_table_in_its_order():
    from judgeloop.loop.arms import ARM_NAMES, ARM_TABLE

    assert get_args(Arm) == ARM_NAMES
    assert len({a.name for a in ARM_TABLE}) == len(ARM_TABLE)
    from judgeloop.calibration import CALIBRATORS

    assert all(a.calibrator in CALIBRATORS for a in ARM_TABLE)


def test_a_confidence_weighted_hard_loss_equals_a_hand_computation():
    """feature_platt_cw's loss: hard targets, each pair's DPO term times |2p - 1|, summed over the batch
    and divided by its size (a failed judgement is masked)."""
    from judgeloop.loop.dpo import dpo_update  # noqa: F401  (the update that reads batch.weights)
    from judgeloop.loop.losses import dpo_margin, soft_dpo_loss
    from judgeloop.loop.steps import make_pairs

    p = [0.9, 0.3, 0.5, float("nan")]
    batch = _batch(p)
    make_pairs(batch, LossConfig(target="hard", pair_weighting="confidence"))
    assert batch.targets.tolist()[:3] == [1.0, 0.0, 1.0]  # the failed pair is masked, its target unread
    assert batch.mask.tolist() == [1.0, 1.0, 1.0, 0.0]
    assert batch.weights.tolist() == pytest.approx([0.8, 0.4, 0.0, 0.0])
    # the DPO term dpo_update forms from them: sum(mask * weight * loss) / B
    pa, pb = torch.tensor([-10.0, -12.0, -9.0, -8.0]), torch.tensor([-11.0, -10.0, -9.5, -7.0])
    ra, rb = torch.tensor([-10.5, -11.0, -9.0, -8.0]), torch.tensor([-10.5, -11.0, -9.0, -8.0])
    h = dpo_margin(pa, pb, ra, rb)
    got = (soft_dpo_loss(h, batch.targets, 0.1, batch.mask * batch.weights)).sum() / 4
    beta = 0.1
    hand = 0.0
    for hi, t, w in zip(h.tolist(), [1, 0, 1], [0.8, 0.4, 0.0]):
        z = beta * hi
        hand += w * -(t * math.log(1 / (1 + math.exp(-z))) + (1 - t) * math.log(1 / (1 + math.exp(z))))
    assert float(got) == pytest.approx(hand / 4, rel=1e-6)


def test_sharpened_targets_keep_the_order_and_grow_the_signal():
    from judgeloop.loop.steps import make_pairs, sharpen

    p = np.array([0.55, 0.45, 0.7, 0.0, 1.0, np.nan])
    s = sharpen(p, 0.5)
    assert np.array_equal(np.argsort(p[:5]), np.argsort(s[:5]))
    assert s[0] == pytest.approx(1 / (1 + (0.45 / 0.55) ** 2))  # logit doubled
    assert s[3] == 0.0 and s[4] == 1.0 and np.isnan(s[5])
    assert np.array_equal(sharpen(p, 1.0), p, equal_nan=True)
    batch = _batch([0.55, 0.45])
    make_pairs(batch, LossConfig(target_temperature=0.5))
    assert batch.targets.tolist() == pytest.approx([s[0], s[1]])
    assert batch.weights is None


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        (
            ["calibration.method=feature_platt_cw", "loss.target_temperature=0"],
            "loss.target_temperature=0.0 must be > 0 (1 keeps p as calibrated; < 1 sharpens)",
        ),
        (
            ["calibration.method=feature_platt_cw", "loss.pair_weighting=none", "loss.target=soft"],
            None,  # the defaults: the arm's settings apply
        ),
        (
            ["loss.pair_weighting=sometimes"],
            "loss.pair_weighting",
        ),
        (
            ["calibration.method=feature_platt_cw", "loss.type=grpo"],
            "calibration.method=feature_platt_cw is a DPO arm (it sets loss.target); use loss.type=dpo, or the "
            "arm it builds on, calibration.method=feature_platt",
        ),
        (
            ["loss.type=grpo", "loss.target_temperature=0.5"],
            "loss.target_temperature=0.5 is a DPO setting",
        ),
    ],
)
def test_the_new_settings_are_checked_in_one_line(overrides, says):
    if says is None:
        cfg = load_config(FeedbackLoopConfig, TINY, overrides)
        assert (cfg.loss.target, cfg.loss.pair_weighting) == ("hard", "confidence")
        return
    with pytest.raises(ConfigError) as err:
        load_config(FeedbackLoopConfig, TINY, overrides)
    assert says in str(err.value) and "\n" not in str(err.value)


def test_an_arm_refuses_a_loss_setting_it_contradicts(monkeypatch):
    """An arm's loss settings take the place of the defaults; a config value that is neither the default
    nor the arm's is refused in one line (a row implying a sharpening temperature, set otherwise)."""
    import dataclasses

    from judgeloop.loop import arms

    sharp = dataclasses.replace(arms.ARMS_BY_NAME["platt"], loss=(("target_temperature", 0.5),))
    monkeypatch.setitem(arms.ARMS_BY_NAME, "platt", sharp)
    assert load_config(FeedbackLoopConfig, TINY, []).loss.target_temperature == 0.5
    with pytest.raises(ConfigError) as err:
        load_config(FeedbackLoopConfig, TINY, ["loss.target_temperature=0.7"])
    assert str(err.value).endswith(
        "loss.target_temperature=0.7 conflicts with calibration.method=platt, which trains with "
        "loss.target_temperature=0.5; leave loss.target_temperature unset, or use calibration.method=platt"
    )


@pytest.mark.slow
def test_the_ceiling_fits_on_every_training_pair_so_far(tmp_path):
    """The ceiling arm labels each step's training pairs with neutral ROUGE-L and its refits read them
    beside the fresh calibration pairs: feature_platt's refit at the same step reads fewer."""
    from judgeloop.recipes import train

    common = [*FAST, "eval_every_n_steps=0", "save_final_policy=false"]
    runs = {
        m: train(
            load_config(
                FeedbackLoopConfig, TINY, [*common, f"calibration.method={m}", f"output_dir={tmp_path / m}"]
            )
        )
        for m in ("feature_platt", "ceiling")
    }
    fp, ce = (runs[m]["refits"] for m in ("feature_platt", "ceiling"))
    assert [r["step"] for r in fp] == [r["step"] for r in ce] == [0, 2, 4]
    assert ce[0]["n_fit"] + ce[0]["n_holdout"] == fp[0]["n_fit"] + fp[0]["n_holdout"]  # step 0: no pool yet
    # the two runs are one run up to the step-2 refit (the same calibrator fitted on the same step-0 pairs),
    # so their step-2 calibration pairs are the same: the ceiling has the labeled training pairs beside them
    assert ce[1]["n_fit"] + ce[1]["n_holdout"] > fp[1]["n_fit"] + fp[1]["n_holdout"]


def test_hard_targets_with_a_monotone_calibrator_say_they_train_raws_labels(caplog):
    """The account's hard pick with Platt: the same labels as raw (tested on a fitted Platt map), and the
    run says so before any work; a reordering arm gets no such line."""
    import logging

    from judgeloop.calibration import make_calibrator
    from judgeloop.loop.setup import warn_hard_monotone

    rng = np.random.default_rng(0)
    s = rng.normal(0, 2, 200)
    y = (s + rng.normal(0, 3, 200) > 0).astype(int)
    p = make_calibrator("platt").fit(s, y).predict_proba(s)
    assert np.array_equal(p >= 0.5, s >= 0)
    with caplog.at_level(logging.WARNING, logger="judgeloop"):
        warn_hard_monotone(
            load_config(FeedbackLoopConfig, TINY, ["calibration.method=platt", "loss.target=hard"])
        )
        warn_hard_monotone(load_config(FeedbackLoopConfig, TINY, ["calibration.method=feature_platt_cw"]))
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and lines[0].startswith(
        "loss.target=hard with calibration.method=platt trains raw's labels"
    )
