"""The calibration pairs of policy samples: collect, label, hold out, gather across processes.

Fresh samples matter: the calibrator maps the judge's logit on the *current* policy's summaries, whose
distribution drifts as the policy learns. :func:`collect_calibration_pairs` draws two samples of the
current policy per calibration article, the judge scores each pair and neutral ROUGE-L labels it (ties
dropped, :func:`judge_and_label_pairs`); calibration articles never overlap the training articles
(:func:`check_calibration_disjoint`). :func:`holdout_mask` sets apart the articles a refit is measured
on, :func:`gather_pairs` is how pairs cross processes, and :func:`judge_coupling`, :func:`pair_ece` and
:func:`ece_intervals` measure the judge and a calibrator on pairs. :func:`calibrate` is the calibrator's
map from raw logits to p (step 3, and every ECE here).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
from accelerate.utils import gather_object

from judgeloop.calibration import Calibrator, ece, features_for, rouge_label
from judgeloop.data import LeakageError, SummExample, check_disjoint
from judgeloop.distributed import real_part, shard
from judgeloop.hashing import derive_seed
from judgeloop.intervals import bootstrap_intervals
from judgeloop.judges import Judge, Pair, references_for
from judgeloop.loop.arms import arm
from judgeloop.loop.config import FeedbackLoopConfig

if TYPE_CHECKING:
    from judgeloop.loop.policy import Policy
    from judgeloop.loop.start_cache import StartWork


def check_calibration_disjoint(train: Sequence[SummExample], calibration: Sequence[SummExample]) -> None:
    """Raise :class:`LeakageError` if a training article (id or identical text) is used to fit a calibrator."""
    try:
        check_disjoint({"train": train, "calibration": calibration})
    except LeakageError as err:
        raise LeakageError(
            f"calibration articles overlap the policy's training articles: {err}. "
            "Calibrators must be fitted on the 'calibration' split only"
        ) from err


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

    def extend(self, other: CalibrationPairs) -> None:
        """Append ``other``'s pairs after these, and add up the counts of dropped pairs."""
        for name, value in other.as_dict().items():
            if isinstance(value, list):
                getattr(self, name).extend(value)
            else:
                setattr(self, name, getattr(self, name) + value)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CalibrationPairs:
        return cls(**d)


def judge_and_label_pairs(
    examples: Sequence[SummExample], a: Sequence[str], b: Sequence[str], judge: Judge
) -> CalibrationPairs:
    """Judge each (a, b) pair and label it with neutral ROUGE-L; ties and judge failures are dropped and counted."""
    refs = references_for(judge, examples)
    res = judge([e.article for e in examples], list(a), list(b), refs)
    return label_pairs(examples, a, b, res.scores, res.valid, refs)


def label_pairs(
    examples: Sequence[SummExample],
    a: Sequence[str],
    b: Sequence[str],
    scores: Sequence[float],
    valid: Sequence[bool],
    refs: Sequence[Sequence[str]],
) -> CalibrationPairs:
    """Judged pairs labeled with neutral ROUGE-L (1: ``a`` is closer to the article's neutral summary);
    ties and judge failures are dropped and counted."""
    out = CalibrationPairs()
    for ex, x, y, s, ok, r in zip(examples, a, b, scores, valid, refs):
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


def holdout_mask(article_ids: Sequence[str], fraction: float, seed: int) -> np.ndarray:
    """True for pairs whose article is in the held-out part (stable per article id and seed)."""
    from judgeloop.data import hash_unit

    return np.array([hash_unit(i, salt=f"holdout{seed}") < fraction for i in article_ids], dtype=bool)


def gather_pairs(mine: CalibrationPairs) -> CalibrationPairs:
    """Every process's pairs in one :class:`CalibrationPairs`, the same on every process: process 0's
    pairs first, then process 1's, and so on; the counts of dropped pairs added up. The one way pairs
    cross processes (the fresh calibration pairs and the evaluation's pairs alike)."""
    out = CalibrationPairs()
    for part in gather_object([mine.as_dict()]):
        out.extend(CalibrationPairs.from_dict(part))
    return out


def collect_calibration_pairs(
    policy: Policy, judge: Judge, calibration: Sequence[SummExample], cfg: FeedbackLoopConfig, step: int
) -> CalibrationPairs:
    """Fresh pairs for the calibrator: two samples of the *current* policy per calibration article (drawn
    where its backend says), judged and ROUGE-labeled (articles drawn from the calibration split only).

    ``calibration.num_articles`` articles are drawn in a seeded order. Pairs whose two summaries tie on
    ROUGE-L carry no label and are dropped; when that leaves fewer than ``calibration.min_points`` pairs
    on the fit side (articles not held out), up to ``calibration.extra_rounds`` more batches of
    ``num_articles`` articles are drawn from the same order, so a weak policy whose samples often tie
    still gets a calibrator.
    """
    ccfg, accelerator = cfg.calibration, policy.accelerator
    order = np.random.RandomState(derive_seed(cfg.seed, "calib_articles", step)).permutation(len(calibration))
    out = CalibrationPairs()
    for round_ in range(ccfg.extra_rounds + 1):
        pick = order[round_ * ccfg.num_articles : (round_ + 1) * ccfg.num_articles]
        if not len(pick):
            break
        # round 0 keeps the seed the loop has always used; later rounds get their own
        tag: tuple[Any, ...] = (step, accelerator.process_index) + ((round_,) if round_ else ())
        picked = [calibration[i] for i in sorted(pick)]
        mine = _label_own_share(
            policy,
            judge,
            (shard(picked, accelerator), len(real_part(picked, len(picked), accelerator))),
            cfg,
            derive_seed(cfg.seed, "calib", *tag),
        )
        out.extend(gather_pairs(mine))
        fit = int((~holdout_mask(out.article_ids, ccfg.holdout_fraction, cfg.seed)).sum())
        if fit >= ccfg.min_points:  # the same on every process: the rows were gathered
            break
    return out


def _label_own_share(
    policy: Policy,
    judge: Judge,
    share: tuple[Sequence[SummExample], int],
    cfg: FeedbackLoopConfig,
    seed: int,
) -> CalibrationPairs:
    """This process's labeled pairs for its share of the calibration articles (gathered by the caller).
    ``share``: the padded shard and how many of its articles are real (the rest only keep the ranks'
    generate calls in step)."""
    mine, num_real = share
    if not mine:
        return CalibrationPairs()
    k = cfg.calibration.pairs_per_article
    with policy.generating():
        roll = policy.sample([e.article for e in mine], cfg.generation, seed=seed, num_pairs=k)
    exs = [e for e in mine[:num_real] for _ in range(k)]  # article-major, as the rollout returns them
    return judge_and_label_pairs(exs, roll.a_text[: len(exs)], roll.b_text[: len(exs)], judge)


def initial_calibration_pairs(
    start: StartWork, cfg: FeedbackLoopConfig, calibration: Sequence[SummExample], collect: Any
) -> CalibrationPairs:
    """The step-0 calibration pairs: samples of the starting policy, judged and labeled; shared by the
    calibrated arms of a seed (they differ only in the map fitted on these pairs)."""
    ccfg = cfg.calibration
    key = {
        "policy_fp": getattr(start, "policy_fp", None),
        "seed": cfg.seed,
        "judge": dataclasses.asdict(cfg.judge),
        "calibration_ids": [e.id for e in calibration],
        "sampling": [ccfg.num_articles, ccfg.extra_rounds, ccfg.pairs_per_article, ccfg.holdout_fraction],
        "min_points": ccfg.min_points,
    }
    if arm(ccfg.method).judge == "panel":  # judged by the panel, not by the judge the other arms share
        key["panel"] = dataclasses.asdict(ccfg.panel)
    return CalibrationPairs.from_dict(start.get("calibration_pairs", key, lambda: collect().as_dict()))
