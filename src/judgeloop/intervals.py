"""Confidence intervals: one Wilson and one Clopper-Pearson interval for a proportion (RAFT answer
accuracy, conformal base rates), and one percentile bootstrap of a mean over independent units (queries,
questions: the gate's escalation deltas, selective F1, the evidence-mark deltas). The ablation's two-level
(seed, article) bootstrap is :func:`judgeloop.studies.stats.paired_bootstrap`."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
from scipy.stats import beta, norm


def wilson_interval(k: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson score interval for a binomial proportion (Wilson 1927; Brown, Cai & DasGupta 2001, eq. 4)."""
    if n <= 0:
        return (0.0, 1.0)
    z = float(norm.ppf(0.5 + confidence / 2.0))
    p = k / n
    denom = 1.0 + z * z / n
    center = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return (max(0.0, center - half), min(1.0, center + half))


def clopper_pearson_interval(k: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Exact (Clopper-Pearson 1934) interval from beta quantiles."""
    if n <= 0:
        return (0.0, 1.0)
    a = 1.0 - confidence
    low = 0.0 if k == 0 else float(beta.ppf(a / 2, k, n - k + 1))
    high = 1.0 if k == n else float(beta.ppf(1 - a / 2, k + 1, n - k))
    return (low, high)


def bootstrap_intervals(
    statistics: Callable[[np.ndarray], Sequence[float]],
    n: int,
    num_resamples: int = 1000,
    confidence: float = 0.95,
    seed: int = 0,
) -> list[tuple[float, float]]:
    """:func:`bootstrap_interval` of several statistics on the same resamples: each replicate passes
    ``idx`` once and ``statistics(idx)`` returns one value per statistic (a difference of two of them on
    the same replicates is then a paired interval too). One interval per statistic, in order."""
    if num_resamples < 1:
        raise ValueError(f"num_resamples={num_resamples} must be >= 1")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence={confidence} must be in (0, 1); e.g. 0.95")
    if n < 1:
        return [(math.nan, math.nan)] * len(statistics(np.zeros(0, dtype=np.int64)))
    rng = np.random.default_rng(seed)
    reps = np.asarray([statistics(rng.integers(0, n, n)) for _ in range(num_resamples)], dtype=np.float64)
    out = []
    for column in reps.T:
        column = column[np.isfinite(column)]
        if column.size == 0:
            out.append((math.nan, math.nan))
            continue
        lo, hi = np.quantile(column, [(1 - confidence) / 2, (1 + confidence) / 2])
        out.append((float(lo), float(hi)))
    return out


def bootstrap_interval(
    statistic: Callable[[np.ndarray], float],
    n: int,
    num_resamples: int = 1000,
    confidence: float = 0.95,
    seed: int = 0,
) -> tuple[float, float]:
    """Percentile bootstrap interval (Efron & Tibshirani 1993, ch. 13) of ``statistic(idx)`` over ``n``
    independent units: each replicate passes ``idx`` ``(n,)``, the units drawn with replacement. A paired
    statistic (a difference of two systems on the same units) gets a paired interval.

    Non-finite replicates are dropped; ``(nan, nan)`` when none is left. Deterministic for a given ``seed``.
    """
    if n < 1:
        bootstrap_intervals(lambda idx: [0.0], 1, num_resamples, confidence, seed)  # the settings' checks
        return (math.nan, math.nan)
    return bootstrap_intervals(lambda idx: [statistic(idx)], n, num_resamples, confidence, seed)[0]


def bootstrap_mean_interval(
    values: Sequence[float] | np.ndarray,
    num_resamples: int = 1000,
    confidence: float = 0.95,
    seed: int = 0,
) -> tuple[float, float]:
    """:func:`bootstrap_interval` of the mean of ``values`` ``(N,)`` (NaN values dropped first); pass
    per-unit paired differences for a paired interval."""
    x = np.asarray(values, dtype=np.float64)
    x = x[np.isfinite(x)]
    return bootstrap_interval(lambda idx: float(x[idx].mean()), x.size, num_resamples, confidence, seed)
