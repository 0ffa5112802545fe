"""Conformal retrieval sets: split conformal thresholds over retrieval scores, per group, online.

Everything here works on plain arrays, so any retriever can feed it. A batch of retrieved queries is

* ``scores``: ``(Q, K)`` candidate scores of the top-K documents, already mapped to [0, 1]
  (:func:`map_scores`), best first;
* ``relevant``: ``(Q, K)`` bool, whether each candidate is a relevant document (from qrels);
* ``num_missing``: ``(Q,)`` int, relevant documents of the query that are *not* in the top-K.

Nonconformity follows the standard binary form (Angelopoulos & Bates 2021, "A gentle introduction to
conformal prediction", sec. 1): ``1 - s`` for a relevant document, ``s`` for a non-relevant one. A
relevant document outside the top-K gets ``+inf``: no finite threshold can ever include it, so the
coverage we report is honest about the retriever's recall.

Guarantees (``guarantee=``):

* ``"document"``: every relevant (query, document) pair is one calibration point; the set
  ``{d : 1 - s_d <= q}`` holds a given relevant document with probability >= 1 - alpha
  (pairs of one query are not independent; with mostly one relevant document per query, as in
  SciFact, this is a mild departure from exchangeability);
* ``"any"``: one point per query, ``min`` over its relevant documents: the set holds at least one;
* ``"all"``: one point per query, ``max`` over its relevant documents: the set holds all of them;
* ``"labels"``: every (query, candidate) pair with its label; the per-document label set is
  ``{y : score(y) <= q}``, i.e. ``{1}``, ``{0}`` or ``{0, 1}`` (or empty).

Two threshold rules (``threshold_rule=``):

* ``"quantile"``: the ``ceil((n+1)(1-alpha))``-th smallest calibration score (Vovk et al. 2005;
  Angelopoulos & Bates 2021, eq. 1), ``+inf`` when that index exceeds ``n``: then the only set with the
  guarantee is the whole corpus.
* ``"base_rate"``: ``tau(alpha, beta)`` (:func:`base_rate_threshold`). A calibration point is covered only if
  its relevant document is among the top-K candidates at all (the group's *base rate* ``pi``: the share of
  its points with a finite score) *and* scores within the threshold, so
  ``coverage = pi * P(score <= tau | in the top-K)``. The rule asks the conditional quantile for level
  ``(1 - alpha) / pi_low``, with ``pi_low`` the lower end of the base rate's ``beta`` interval (Wilson or
  Clopper-Pearson, as :func:`base_rates` reports it): a group with a low base rate needs a higher
  conditional level, and a wide interval (few points) moves the threshold to the conservative side.
  Since ``pi_low <= k/n``, ``tau(alpha, beta)`` is never below the ``"quantile"`` threshold on the same
  points, so it keeps that rule's guarantee (coverage >= 1 - alpha).

Mondrian thresholds (Vovk et al. 2005, ch. 4.5) are fitted per group; groups with fewer than
``min_group_size`` calibration points fall back to their parent group, then to the global threshold. A
group with no calibration data at all (unseen) gets **the most conservative threshold** among the fitted
groups (the largest of their own thresholds and the global one), and the fit logs one line naming the group
and the threshold. ``max_set_size`` caps a set at its best candidates (what that costs in coverage is
measured by :func:`coverage_and_size`). :class:`AdaptiveConformal` implements adaptive conformal inference
(Gibbs & Candes 2021, "Adaptive conformal inference under distribution shift", eq. 2) on a sliding
window, with a rolling-coverage alarm and a set-size alarm.

A fitted retriever keeps its sorted calibration scores (``scores_``), so one fit answers every level:
:meth:`ConformalRetriever.levels` gives, per candidate, the tightest of several coverage levels whose set
holds it, and :meth:`ConformalRetriever.pvalue` its conformal p-value (how far inside the sets it sits).
:func:`save_conformal_file` / :func:`load_conformal_file` write and read a fitted retriever with the
fingerprint of the corpus and the encoder it was fitted on; loading it for another corpus is an error.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from judgeloop.intervals import clopper_pearson_interval, wilson_interval
from judgeloop.logging import get_logger

logger = get_logger(__name__)

Guarantee = Literal["document", "any", "all", "labels"]
ScoreMap = Literal["affine", "softmax", "identity"]
ThresholdRule = Literal["quantile", "base_rate"]
Interval = Literal["wilson", "clopper_pearson"]
GUARANTEES = ("document", "any", "all", "labels")
THRESHOLD_RULES = ("quantile", "base_rate")
INTERVALS = ("wilson", "clopper_pearson")
GLOBAL = "__global__"
MOST_CONSERVATIVE = "most_conservative"  # the source of an unseen group's threshold

__all__ = [
    "GLOBAL",
    "GUARANTEES",
    "AdaptiveConformal",
    "ConformalRetriever",
    "MOST_CONSERVATIVE",
    "THRESHOLD_RULES",
    "base_rate_alpha",
    "base_rate_threshold",
    "base_rates",
    "conformal_file_info",
    "corpus_fingerprint",
    "load_conformal_file",
    "save_conformal_file",
    "clopper_pearson_interval",
    "conformal_quantile",
    "coverage_and_size",
    "map_scores",
    "nonconformity",
    "parent_group",
    "quantile_buckets",
    "wilson_interval",
]


# ----------------------------------------------------------------------------------------------
# Scores and the quantile rule
# ----------------------------------------------------------------------------------------------


def map_scores(scores: np.ndarray, method: ScoreMap = "affine", temperature: float = 0.05) -> np.ndarray:
    """Map raw retrieval scores ``(Q, K)`` to [0, 1].

    Args:
        scores: raw scores, best first per row.
        method: ``"affine"``: ``(1 + s) / 2``, for cosine similarities in [-1, 1] (clipped);
            ``"softmax"``: ``softmax(s / temperature)`` over the K candidates of each query (a
            query-relative score; the set then adapts to how peaked the ranking is);
            ``"identity"``: scores already in [0, 1] (checked).
        temperature: softmax temperature (only for ``"softmax"``).
    """
    s = np.asarray(scores, dtype=np.float64)
    if method == "affine":
        return np.clip((1.0 + s) / 2.0, 0.0, 1.0)
    if method == "softmax":
        if temperature <= 0:
            raise ValueError(f"temperature={temperature} must be > 0 for the softmax score map")
        z = s / temperature
        z = z - z.max(axis=-1, keepdims=True)
        e = np.exp(z)
        return e / e.sum(axis=-1, keepdims=True)
    if method == "identity":
        if s.size and (np.nanmin(s) < 0 or np.nanmax(s) > 1):
            raise ValueError(
                f"score_map='identity' needs scores in [0, 1], got range [{np.nanmin(s):.3g}, {np.nanmax(s):.3g}]; "
                "use score_map='affine' for cosine similarities"
            )
        return s
    raise ValueError(f"score_map={method!r} is not one of ['affine', 'softmax', 'identity']")


def conformal_quantile(scores: Sequence[float] | np.ndarray, alpha: float) -> float:
    """The split-conformal threshold: the ``ceil((n+1)(1-alpha))``-th smallest of ``scores``.

    With ``n`` exchangeable calibration scores and a new exchangeable score ``S``,
    ``P(S <= q) >= 1 - alpha`` (and ``<= 1 - alpha + 1/(n+1)`` without ties). Returns ``+inf``
    when the index exceeds ``n`` (too few points for this ``alpha``) or lands on an infinite score.
    """
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"alpha={alpha} must be in (0, 1); e.g. alpha=0.1 for 90% coverage")
    s = np.sort(np.asarray(scores, dtype=np.float64))
    n = s.size
    # The tiny slack stops (n+1)(1-alpha) = 19.000000000000004 from rounding up to 20.
    k = math.ceil((n + 1) * (1.0 - alpha) - 1e-9)
    if n == 0 or k > n:
        return math.inf
    return float(s[max(k, 1) - 1])


def _interval(method: Interval) -> Callable[[int, int, float], tuple[float, float]]:
    if method not in INTERVALS:
        raise ValueError(f"interval={method!r} is not one of {list(INTERVALS)}")
    return wilson_interval if method == "wilson" else clopper_pearson_interval


def base_rate_alpha(alpha: float, base_rate_low: float) -> float:
    """The conditional miscoverage that reaches ``1 - alpha`` overall at base rate ``base_rate_low``.

    Coverage is ``pi * (1 - alpha')`` (the relevant document must be a candidate, then inside the set), so
    ``alpha' = 1 - (1 - alpha) / pi``. ``alpha' <= 0`` (``pi < 1 - alpha``): no threshold on the candidates
    reaches the level; the caller's threshold is then ``+inf`` (the whole corpus).
    """
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"alpha={alpha} must be in (0, 1); e.g. alpha=0.1 for 90% coverage")
    if base_rate_low <= 0.0:
        return -math.inf
    return 1.0 - (1.0 - alpha) / base_rate_low


def base_rate_threshold(
    values: Sequence[float] | np.ndarray, alpha: float, beta: float = 0.95, interval: Interval = "wilson"
) -> tuple[float, dict[str, float]]:
    """``tau(alpha, beta)``: one group's threshold from its base rate and the base rate's interval.

    Args:
        values: the group's calibration nonconformity scores; ``+inf`` marks a relevant document outside
            the top-K (not a candidate), so the base rate is ``k / n`` with ``k`` the finite ones.
        alpha: target miscoverage.
        beta: confidence level of the base rate's two-sided interval (``interval``: ``"wilson"`` or
            ``"clopper_pearson"``, the ones :func:`base_rates` reports); its lower end ``pi_low`` sets the level.
        interval: which interval.

    Returns:
        ``(tau, info)``: ``tau`` is the split-conformal quantile of the ``k`` finite scores at
        ``alpha' = 1 - (1 - alpha) / pi_low`` (:func:`base_rate_alpha`), ``+inf`` when ``alpha' <= 0`` or
        the index exceeds ``k``; ``info`` holds ``n``, ``k``, ``rate`` (``k / n``), ``low``, ``high`` and
        ``alpha_eff`` (``alpha'``).

    Because ``pi_low <= k / n`` and ``(k + 1) n / k >= n + 1``, the index ``ceil((k+1)(1-alpha'))`` is never
    below the plain rule's ``ceil((n+1)(1-alpha))``: ``tau`` is at least :func:`conformal_quantile` of all
    ``n`` scores, so its coverage is at least ``1 - alpha``. Needs exchangeable calibration and test points
    within the group, as the plain rule does.
    """
    v = np.asarray(values, dtype=np.float64)
    if not 0.0 < beta < 1.0:
        raise ValueError(f"beta={beta} must be in (0, 1); it is the base rate interval's confidence level")
    finite = v[np.isfinite(v)]
    n, k = int(v.size), int(finite.size)
    low, high = _interval(interval)(k, n, beta)
    a = base_rate_alpha(alpha, low)
    tau = conformal_quantile(finite, a) if 0.0 < a < 1.0 else math.inf
    info = {"n": n, "k": k, "rate": k / n if n else math.nan, "low": low, "high": high, "alpha_eff": a}
    return tau, info


def nonconformity(
    scores: np.ndarray, relevant: np.ndarray, num_missing: np.ndarray, guarantee: Guarantee = "document"
) -> tuple[np.ndarray, np.ndarray]:
    """Calibration nonconformity scores and the query each belongs to.

    Args:
        scores: ``(Q, K)`` candidate scores in [0, 1].
        relevant: ``(Q, K)`` bool relevance of each candidate.
        num_missing: ``(Q,)`` relevant documents outside the top-K (each one scores ``+inf``).
        guarantee: see the module docstring.

    Returns:
        ``(values, query_index)``: 1-D arrays of equal length. Queries without any relevant
        document contribute nothing to ``"document"``, ``"any"`` and ``"all"``.
    """
    s = np.asarray(scores, dtype=np.float64)
    rel = np.asarray(relevant, dtype=bool)
    miss = np.asarray(num_missing, dtype=np.int64)
    if s.shape != rel.shape or s.ndim != 2 or miss.shape != (s.shape[0],):
        raise ValueError(
            f"shapes do not match: scores {s.shape}, relevant {rel.shape}, num_missing {miss.shape}; "
            "expected (Q, K), (Q, K), (Q,)"
        )
    q_idx = np.arange(s.shape[0])
    if guarantee == "document":
        rows, _ = np.nonzero(rel)
        vals = 1.0 - s[rel]
        miss_rows = np.repeat(q_idx, miss)
        values = np.concatenate([vals, np.full(miss_rows.size, math.inf)])
        return values, np.concatenate([rows, miss_rows])
    if guarantee in ("any", "all"):
        nc = np.where(rel, 1.0 - s, np.nan)  # (Q, K)
        has = rel.any(axis=1) | (miss > 0)
        with np.errstate(all="ignore"):
            if guarantee == "any":
                # min over relevant docs; a missing doc (inf) only matters when no candidate is relevant
                best = np.where(rel.any(axis=1), np.nanmin(np.where(rel, nc, np.inf), axis=1), math.inf)
                values = best
            else:
                worst = np.where(rel.any(axis=1), np.nanmax(np.where(rel, nc, -np.inf), axis=1), -math.inf)
                values = np.where(miss > 0, math.inf, worst)
        return values[has], q_idx[has]
    if guarantee == "labels":
        # every candidate with its true label: 1 - s for y = 1, s for y = 0
        values = np.where(rel, 1.0 - s, s).reshape(-1)
        return values, np.repeat(q_idx, s.shape[1])
    raise ValueError(f"guarantee={guarantee!r} is not one of {list(GUARANTEES)}")


def coverage_and_size(
    scores: np.ndarray,
    relevant: np.ndarray,
    num_missing: np.ndarray,
    thresholds: np.ndarray,
    guarantee: Guarantee,
    corpus_size: int,
    max_set_size: int | None = None,
) -> dict[str, np.ndarray]:
    """Per-query outcomes of the sets ``{d in top-K : 1 - s_d <= q}`` (the whole corpus if ``q = inf``).

    Args:
        thresholds: ``(Q,)`` the threshold applied to each query (its group's).
        max_set_size: cap every set at its best ``max_set_size`` candidates (rows are best first); a
            whole-corpus set becomes the top ``max_set_size``. ``None``: no cap. Not for ``"labels"``.

    Returns:
        ``covered`` ``(Q,)`` float: fraction of the query's relevant documents in the set
        (``"document"``), or 0/1 (``"any"``, ``"all"``), or the fraction of candidates whose label
        set holds the true label (``"labels"``); ``weight`` ``(Q,)``: how many calibration-style points
        the query stands for (relevant documents for ``"document"``, K for ``"labels"``, else 1);
        ``size`` ``(Q,)``: set size (documents; for ``"labels"``, the mean label-set size);
        ``full`` ``(Q,)`` bool: the set is the whole corpus; ``capped`` ``(Q,)`` bool: the cap cut the set.
    """
    s = np.asarray(scores, dtype=np.float64)
    rel = np.asarray(relevant, dtype=bool)
    miss = np.asarray(num_missing, dtype=np.int64)
    q = np.asarray(thresholds, dtype=np.float64)[:, None]  # (Q, 1)
    full = ~np.isfinite(q[:, 0])
    if guarantee == "labels":
        if max_set_size is not None:
            raise ValueError(
                f"max_set_size={max_set_size} caps a retrieval set; a label set (guarantee='labels') holds at "
                "most 2 labels, so there is nothing to cap; unset max_set_size"
            )
        has1 = (1.0 - s) <= q
        has0 = s <= q
        ok = np.where(rel, has1, has0)
        return {
            "covered": ok.mean(axis=1),
            "weight": np.full(s.shape[0], float(s.shape[1])),
            "size": (has1.astype(float) + has0.astype(float)).mean(axis=1),
            "full": full,
            "capped": np.zeros(s.shape[0], dtype=bool),
        }
    inside = (1.0 - s) <= q  # (Q, K)
    capped = np.zeros(s.shape[0], dtype=bool)
    if max_set_size is not None:
        if max_set_size < 1:
            raise ValueError(f"max_set_size={max_set_size} must be >= 1 or None (no cap)")
        keep = np.arange(s.shape[1]) < max_set_size  # (K,) the best max_set_size candidates
        capped = full | (inside & ~keep).any(axis=1)
        inside = (inside | full[:, None]) & keep  # a whole-corpus set becomes its top max_set_size
        full = np.zeros_like(full)
    size = np.where(full, float(corpus_size), inside.sum(axis=1).astype(float))
    n_rel = rel.sum(axis=1) + miss
    hit = (inside & rel).sum(axis=1) + np.where(full, miss, 0)
    if guarantee == "document":
        covered = np.divide(hit, n_rel, out=np.zeros(len(n_rel), dtype=float), where=n_rel > 0)
        weight = n_rel.astype(float)
    elif guarantee == "any":
        covered = (hit > 0).astype(float)
        weight = (n_rel > 0).astype(float)
    elif guarantee == "all":
        covered = (hit == n_rel).astype(float)
        weight = (n_rel > 0).astype(float)
    else:
        raise ValueError(f"guarantee={guarantee!r} is not one of {list(GUARANTEES)}")
    return {"covered": covered, "weight": weight, "size": size, "full": full, "capped": capped}


# ----------------------------------------------------------------------------------------------
# Mondrian (per-group) split conformal
# ----------------------------------------------------------------------------------------------


def parent_group(group: str) -> str | None:
    """Parent of a hierarchical group label: ``"qa/short"`` -> ``"qa"``; a top-level label has none."""
    return group.rsplit("/", 1)[0] if "/" in group else None


@dataclass
class GroupFit:
    """One group's conformal threshold and where it came from (its own data, a parent, global, or, for a
    group with no calibration data, the most conservative of the fitted thresholds)."""

    n_cal: int
    threshold: float
    source: str  # "own", "parent:<label>", "global" or "most_conservative"


class ConformalRetriever:
    """Split-conformal retrieval sets with Mondrian (per-group) thresholds.

    Args:
        alpha: miscoverage level.
        guarantee: ``"document"``, ``"any"``, ``"all"`` or ``"labels"`` (module docstring).
        min_group_size: a group needs this many calibration scores for its own threshold; smaller
            groups use their parent's (``parent_fn``), and failing that the global threshold. A group with
            no calibration data gets the most conservative fitted threshold (:meth:`group_threshold`).
        parent_fn: group -> parent group or ``None`` (default: :func:`parent_group`, split on ``/``).
        threshold_rule: ``"quantile"`` (the split-conformal quantile) or ``"base_rate"`` (``tau(alpha, beta)``,
            :func:`base_rate_threshold`).
        beta: confidence level of the base rate's interval (``threshold_rule="base_rate"`` only).
        interval: ``"wilson"`` or ``"clopper_pearson"`` (``threshold_rule="base_rate"`` only).
        max_set_size: :meth:`predict` keeps at most this many candidates per query (its best ones);
            ``None``: no cap. The cap costs coverage (:func:`coverage_and_size` measures it).
        log_unseen: log one line the first time a group with no calibration data asks for its threshold.

    Learned attributes: ``threshold_`` (global), ``groups_`` (label -> :class:`GroupFit`),
    ``n_cal_`` (global number of calibration scores), ``scores_`` (the sorted global calibration scores),
    ``base_rates_`` (label -> the :func:`base_rate_threshold` info, ``threshold_rule="base_rate"`` only; global
    under :data:`GLOBAL`), ``unseen_`` (label -> threshold of the unseen groups asked for so far).
    """

    def __init__(
        self,
        alpha: float = 0.1,
        guarantee: Guarantee = "document",
        min_group_size: int = 50,
        parent_fn: Callable[[str], str | None] | None = None,
        threshold_rule: ThresholdRule = "quantile",
        beta: float = 0.95,
        interval: Interval = "wilson",
        max_set_size: int | None = None,
        log_unseen: bool = True,
    ) -> None:
        if not 0.0 < alpha < 1.0:
            raise ValueError(f"alpha={alpha} must be in (0, 1); e.g. alpha=0.1 for 90% coverage")
        if guarantee not in GUARANTEES:
            raise ValueError(f"guarantee={guarantee!r} is not one of {list(GUARANTEES)}")
        if min_group_size < 1:
            raise ValueError(f"min_group_size={min_group_size} must be >= 1")
        if threshold_rule not in THRESHOLD_RULES:
            raise ValueError(f"threshold_rule={threshold_rule!r} is not one of {list(THRESHOLD_RULES)}")
        if not 0.0 < beta < 1.0:
            raise ValueError(
                f"beta={beta} must be in (0, 1); it is the base rate interval's confidence level"
            )
        _interval(interval)
        if max_set_size is not None and (max_set_size < 1 or guarantee == "labels"):
            raise ValueError(
                f"max_set_size={max_set_size} must be >= 1 or None (no cap), and only caps retrieval sets, "
                "not the label sets of guarantee='labels'"
            )
        self.alpha = alpha
        self.guarantee: Guarantee = guarantee
        self.min_group_size = min_group_size
        self.parent_fn = parent_fn or parent_group
        self.threshold_rule: ThresholdRule = threshold_rule
        self.beta = beta
        self.interval: Interval = interval
        self.max_set_size = max_set_size
        self.log_unseen = log_unseen

    def _tau(self, values: np.ndarray, alpha: float, label: str | None = None) -> float:
        """The rule's threshold on one set of calibration scores (and, for the base-rate rule, its record)."""
        if self.threshold_rule == "quantile":
            return conformal_quantile(values, alpha)
        tau, info = base_rate_threshold(values, alpha, self.beta, self.interval)
        if label is not None:
            self.base_rates_[label] = info
        return tau

    def fit(
        self,
        scores: np.ndarray,
        relevant: np.ndarray,
        num_missing: np.ndarray,
        groups: Sequence[str] | None = None,
    ) -> ConformalRetriever:
        """Fit the global and per-group thresholds on calibration queries (arrays as in the module doc)."""
        values, q_idx = nonconformity(scores, relevant, num_missing, self.guarantee)
        if values.size == 0:
            raise ValueError(
                "calibration split holds no relevant documents; cannot fit a conformal threshold"
            )
        self.n_cal_ = int(values.size)
        self.scores_ = np.sort(values)
        self.base_rates_: dict[str, dict[str, float]] = {}
        self.unseen_: dict[str, float] = {}
        self.threshold_ = self._tau(values, self.alpha, GLOBAL)
        self.groups_: dict[str, GroupFit] = {}
        if groups is None:
            return self
        g = np.asarray([str(x) for x in groups], dtype=object)
        if g.shape[0] != np.asarray(scores).shape[0]:
            raise ValueError(f"groups has {g.shape[0]} labels for {np.asarray(scores).shape[0]} queries")
        point_groups = g[q_idx]  # group of every calibration score
        by_group: dict[str, np.ndarray] = {}
        labels = set(point_groups.tolist()) | set(g.tolist())
        # parents get pooled scores of all their descendants
        for label in list(labels):
            p = self.parent_fn(label)
            while p is not None:
                labels.add(p)
                p = self.parent_fn(p)
        for label in labels:
            mask = np.fromiter(
                (self._is_under(str(pg), label) for pg in point_groups), dtype=bool, count=point_groups.size
            )
            by_group[label] = values[mask]
        self._by_group_n = {k: int(v.size) for k, v in by_group.items()}
        own = {
            k: self._tau(v, self.alpha, k)
            for k, v in sorted(by_group.items())
            if v.size >= self.min_group_size
        }
        for label in sorted(labels):
            self.groups_[label] = self._resolve(label, own)
        return self

    def _is_under(self, label: str, ancestor: str) -> bool:
        node: str | None = label
        while node is not None:
            if node == ancestor:
                return True
            node = self.parent_fn(node)
        return False

    def _resolve(self, label: str, own: Mapping[str, float]) -> GroupFit:
        n = self._by_group_n.get(label, 0)
        if label in own:
            return GroupFit(n, own[label], "own")
        p = self.parent_fn(label)
        while p is not None:
            if p in own:
                return GroupFit(n, own[p], f"parent:{p}")
            p = self.parent_fn(p)
        return GroupFit(n, self.threshold_, "global")

    def most_conservative(self) -> tuple[float, str]:
        """The largest fitted threshold (the largest sets): over every group's own threshold and the
        global one; returns ``(threshold, label)`` (:data:`GLOBAL` when the global one is the largest)."""
        if not hasattr(self, "threshold_"):
            raise RuntimeError("ConformalRetriever is not fitted; call fit(...) first")
        best, label = self.threshold_, GLOBAL
        for name, fit in sorted(self.groups_.items()):
            if fit.source == "own" and fit.threshold > best:
                best, label = fit.threshold, name
        return best, label

    def group_threshold(self, group: str | None) -> tuple[float, str]:
        """Threshold and its source for ``group``.

        A group seen in calibration has its own threshold or its parent's / the global one (fewer than
        ``min_group_size`` points). A group with **no calibration data** gets **the most conservative
        threshold** (:meth:`most_conservative`), source ``"most_conservative"``: nothing says how its scores
        are spread, and the largest fitted set is the one least likely to under-cover it. The first time
        an unseen group asks, one line is logged naming the group and the threshold (``log_unseen``).
        """
        if not hasattr(self, "threshold_"):
            raise RuntimeError("ConformalRetriever is not fitted; call fit(...) first")
        if group is None:
            return self.threshold_, "global"
        fit = self.groups_.get(group)
        if fit is not None:
            return fit.threshold, fit.source
        tau, label = self.most_conservative()
        unseen = getattr(self, "unseen_", None)
        if unseen is None:
            unseen = self.unseen_ = {}
        if group not in unseen:
            unseen[group] = tau
            if self.log_unseen:
                logger.info(
                    "unseen group %r (no calibration data): the most conservative threshold, tau=%s (from %s)",
                    group,
                    f"{tau:.4f}",
                    "the global fit" if label == GLOBAL else f"group {label!r}",
                )
        return tau, MOST_CONSERVATIVE

    def thresholds_for(self, num_queries: int, groups: Sequence[str] | None = None) -> np.ndarray:
        """``(Q,)`` threshold applied to each query."""
        if groups is None:
            return np.full(num_queries, self.group_threshold(None)[0])
        return np.asarray([self.group_threshold(str(x))[0] for x in groups], dtype=np.float64)

    def predict(self, scores: np.ndarray, groups: Sequence[str] | None = None) -> np.ndarray:
        """``(Q, K)`` bool: candidates inside the set. A row whose threshold is ``inf`` means the whole
        corpus (every candidate is marked, and the documents beyond the top-K are in the set too).

        For ``guarantee="labels"`` returns ``(Q, K, 2)``: whether label 0 / label 1 is in each
        document's label set.
        """
        s = np.asarray(scores, dtype=np.float64)
        q = self.thresholds_for(s.shape[0], groups)[:, None]
        if self.guarantee == "labels":
            return np.stack([s <= q, (1.0 - s) <= q], axis=-1)
        inside = (1.0 - s) <= q
        if self.max_set_size is not None:  # the best max_set_size candidates (rows are best first)
            inside &= np.arange(s.shape[1]) < self.max_set_size
        return inside

    def threshold_at(self, coverage: float) -> float:
        """The global threshold of the ``coverage`` (= 1 - alpha) set, from the kept calibration scores
        (by the fitted rule, ``threshold_rule``)."""
        if not hasattr(self, "scores_"):
            raise RuntimeError("ConformalRetriever is not fitted; call fit(...) first")
        return self._tau(self.scores_, 1.0 - coverage)

    def pvalue(self, scores: np.ndarray) -> np.ndarray:
        """Conformal p-values of candidates with scores ``s`` (same shape): ``(1 + #{i : S_i >= 1 - s}) /
        (n + 1)`` over the calibration scores ``S_i`` (Vovk et al. 2005; Angelopoulos & Bates 2021, sec. 3).
        A candidate scoring like a typical relevant document gets a large p; one that no relevant
        calibration document scored as badly gets ``1 / (n + 1)``. For the document guarantee only."""
        if self.guarantee == "labels":
            raise ValueError("pvalue is defined for the document / any / all guarantees, not 'labels'")
        if not hasattr(self, "scores_"):
            raise RuntimeError("ConformalRetriever is not fitted; call fit(...) first")
        v = 1.0 - np.asarray(scores, dtype=np.float64)
        n = self.scores_.size
        at_least = n - np.searchsorted(self.scores_, v, side="left")  # #{S_i >= v}
        return (1.0 + at_least) / (n + 1.0)

    def levels(self, scores: np.ndarray, coverages: Sequence[float]) -> np.ndarray:
        """Per candidate, the tightest (lowest) of ``coverages`` whose global set holds it, NaN when none
        does: with ``coverages=[0.8, 0.95]``, 0.8 = inside the 80% set (and so the 95% one), 0.95 = inside
        the 95% set only, NaN = outside both."""
        levels = sorted(float(c) for c in coverages)
        bad = [c for c in levels if not 0.0 < c < 1.0]
        if bad or not levels:
            raise ValueError(f"coverages={list(coverages)} must be a non-empty list of values in (0, 1)")
        v = 1.0 - np.asarray(scores, dtype=np.float64)
        out = np.full(v.shape, np.nan)
        for c in reversed(levels):  # widest first, so the tightest level that holds it is written last
            out[v <= self.threshold_at(c)] = c
        return out

    def state_dict(self) -> dict[str, Any]:
        return {
            "alpha": self.alpha,
            "guarantee": self.guarantee,
            "min_group_size": self.min_group_size,
            "threshold_rule": self.threshold_rule,
            "beta": self.beta,
            "interval": self.interval,
            "max_set_size": self.max_set_size,
            "base_rates_": dict(getattr(self, "base_rates_", {})),
            "n_cal_": getattr(self, "n_cal_", None),
            "threshold_": getattr(self, "threshold_", None),
            "groups_": {k: vars(v) for k, v in getattr(self, "groups_", {}).items()},
            "scores_": getattr(self, "scores_", np.zeros(0)).tolist(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> ConformalRetriever:
        self.alpha = float(state["alpha"])
        self.guarantee = state["guarantee"]
        self.min_group_size = int(state["min_group_size"])
        # files written before the base-rate rule have the plain quantile's thresholds
        self.threshold_rule = state.get("threshold_rule", "quantile")
        self.beta = float(state.get("beta", 0.95))
        self.interval = state.get("interval", "wilson")
        self.max_set_size = state.get("max_set_size")
        self.base_rates_ = {k: dict(v) for k, v in state.get("base_rates_", {}).items()}
        self.unseen_ = {}
        self.n_cal_ = state["n_cal_"]
        thr = state["threshold_"]
        self.threshold_ = math.inf if thr is None else float(thr)  # JSON stores inf as null
        self.groups_ = {
            k: GroupFit(
                int(v["n_cal"]), math.inf if v["threshold"] is None else float(v["threshold"]), v["source"]
            )
            for k, v in state["groups_"].items()
        }
        self._by_group_n = {k: v.n_cal for k, v in self.groups_.items()}
        if state.get("scores_"):  # JSON stores inf as null (a relevant document outside the top-K)
            self.scores_ = np.sort(
                np.asarray([math.inf if x is None else float(x) for x in state["scores_"]])
            )
        return self


# ----------------------------------------------------------------------------------------------
# Base rates
# ----------------------------------------------------------------------------------------------


def base_rates(
    success: Sequence[bool] | np.ndarray,
    groups: Sequence[str] | None = None,
    confidence: float = 0.95,
    method: Literal["wilson", "clopper_pearson"] = "wilson",
) -> dict[str, dict[str, float]]:
    """Per-group historical success rate of retrieval with a confidence interval.

    Args:
        success: per query, whether retrieval succeeded (e.g. a relevant document in the top-k).
        groups: per-query group labels (``None``: one global group).

    Returns:
        ``{group: {"n", "successes", "rate", "low", "high"}}`` plus the :data:`GLOBAL` entry.
    """
    ok = np.asarray(success, dtype=bool)
    interval = wilson_interval if method == "wilson" else clopper_pearson_interval
    labels = np.asarray([GLOBAL] * ok.size if groups is None else [str(g) for g in groups], dtype=object)
    out: dict[str, dict[str, float]] = {}
    for label in [GLOBAL] + sorted(set(labels.tolist()) - {GLOBAL}):
        mask = np.ones(ok.size, dtype=bool) if label == GLOBAL else labels == label
        n, k = int(mask.sum()), int(ok[mask].sum())
        low, high = interval(k, n, confidence)
        out[label] = {"n": n, "successes": k, "rate": k / n if n else math.nan, "low": low, "high": high}
    return out


def quantile_buckets(feature: np.ndarray, num_buckets: int, prefix: str = "bucket") -> np.ndarray:
    """Label-free buckets: ``prefix/1`` (lowest values) ... ``prefix/num_buckets`` by quantiles of ``feature``.

    Boundaries are a symmetric function of all values passed in (calibration and test together), so
    bucketing does not break exchangeability between calibration and test queries.
    """
    x = np.asarray(feature, dtype=np.float64)
    if num_buckets < 1:
        raise ValueError(f"num_buckets={num_buckets} must be >= 1")
    edges = np.quantile(x, np.linspace(0, 1, num_buckets + 1)[1:-1]) if num_buckets > 1 else np.array([])
    idx = np.searchsorted(edges, x, side="right") + 1
    return np.asarray([f"{prefix}/{i}" for i in idx], dtype=object)


# ----------------------------------------------------------------------------------------------
# Online: sliding-window recalibration + adaptive conformal inference, with a coverage alarm
# ----------------------------------------------------------------------------------------------


class AdaptiveConformal:
    """Adaptive conformal inference (ACI) over a stream of nonconformity scores.

    At step t the threshold is the conformal quantile at level ``alpha_t`` of the last ``window``
    scores (all past scores if ``window`` is ``None``); after seeing the score,
    ``alpha_{t+1} = alpha_t + gamma * (alpha - err_t)`` with ``err_t = 1`` on a miss
    (Gibbs & Candes 2021, eq. 2). ``gamma = 0`` gives plain sliding-window recalibration.
    ``alpha_t <= 0`` means an infinite threshold (whole corpus), ``alpha_t >= 1`` an empty set.

    The monitor keeps the last ``monitor_window`` outcomes; :attr:`alarm` is on while their mean
    coverage is below ``1 - alpha - tolerance`` (only once the monitor window is full). :attr:`size_alarm`
    is on while the mean set size of the last ``monitor_window`` steps that logged one (``update`` with
    ``candidate_nonconformity``) exceeds ``max_mean_set_size`` (a whole-corpus set counts as infinite):
    ACI buys coverage back under drift by widening the sets, and this says when they grow too large to use.
    """

    def __init__(
        self,
        alpha: float = 0.1,
        gamma: float = 0.005,
        window: int | None = 500,
        warmup: int = 20,
        monitor_window: int = 100,
        tolerance: float = 0.05,
        max_mean_set_size: float | None = None,
    ) -> None:
        if not 0.0 < alpha < 1.0:
            raise ValueError(f"alpha={alpha} must be in (0, 1)")
        if max_mean_set_size is not None and not max_mean_set_size > 0:
            raise ValueError(f"max_mean_set_size={max_mean_set_size} must be > 0 or None (no set-size alarm)")
        if gamma < 0:
            raise ValueError(f"gamma={gamma} must be >= 0 (0 = sliding-window recalibration only)")
        if window is not None and window < 1:
            raise ValueError(f"window={window} must be >= 1 or None (use all past scores)")
        self.alpha = alpha
        self.gamma = gamma
        self.window = window
        self.warmup = warmup
        self.monitor_window = monitor_window
        self.tolerance = tolerance
        self.max_mean_set_size = max_mean_set_size
        self.reset()

    def reset(self) -> None:
        self.alpha_t_ = self.alpha
        self.history_: list[float] = []
        self.outcomes_: list[float] = []
        self.sizes_: list[float] = []
        self.t_ = 0

    def fit(self, scores: Sequence[float]) -> AdaptiveConformal:
        """Seed the window with calibration scores (optional)."""
        self.history_.extend(float(x) for x in scores)
        return self

    def threshold(self) -> float:
        """The threshold for the next point."""
        past = self.history_ if self.window is None else self.history_[-self.window :]
        if len(past) < self.warmup or self.alpha_t_ <= 0.0:
            return math.inf
        if self.alpha_t_ >= 1.0:
            return -math.inf
        return conformal_quantile(past, self.alpha_t_)

    def update(self, score: float, candidate_nonconformity: np.ndarray | None = None) -> dict[str, float]:
        """Predict with the current threshold, observe ``score``, then adapt.

        Args:
            score: the new point's nonconformity (``inf`` for a relevant document outside the top-K).
            candidate_nonconformity: ``1 - s`` of the point's candidates, to log the set size.
        """
        q = self.threshold()
        covered = float(score <= q)
        size = math.nan
        if candidate_nonconformity is not None:
            size = math.inf if q == math.inf else float(np.sum(np.asarray(candidate_nonconformity) <= q))
        self.alpha_t_ = self.alpha_t_ + self.gamma * (self.alpha - (1.0 - covered))
        self.history_.append(float(score))
        if self.window is not None and len(self.history_) > 4 * self.window:
            del self.history_[: len(self.history_) - self.window]
        self.outcomes_.append(covered)
        self.sizes_.append(size)
        self.t_ += 1
        return {"threshold": q, "covered": covered, "size": size, "alpha_t": self.alpha_t_}

    @property
    def rolling_coverage(self) -> float:
        recent = self.outcomes_[-self.monitor_window :]
        return float(np.mean(recent)) if recent else math.nan

    @property
    def rolling_set_size(self) -> float:
        recent = [x for x in self.sizes_[-self.monitor_window :] if not math.isnan(x)]
        return float(np.mean(recent)) if recent else math.nan

    @property
    def alarm(self) -> bool:
        if len(self.outcomes_) < self.monitor_window:
            return False
        return self.rolling_coverage < 1.0 - self.alpha - self.tolerance

    @property
    def size_alarm(self) -> bool:
        """On while the rolling mean set size exceeds ``max_mean_set_size`` (once ``monitor_window`` sizes
        are logged; never without ``max_mean_set_size``)."""
        if self.max_mean_set_size is None:
            return False
        logged = [x for x in self.sizes_[-self.monitor_window :] if not math.isnan(x)]
        if len(logged) < self.monitor_window:
            return False
        return self.rolling_set_size > self.max_mean_set_size

    def run(
        self, scores: Sequence[float], candidates: Sequence[np.ndarray] | None = None
    ) -> dict[str, np.ndarray]:
        """Process a whole stream; returns per-step ``threshold``, ``covered``, ``alpha_t``, ``alarm``, and
        with ``candidates`` (per step, ``1 - s`` of the point's candidates) ``size`` and ``size_alarm``."""
        keys = ["threshold", "covered", "alpha_t", "alarm"] + (
            ["size", "size_alarm"] if candidates is not None else []
        )
        out: dict[str, list[float]] = {k: [] for k in keys}
        for i, x in enumerate(scores):
            r = self.update(float(x), None if candidates is None else candidates[i])
            out["threshold"].append(r["threshold"])
            out["covered"].append(r["covered"])
            out["alpha_t"].append(r["alpha_t"])
            out["alarm"].append(float(self.alarm))
            if candidates is not None:
                out["size"].append(r["size"])
                out["size_alarm"].append(float(self.size_alarm))
        return {k: np.asarray(v) for k, v in out.items()}

    def state_dict(self) -> dict[str, Any]:
        return {
            "alpha": self.alpha,
            "gamma": self.gamma,
            "window": self.window,
            "warmup": self.warmup,
            "monitor_window": self.monitor_window,
            "tolerance": self.tolerance,
            "max_mean_set_size": self.max_mean_set_size,
            "alpha_t_": self.alpha_t_,
            "history_": list(self.history_),
            "outcomes_": list(self.outcomes_),
            "sizes_": list(self.sizes_),
            "t_": self.t_,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> AdaptiveConformal:
        for key in ("alpha", "gamma", "window", "warmup", "monitor_window", "tolerance", "alpha_t_", "t_"):
            setattr(self, key, state[key])
        self.max_mean_set_size = state.get("max_mean_set_size")
        self.history_ = [math.inf if x is None else float(x) for x in state["history_"]]
        self.outcomes_ = list(state["outcomes_"])
        self.sizes_ = [math.nan if x is None else float(x) for x in state["sizes_"]]
        return self


# ----------------------------------------------------------------------------------------------
# A fitted retriever on disk, tied to its corpus and encoder
# ----------------------------------------------------------------------------------------------

CONFORMAL_FILE_KIND = "judgeloop.conformal_retriever"


def corpus_fingerprint(doc_ids: Sequence[str], doc_texts: Sequence[str]) -> dict[str, Any]:
    """``{"num_docs", "digest"}`` of a corpus: the SHA-256 of its (id, text) pairs in id order."""
    from judgeloop.hashing import texts_digest

    if len(doc_ids) != len(doc_texts):
        raise ValueError(f"{len(doc_ids)} document ids for {len(doc_texts)} texts")
    pairs = sorted(zip((str(d) for d in doc_ids), doc_texts))
    return {"num_docs": len(pairs), "digest": texts_digest(x for pair in pairs for x in pair)}


def save_conformal_file(
    path: str | Path, model: ConformalRetriever, corpus: Mapping[str, Any], scorer: Mapping[str, Any]
) -> None:
    """Write ``model`` with the ``corpus`` fingerprint (:func:`corpus_fingerprint`) and a description of the
    ``scorer`` that made its scores (encoder name, pooling, score map: whatever must match to reuse it)."""
    from judgeloop.io import atomic_write_json

    atomic_write_json(
        path,
        {
            "kind": CONFORMAL_FILE_KIND,
            "corpus": dict(corpus),
            "scorer": dict(scorer),
            "conformal": model.state_dict(),
        },
    )


def conformal_file_info(path: str | Path, key: str) -> dict[str, Any]:
    """A conformal file's ``corpus`` and ``scorer`` (and the fitted state), checked to be one.

    Raises:
        ValueError: missing, not JSON, or not a conformal retriever file; the message names ``key``.
    """
    import json

    p = Path(path)
    if not p.is_file():
        raise ValueError(f"{key}={path} does not exist; fit one (leave {key} unset) or fix the path")
    try:
        obj = json.loads(p.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{key}={path} is not JSON ({err.msg}, line {err.lineno})") from None
    if not isinstance(obj, dict) or obj.get("kind") != CONFORMAL_FILE_KIND:
        raise ValueError(f"{key}={path} is not a conformal retriever file (no kind '{CONFORMAL_FILE_KIND}')")
    return obj


def load_conformal_file(
    path: str | Path, corpus: Mapping[str, Any], scorer: Mapping[str, Any], key: str
) -> ConformalRetriever:
    """Read a file of :func:`save_conformal_file`, checking it was fitted on this ``corpus`` with this
    ``scorer``. ``key`` is the config key that named ``path``.

    Raises:
        ValueError: one line naming the key, the file, what differs and the fix.
    """
    obj = conformal_file_info(path, key)
    got = obj.get("corpus", {})
    if got.get("digest") != corpus.get("digest"):
        raise ValueError(
            f"{key}={path} was fitted on another corpus ({got.get('num_docs')} documents, digest "
            f"{str(got.get('digest'))[:12]}) than this run's ({corpus.get('num_docs')} documents, digest "
            f"{str(corpus.get('digest'))[:12]}); point {key} at the file fitted on this corpus, or unset it to fit one"
        )
    diff = {
        k: (obj.get("scorer", {}).get(k), v) for k, v in scorer.items() if obj.get("scorer", {}).get(k) != v
    }
    if diff:
        parts = ", ".join(f"{k}: {a!r} in the file, {b!r} here" for k, (a, b) in diff.items())
        raise ValueError(f"{key}={path} was fitted with other scores ({parts}); use the same scorer or refit")
    return ConformalRetriever().load_state_dict(obj["conformal"])
