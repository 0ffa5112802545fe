"""Step 6 of the loop, maybe_recalibrate (:mod:`judgeloop.loop.steps`): when to refit the calibrator, the
refit on fresh calibration pairs of the current policy (:mod:`judgeloop.loop.pairs`), its record, and the
guard that keeps the previous calibrator when the new one is worse held out.

ECE before and after a refit are both measured on held-out calibration articles (out of sample). The arm's
calibrator and training judge (:func:`build_calibrator`, :func:`build_training_judge`) and the check that
a fit can ever get its pairs (:func:`check_calibration_budget`) are here too.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from judgeloop.calibration import CalibrationError, Calibrator, features_for, make_calibrator
from judgeloop.calibration.coupling import coupling_line
from judgeloop.config import ConfigError
from judgeloop.io import finite_or_none
from judgeloop.judges import Judge, build_panel, references_for
from judgeloop.logging import get_logger
from judgeloop.loop.arms import arm
from judgeloop.loop.config import FeedbackLoopConfig, LoopCalibrationConfig
from judgeloop.loop.oracle import RougeOracleJudge
from judgeloop.loop.pairs import (
    CalibrationPairs,
    ece_intervals,
    gather_pairs,
    holdout_mask,
    judge_coupling,
    label_pairs,
    pair_ece,
)

if TYPE_CHECKING:
    from judgeloop.loop.state import LoopState
    from judgeloop.loop.steps import PairBatch

logger = get_logger(__name__)


def build_calibrator(cfg: LoopCalibrationConfig) -> Calibrator:
    """The arm's calibrator (its row of :mod:`judgeloop.loop.arms`): ``raw`` and ``oracle`` use
    p = sigmoid(logit) and are never refit; ``panel`` uses it on the panel's logit, which its members' own
    calibrators already make a probability."""
    method = arm(cfg.method).calibrator
    kwargs: dict[str, Any] = {} if method == "raw" else {"min_points": cfg.min_points}
    return make_calibrator(method, **kwargs)


def needs_fit(cfg: LoopCalibrationConfig) -> bool:
    """Whether the arm fits a calibrator (every arm but ``raw`` and ``oracle``)."""
    return arm(cfg.method).fits


def check_calibration_budget(cfg: LoopCalibrationConfig, calibration_ids: Sequence[str], seed: int) -> None:
    """Refuse, before any model loads, a fit that could never get ``min_points`` pairs.

    The most pairs the fit side can ever hold: every round's articles that are not held out, times
    ``pairs_per_article``, with no ties at all. When even that is below ``min_points``, the run would fail
    after the policy had sampled every round; this says so first, with the numbers.
    """
    if not needs_fit(cfg):
        return
    fit_side = int((~holdout_mask(calibration_ids, cfg.holdout_fraction, seed)).sum())
    reachable = min(fit_side, cfg.num_articles * (cfg.extra_rounds + 1)) * cfg.pairs_per_article
    if reachable < cfg.min_points:
        raise ConfigError(
            f"calibration.min_points={cfg.min_points} can never be reached: at most {reachable} fit pairs "
            f"(min({fit_side} calibration articles not held out, num_articles={cfg.num_articles} x "
            f"{cfg.extra_rounds + 1} rounds) x pairs_per_article={cfg.pairs_per_article}); raise "
            "calibration.num_articles, extra_rounds or pairs_per_article, use more data, or lower min_points"
        )


def build_training_judge(
    cfg: LoopCalibrationConfig, judge: Judge, name: str = "judge", device: str | None = None
) -> Judge:
    """The judge whose preferences train the policy: the configured one, the ROUGE oracle, or (``panel``)
    the configured judge, called ``name``, with ``cfg.panel.members`` beside it (a configured panel as it is)."""
    spec = arm(cfg.method)
    if spec.judge == "oracle":
        return RougeOracleJudge(scale=cfg.oracle_scale)
    if spec.judge == "panel" and not judge.learns_from_labels:
        return build_panel(cfg.panel, device=device, first=(name, judge))
    return judge


@dataclass
class RefitRecord:
    """One (re)fit: held-out ECE before/after with intervals; ``refit`` is whether the new calibrator
    was taken (False when fitting failed or, under ``refit_accept=better``, it was worse held out)."""

    step: int
    reason: str
    n_fit: int
    n_holdout: int
    ece_before: float
    ece_after: float
    refit: bool
    error: str = ""
    ece_before_ci95: list[float | None] = field(default_factory=lambda: [None, None])
    ece_after_ci95: list[float | None] = field(default_factory=lambda: [None, None])
    ece_delta_ci95: list[float | None] = field(default_factory=lambda: [None, None])
    kept_previous: bool = False

    def set_intervals(self, ci: dict[str, list[float | None]]) -> None:
        """Take the intervals of :func:`ece_intervals`."""
        self.ece_before_ci95 = ci["ece_before_ci95"]
        self.ece_after_ci95 = ci["ece_after_ci95"]
        self.ece_delta_ci95 = ci["ece_delta_ci95"]

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def recalibration_reason(
    step: int, cfg: LoopCalibrationConfig, last_monitored_ece: float | None
) -> str | None:
    """Why the calibrator should be refit at ``step`` (after the update of that step), or None.

    ``schedule``: every ``recalibrate_every_n_steps``; ``ece``: the last monitored ECE exceeded
    ``ece_threshold``. Arms without a fitted calibrator (raw, oracle) never refit.
    """
    if not needs_fit(cfg):
        return None
    if cfg.recalibrate_every_n_steps and step % cfg.recalibrate_every_n_steps == 0:
        return "schedule"
    if (
        last_monitored_ece is not None
        and np.isfinite(last_monitored_ece)
        and last_monitored_ece > cfg.ece_threshold
    ):
        return "ece"
    return None


def monitor_due(step: int, cfg: LoopCalibrationConfig) -> bool:
    """Whether fresh-sample ECE is monitored at ``step``."""
    return bool(needs_fit(cfg) and cfg.monitor_every_n_steps and step % cfg.monitor_every_n_steps == 0)


def refit(
    calibrator: Calibrator,
    pairs: CalibrationPairs,
    cfg: LoopCalibrationConfig,
    step: int,
    reason: str,
    seed: int,
    first_fit: bool = False,
    judge: Judge | None = None,
) -> tuple[Calibrator, RefitRecord]:
    """Fit a new calibrator on the fit part of ``pairs``; ECE before/after on the held-out part.

    ``judge``: the training judge; one that learns from labels (a panel) is fitted first on the same fit
    pairs (its members' calibrators), the pairs re-judged by it, and put back as it was whenever the
    previous calibrator is kept.

    On a :class:`CalibrationError` (too few or one-class pairs) the previous calibrator is kept and
    the failure recorded; on the very first fit there is no previous one, so the error propagates.
    Under ``refit_accept=better`` a new calibrator whose held-out ECE is higher than the previous
    one's is not taken either (``kept_previous``).
    """
    held = holdout_mask(pairs.article_ids, cfg.holdout_fraction, seed)
    fit_pairs, hold_pairs = pairs.subset(~held), pairs.subset(held)
    before = float("nan") if first_fit else pair_ece(calibrator, hold_pairs, cfg.num_bins)
    new = build_calibrator(cfg)
    learner = judge if judge is not None and judge.learns_from_labels else None
    previous = learner.state_dict() if learner is not None else None
    try:
        if learner is not None:  # a panel: its members' calibrators first, then the pairs re-judged
            learner.fit_labels(fit_pairs.as_pairs(), fit_pairs.labels)
            fit_pairs, hold_pairs = fit_pairs.judged_by(learner), hold_pairs.judged_by(learner)
        feats = features_for(new, fit_pairs.articles, fit_pairs.a, fit_pairs.b)
        new.fit(np.asarray(fit_pairs.scores), np.asarray(fit_pairs.labels), feats)
    except CalibrationError as err:
        if learner is not None and previous is not None:
            learner.load_state_dict(previous)
        if first_fit:
            raise CalibrationError(
                f"initial calibration at step {step} failed: {err}. Raise calibration.num_articles "
                f"(now {cfg.num_articles}) or calibration.extra_rounds (now {cfg.extra_rounds}), or lower "
                f"calibration.min_points (now {cfg.min_points})"
            ) from err
        return calibrator, RefitRecord(
            step, reason, len(fit_pairs), len(hold_pairs), before, before, False, str(err)
        )
    after = pair_ece(new, hold_pairs, cfg.num_bins)
    ci = ece_intervals(
        None if first_fit else calibrator, new, hold_pairs, cfg.num_bins, cfg.ece_bootstrap, seed + step
    )
    worse = not first_fit and np.isfinite(before) and np.isfinite(after) and after > before
    # a label-free arm takes every refit: a guard that reads labels would make it a labeled method
    accept = "always" if arm(cfg.method).accept == "always" else cfg.refit_accept
    if worse and accept == "better":
        if learner is not None and previous is not None:
            learner.load_state_dict(previous)
        msg = f"held-out ECE worse ({before:.4f} -> {after:.4f}); kept the previous calibrator"
        rec = RefitRecord(step, reason, len(fit_pairs), len(hold_pairs), before, after, False, msg)
        rec.set_intervals(ci)
        rec.kept_previous = True
        return calibrator, rec
    rec = RefitRecord(step, reason, len(fit_pairs), len(hold_pairs), before, after, True)
    rec.set_intervals(ci)
    return new, rec


def label_training_pairs(state: LoopState, batch: PairBatch, judge: Judge) -> None:
    """The ``ceiling`` arm's extra labels: this step's training pairs (judged already) labeled by neutral
    ROUGE-L, gathered over the processes, added to ``state.label_pool`` for the refits to come."""
    roll, judged = batch.rollout, batch.judged
    assert roll is not None and judged is not None, "label_training_pairs needs the judged rollout"
    refs = references_for(judge, batch.examples)  # what the training judge compared to, as for every pair
    mine = label_pairs(batch.examples, roll.a_text, roll.b_text, judged.scores, judged.valid, refs)
    pool = CalibrationPairs.from_dict(state.label_pool) if state.label_pool else CalibrationPairs()
    pool.extend(gather_pairs(mine))
    state.label_pool = pool.as_dict()


def with_label_pool(
    pairs: CalibrationPairs, state: LoopState, cfg: LoopCalibrationConfig
) -> CalibrationPairs:
    """The pairs a refit reads: the fresh calibration pairs, and for an arm whose fits read every label
    (``ceiling``) the labeled training pairs of the run so far after them (a new object either way)."""
    out = CalibrationPairs.from_dict(pairs.as_dict())
    if arm(cfg.method).labels == "all" and state.label_pool:
        out.extend(CalibrationPairs.from_dict(state.label_pool))
    return out


def maybe_recalibrate(
    step: int,
    state: LoopState,
    calibrator: Calibrator,
    collect: Any,
    cfg: FeedbackLoopConfig,
    judge: Judge | None = None,
    reason: str | None = None,
    batch: PairBatch | None = None,
) -> Calibrator:
    """Monitor ECE on fresh samples when due; refit on schedule or when ECE exceeds the threshold
    (or for ``reason``, a divergence alarm's). ``judge``: the training judge (a panel refits with it).
    ``batch``: the step's judged pairs, which an arm whose fits read every label (``ceiling``) labels and
    keeps for its refits."""
    if batch is not None and judge is not None and arm(cfg.calibration.method).labels == "all":
        label_training_pairs(state, batch, judge)
    pairs = None
    if monitor_due(step, cfg.calibration):
        pairs = collect(step)
        monitored = pair_ece(calibrator, pairs, cfg.calibration.num_bins)
        state.last_monitored_ece = monitored if math.isfinite(monitored) else None
    reason = reason or recalibration_reason(step, cfg.calibration, state.last_monitored_ece)
    if reason is None:
        return calibrator
    pairs = pairs if pairs is not None else collect(step)
    fit_on = with_label_pool(pairs, state, cfg.calibration)
    calibrator, record = refit(calibrator, fit_on, cfg.calibration, step, reason, cfg.seed, judge=judge)
    state.coupling.append(finite_or_none({"step": step, **judge_coupling(pairs)}))
    logger.info("step %d: %s", step, coupling_line(state.coupling[-1]))
    state.refits.append(
        finite_or_none(
            {**record.as_dict(), "ties_dropped": pairs.ties_dropped, "judge_failures": pairs.judge_failures}
        )
    )
    state.last_monitored_ece = None
    ci = record.ece_delta_ci95
    logger.info(
        "step %d: recalibrated (%s) on %d pairs; held-out ECE %.4f -> %.4f on %d pairs (change 95%% CI %s)%s",
        step,
        reason,
        record.n_fit,
        record.ece_before,
        record.ece_after,
        record.n_holdout,
        "n/a" if ci[0] is None else f"[{ci[0]:+.4f}, {ci[1]:+.4f}]",
        "" if record.refit else f" (kept old: {record.error})",
    )
    return calibrator
