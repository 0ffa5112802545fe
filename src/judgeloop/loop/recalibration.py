"""The loop's maybe_recalibrate step (:mod:`judgeloop.loop.steps`): (re)calibrate the judge on fresh policy samples from the ``calibration`` split.

Fresh samples matter: the calibrator maps the judge's logit on the *current* policy's summaries,
whose distribution drifts as the policy learns. Labels are neutral ROUGE labels (ties dropped).
Calibration articles never overlap the training articles (:func:`check_calibration_disjoint`).
ECE before and after a refit are both measured on held-out calibration articles (out of sample).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
from accelerate import Accelerator
from accelerate.utils import gather_object

from judgeloop.calibration import (
    CalibrationError,
    Calibrator,
    ece,
    make_calibrator,
    pair_features,
    rouge_label,
)
from judgeloop.calibration.coupling import coupling_line
from judgeloop.config import ConfigError
from judgeloop.data import LeakageError, SummExample, check_disjoint
from judgeloop.distributed import generation_context, real_part, shard
from judgeloop.hashing import derive_seed
from judgeloop.intervals import bootstrap_intervals
from judgeloop.io import finite_or_none
from judgeloop.judges import Judge, Pair, build_panel, references_for
from judgeloop.logging import get_logger
from judgeloop.loop.config import FeedbackLoopConfig, LoopCalibrationConfig
from judgeloop.loop.oracle import RougeOracleJudge
from judgeloop.loop.rollout import PromptBuilder, rollout

if TYPE_CHECKING:
    from judgeloop.loop.shared import StartWork
    from judgeloop.loop.state import LoopState, Splits

logger = get_logger(__name__)


def check_calibration_disjoint(train: Sequence[SummExample], calibration: Sequence[SummExample]) -> None:
    """Raise :class:`LeakageError` if a training article (id or identical text) is used to fit a calibrator."""
    try:
        check_disjoint({"train": train, "calibration": calibration})
    except LeakageError as err:
        raise LeakageError(
            f"calibration articles overlap the policy's training articles: {err}. "
            "Calibrators must be fitted on the 'calibration' split only"
        ) from err


def build_calibrator(cfg: LoopCalibrationConfig) -> Calibrator:
    """The arm's calibrator: ``raw`` and ``oracle`` use p = sigmoid(logit) and are never refit; ``panel``
    uses it on the panel's logit, which its members' own calibrators already make a probability."""
    method = "raw" if cfg.method in ("raw", "oracle", "panel") else cfg.method
    kwargs: dict[str, Any] = {} if method == "raw" else {"min_points": cfg.min_points}
    return make_calibrator(method, **kwargs)


def needs_fit(cfg: LoopCalibrationConfig) -> bool:
    """Whether the arm fits a calibrator (every arm but ``raw`` and ``oracle``)."""
    return cfg.method not in ("raw", "oracle")


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
    if cfg.method == "oracle":
        return RougeOracleJudge(scale=cfg.oracle_scale)
    if cfg.method == "panel" and not judge.learns_from_labels:
        return build_panel(cfg.panel, device=device, first=(name, judge))
    return judge


def features_for(
    calibrator: Calibrator, articles: Sequence[str], a: Sequence[str], b: Sequence[str]
) -> np.ndarray | None:
    """The pair features a feature-aware calibrator needs, or None for one that needs none."""
    if not calibrator.uses_features:
        return None
    return (
        np.stack([pair_features(x, y, z) for x, y, z in zip(articles, a, b)])
        if len(articles)
        else np.zeros((0, 2))
    )


def calibrate(
    calibrator: Calibrator, scores: np.ndarray, articles: Sequence[str], a: Sequence[str], b: Sequence[str]
) -> np.ndarray:
    """calibrate_step's map: raw judge logits -> p = P(a better than b). NaN stays NaN (a failed judgement is skipped)."""
    return calibrator.predict_proba(scores, features_for(calibrator, articles, a, b))


@dataclass
class CalibrationPairs:
    """Judged and ROUGE-labeled pairs of policy samples (one orientation per pair)."""

    article_ids: list[str] = field(default_factory=list)
    articles: list[str] = field(default_factory=list)
    a: list[str] = field(default_factory=list)
    b: list[str] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    labels: list[int] = field(default_factory=list)
    references: list[list[str]] = field(default_factory=list)  # what the judge compared to, per pair
    ties_dropped: int = 0
    judge_failures: int = 0

    def subset(self, keep: np.ndarray) -> CalibrationPairs:
        """The pairs where ``keep`` is True (the counts of dropped pairs are not carried)."""
        idx = np.flatnonzero(keep)
        pick = lambda xs: [xs[i] for i in idx]  # noqa: E731
        return CalibrationPairs(
            pick(self.article_ids),
            pick(self.articles),
            pick(self.a),
            pick(self.b),
            pick(self.scores),
            pick(self.labels),
            pick(self.references) if self.references else [],
        )

    def judged_by(self, judge: Judge) -> CalibrationPairs:
        """These pairs with ``judge``'s scores (a panel's refit changes them); pairs it fails on are dropped."""
        res = judge(self.articles, self.a, self.b, self.references or None)
        scored = dataclasses.replace(self, scores=[float(x) for x in res.scores])
        return scored.subset(res.valid)

    def as_pairs(self) -> list[Pair]:
        """The pairs as judge inputs."""
        refs = self.references or [[] for _ in self.a]
        return [Pair(x, a, b, tuple(r)) for x, a, b, r in zip(self.articles, self.a, self.b, refs)]

    def __len__(self) -> int:
        return len(self.labels)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CalibrationPairs:
        return cls(**d)


def label_pairs(
    examples: Sequence[SummExample], a: Sequence[str], b: Sequence[str], judge: Judge
) -> CalibrationPairs:
    """Judge each (a, b) pair and label it with neutral ROUGE-L; ties and judge failures are dropped and counted."""
    out = CalibrationPairs()
    refs = references_for(judge, examples)
    res = judge([e.article for e in examples], list(a), list(b), refs)
    for ex, x, y, s, ok, r in zip(examples, a, b, res.scores, res.valid, refs):
        if not ok:
            out.judge_failures += 1
            continue
        lab = rouge_label(x, y, ex.neutral)
        if lab is None:
            out.ties_dropped += 1
            continue
        out.article_ids.append(ex.id)
        out.articles.append(ex.article)
        out.a.append(x)
        out.b.append(y)
        out.scores.append(float(s))
        out.labels.append(int(lab))
        out.references.append(list(r))
    return out


def judge_coupling(pairs: CalibrationPairs) -> dict[str, Any]:
    """:func:`judgeloop.calibration.coupling.judge_coupling` on labeled policy pairs."""
    from judgeloop.calibration.coupling import judge_coupling as coupling

    return coupling(pairs.scores, pairs.labels, pairs.articles, pairs.a, pairs.b)


def pair_ece(calibrator: Calibrator, pairs: CalibrationPairs, n_bins: int) -> float:
    """ECE over both orientations of ``pairs`` (a pairwise calibrator is judged on both)."""
    if len(pairs) == 0:
        return float("nan")
    s = np.asarray(pairs.scores)
    y = np.asarray(pairs.labels, dtype=float)
    p1 = calibrate(calibrator, s, pairs.articles, pairs.a, pairs.b)
    p2 = calibrate(calibrator, -s, pairs.articles, pairs.b, pairs.a)
    return ece(np.concatenate([p1, p2]), np.concatenate([y, 1 - y]), n_bins=n_bins)


def _oriented(calibrator: Calibrator, pairs: CalibrationPairs) -> tuple[np.ndarray, np.ndarray]:
    """(N, 2) probabilities and labels of both orientations of each pair."""
    s = np.asarray(pairs.scores)
    y = np.asarray(pairs.labels, dtype=float)
    p1 = calibrate(calibrator, s, pairs.articles, pairs.a, pairs.b)
    p2 = calibrate(calibrator, -s, pairs.articles, pairs.b, pairs.a)
    return np.stack([p1, p2], axis=1), np.stack([y, 1 - y], axis=1)


def ece_intervals(
    before: Calibrator | None,
    after: Calibrator,
    pairs: CalibrationPairs,
    n_bins: int,
    n_boot: int,
    seed: int,
) -> dict[str, list[float | None]]:
    """95% bootstrap intervals of held-out ECE before, after, and of (after - before), resampling pairs
    (both orientations of a pair together), the same resample for both calibrators."""
    none: dict[str, list[float | None]] = {"ece_before_ci95": [None, None], "ece_after_ci95": [None, None]}
    none["ece_delta_ci95"] = [None, None]
    if len(pairs) < 2 or n_boot < 1:
        return none
    pa, ya = _oriented(after, pairs)
    pb = _oriented(before, pairs)[0] if before is not None else None

    def eces(idx: np.ndarray) -> list[float]:
        y = ya[idx].ravel()
        a = ece(pa[idx].ravel(), y, n_bins=n_bins)
        if pb is None:
            return [a]
        b = ece(pb[idx].ravel(), y, n_bins=n_bins)
        return [a, b, a - b]

    intervals = [list(ci) for ci in bootstrap_intervals(eces, len(pairs), n_boot, seed=seed)]
    out = dict(none)
    out["ece_after_ci95"] = intervals[0]
    if pb is not None:
        out["ece_before_ci95"], out["ece_delta_ci95"] = intervals[1], intervals[2]
    return out


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


def holdout_mask(article_ids: Sequence[str], fraction: float, seed: int) -> np.ndarray:
    """True for pairs whose article is in the held-out part (stable per article id and seed)."""
    from judgeloop.data import hash_unit

    return np.array([hash_unit(i, salt=f"holdout{seed}") < fraction for i in article_ids], dtype=bool)


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
    # the label-free arm takes every refit: a guard that reads labels would make it a labeled method
    accept = "always" if cfg.method == "style_residual" else cfg.refit_accept
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


def collect_calibration_pairs(
    accelerator: Accelerator,
    model: Any,
    tokenizer: Any,
    build_prompt: PromptBuilder,
    judge: Judge,
    calibration: Sequence[SummExample],
    cfg: FeedbackLoopConfig,
    step: int,
) -> CalibrationPairs:
    """Fresh pairs for the calibrator: two samples of the *current* policy per calibration article,
    judged and ROUGE-labeled (articles drawn from the calibration split only).

    ``calibration.num_articles`` articles are drawn in a seeded order. Pairs whose two summaries tie on
    ROUGE-L carry no label and are dropped; when that leaves fewer than ``calibration.min_points`` pairs
    on the fit side (articles not held out), up to ``calibration.extra_rounds`` more batches of
    ``num_articles`` articles are drawn from the same order, so a weak policy whose samples often tie
    still gets a calibrator.
    """
    ccfg = cfg.calibration
    order = np.random.RandomState(derive_seed(cfg.seed, "calib_articles", step)).permutation(len(calibration))
    out = CalibrationPairs()
    for round_ in range(ccfg.extra_rounds + 1):
        pick = order[round_ * ccfg.num_articles : (round_ + 1) * ccfg.num_articles]
        if not len(pick):
            break
        # round 0 keeps the seed the loop has always used; later rounds get their own
        tag: tuple[Any, ...] = (step, accelerator.process_index) + ((round_,) if round_ else ())
        picked = [calibration[i] for i in sorted(pick)]
        rows = _calibration_rows(
            accelerator,
            model,
            tokenizer,
            build_prompt,
            judge,
            (shard(picked, accelerator), len(real_part(picked, len(picked), accelerator))),
            cfg,
            derive_seed(cfg.seed, "calib", *tag),
        )
        all_rows = gather_object(rows)
        for r in all_rows:
            if "ties" in r:
                out.ties_dropped += r["ties"]
                out.judge_failures += r["failures"]
                continue
            out.article_ids.append(r["id"])
            out.articles.append(r["article"])
            out.a.append(r["a"])
            out.b.append(r["b"])
            out.scores.append(r["s"])
            out.labels.append(r["y"])
            out.references.append(r["refs"])
        fit = int((~holdout_mask(out.article_ids, ccfg.holdout_fraction, cfg.seed)).sum())
        if fit >= ccfg.min_points:  # the same on every process: the rows were gathered
            break
    return out


def _calibration_rows(
    accelerator: Accelerator,
    model: Any,
    tokenizer: Any,
    build_prompt: PromptBuilder,
    judge: Judge,
    share: tuple[Sequence[SummExample], int],
    cfg: FeedbackLoopConfig,
    seed: int,
) -> list[dict[str, Any]]:
    """This process's labeled pairs for its share of the calibration articles, plus one counts row.
    ``share``: the padded shard and how many of its articles are real (the rest only keep the ranks'
    generate calls in step)."""
    mine, num_real = share
    if not mine:
        return []
    with generation_context(model):
        roll = rollout(
            accelerator.unwrap_model(model),
            tokenizer,
            build_prompt,
            [e.article for e in mine],
            cfg.generation,
            seed=seed,
            num_pairs=cfg.calibration.pairs_per_article,
        )
    k = cfg.calibration.pairs_per_article
    exs = [e for e in mine[:num_real] for _ in range(k)]  # article-major, as rollout returns them
    pairs = label_pairs(exs, roll.a_text[: len(exs)], roll.b_text[: len(exs)], judge)
    rows: list[dict[str, Any]] = [
        {"id": i, "article": a, "a": x, "b": y, "s": s, "y": lab, "refs": r}
        for i, a, x, y, s, lab, r in zip(
            pairs.article_ids, pairs.articles, pairs.a, pairs.b, pairs.scores, pairs.labels, pairs.references
        )
    ]
    rows.append({"ties": pairs.ties_dropped, "failures": pairs.judge_failures})
    return rows


def initial_calibration_pairs(
    start: StartWork, cfg: FeedbackLoopConfig, splits: Splits, collect: Any
) -> CalibrationPairs:
    """The step-0 calibration pairs: samples of the starting policy, judged and labeled; shared by the
    calibrated arms of a seed (they differ only in the map fitted on these pairs)."""
    ccfg = cfg.calibration
    key = {
        "policy_fp": getattr(start, "policy_fp", None),
        "seed": cfg.seed,
        "judge": dataclasses.asdict(cfg.judge),
        "calibration_ids": [e.id for e in splits.calibration],
        "sampling": [ccfg.num_articles, ccfg.extra_rounds, ccfg.pairs_per_article, ccfg.holdout_fraction],
        "min_points": ccfg.min_points,
    }
    if ccfg.method == "panel":  # judged by the panel, not by the judge the other arms share
        key["panel"] = dataclasses.asdict(ccfg.panel)
    return CalibrationPairs.from_dict(start.get("calibration_pairs", key, lambda: collect().as_dict()))


def maybe_recalibrate(
    step: int, state: LoopState, calibrator: Calibrator, collect: Any, cfg: FeedbackLoopConfig,
    judge: Judge | None = None, reason: str | None = None,
) -> Calibrator:  # fmt: skip
    """Monitor ECE on fresh samples when due; refit on schedule or when ECE exceeds the threshold
    (or for ``reason``, a divergence alarm's). ``judge``: the training judge (a panel refits with it)."""
    pairs = None
    if monitor_due(step, cfg.calibration):
        pairs = collect(step)
        monitored = pair_ece(calibrator, pairs, cfg.calibration.num_bins)
        state.last_monitored_ece = monitored if math.isfinite(monitored) else None
    reason = reason or recalibration_reason(step, cfg.calibration, state.last_monitored_ece)
    if reason is None:
        return calibrator
    pairs = pairs if pairs is not None else collect(step)
    calibrator, record = refit(calibrator, pairs, cfg.calibration, step, reason, cfg.seed, judge=judge)
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
