"""Divergence alarms: catch the training judge drifting away from what it is supposed to measure.

Calibration makes a judge's confidence honest on the pairs it was fitted on; it cannot notice that the
policy has found a direction the judge rewards and the task does not. Objective signals can: on fresh
calibration-split pairs of the current policy, the loop measures how often the judge's calibrated p and
each signal prefer the same summary (and, for a panel, how often its members agree with each other).
Agreement pooled over a rolling window of checks that falls below a threshold is an alarm
(:class:`~judgeloop.loop.config.AlarmConfig` says what happens then).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from judgeloop.calibration import Calibrator
from judgeloop.intervals import wilson_interval
from judgeloop.io import finite_or_none
from judgeloop.judges import Judge
from judgeloop.judges.objective import signal_value
from judgeloop.logging import get_logger
from judgeloop.loop.config import AlarmConfig
from judgeloop.loop.pairs import CalibrationPairs, calibrate
from judgeloop.loop.recalibration import maybe_recalibrate, needs_fit

if TYPE_CHECKING:
    from judgeloop.loop.setup import LoopRun

logger = get_logger(__name__)


def preference_agreement(p: np.ndarray, d: np.ndarray) -> tuple[int, int]:
    """(agreeing, counted) pairs between probabilities ``p`` = P(a better) and signal differences ``d``
    (a minus b): pairs where either abstains (p = 0.5 or NaN, d = 0 or NaN) are not counted."""
    ok = np.isfinite(p) & np.isfinite(d) & (p != 0.5) & (np.abs(d) > 1e-12)
    return int(((p[ok] > 0.5) == (d[ok] > 0)).sum()), int(ok.sum())


def signal_differences(signal: str, pairs: CalibrationPairs) -> np.ndarray:
    """``v(a) - v(b)`` of the objective text signal ``signal`` on each pair."""
    refs = pairs.references or [[] for _ in pairs.a]
    return np.array(
        [
            signal_value(signal, art, a, r) - signal_value(signal, art, b, r)
            for art, a, b, r in zip(pairs.articles, pairs.a, pairs.b, refs)
        ],
        dtype=float,
    )


def agreement_counts(
    judge: Judge, calibrator: Calibrator, pairs: CalibrationPairs, cfg: AlarmConfig
) -> dict[str, tuple[int, int]]:
    """This check's (agreeing, counted) pairs per channel: ``judge~SIGNAL`` for each signal, and
    ``MEMBER~MEMBER`` for each pair of a panel's members (when ``cfg.members``)."""
    members: dict[str, np.ndarray] = {}
    scores = np.asarray(pairs.scores, dtype=float)  # the training judge's logits, judged when collected
    if judge.learns_from_labels:  # a panel: re-judged, for its members' p (and a refit since collecting)
        res = judge(pairs.articles, pairs.a, pairs.b, pairs.references or None)
        scores, members = res.scores, res.members
    p = calibrate(calibrator, scores, pairs.articles, pairs.a, pairs.b)
    out = {f"judge~{s}": preference_agreement(p, signal_differences(s, pairs)) for s in cfg.signals}
    if cfg.members:
        for (m1, p1), (m2, p2) in itertools.combinations(members.items(), 2):
            out[f"{m1}~{m2}"] = preference_agreement(p1, p2 - 0.5)
    return out


def rolling_agreement(checks: Sequence[dict[str, Any]], channel: str, window: int) -> tuple[int, int]:
    """(agreeing, counted) of ``channel`` pooled over the last ``window`` checks."""
    recent = [c["counts"][channel] for c in checks[-window:] if channel in c["counts"]]
    return sum(k for k, _ in recent), sum(n for _, n in recent)


def check_divergence(
    step: int,
    checks: list[dict[str, Any]],
    judge: Judge,
    calibrator: Calibrator,
    pairs: CalibrationPairs,
    cfg: AlarmConfig,
) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """Record this step's agreement in ``checks``; return the metrics to log and the alarms that fire.

    An alarm fires for a channel whose rolling agreement (the last ``cfg.window`` checks, this one
    included) is below ``cfg.threshold`` on at least ``cfg.min_pairs`` pairs.
    """
    counts = agreement_counts(judge, calibrator, pairs, cfg)
    checks.append({"step": step, "counts": {k: list(v) for k, v in counts.items()}})
    metrics: dict[str, float] = {}
    fired = []
    for channel in counts:
        k, n = rolling_agreement(checks, channel, cfg.window)
        rate = k / n if n else float("nan")
        metrics[f"agreement/{channel}"] = rate
        if n >= cfg.min_pairs and rate < cfg.threshold:
            lo, hi = wilson_interval(k, n)
            fired.append(
                {
                    "step": step,
                    "channel": channel,
                    "agreement": rate,
                    "ci95": [lo, hi],
                    "n": n,
                    "threshold": cfg.threshold,
                    "action": cfg.action,
                }
            )
    metrics["fired"] = float(len(fired))
    return metrics, fired


def watch_divergence(run: LoopRun, step: int) -> None:
    """When due, the divergence check (:mod:`judgeloop.loop.alarms`) on this step's fresh
    calibration pairs; an alarm is logged and acted on as ``alarms.action`` says."""
    cfg, state = run.cfg, run.state
    if not (cfg.alarms.enabled and step % cfg.alarms.every_n_steps == 0):
        return
    pairs = run.collect(step)
    metrics, fired = check_divergence(
        step, state.alarm_checks, run.train_judge, run.calibrator, pairs, cfg.alarms
    )
    run.accelerator.log({f"alarm/{k}": v for k, v in metrics.items()}, step=step)
    if not fired:
        return
    state.alarms.extend(finite_or_none(a) for a in fired)
    for a in fired:
        logger.warning(
            "step %d: divergence alarm: %s agreement %.3f (95%% CI [%.3f, %.3f], %d pairs) < %.3f; action: %s",
            step,
            a["channel"],
            a["agreement"],
            a["ci95"][0],
            a["ci95"][1],
            a["n"],
            a["threshold"],
            a["action"],
        )
    action = cfg.alarms.action
    if action == "refit" and needs_fit(cfg.calibration):
        run.calibrator = maybe_recalibrate(
            step, state, run.calibrator, run.collect, cfg, run.train_judge, reason="alarm"
        )
    elif action == "downweight":
        state.judge_weight *= cfg.alarms.downweight_factor
    elif action == "stop":
        state.stopped_early, state.stop_reason = True, f"divergence alarm at step {step}"
