"""Paired statistics for the ablation: a two-level bootstrap over (seed, article) and the premise check.

Every arm of an ablation runs on the same test articles with the same seeds, so arms are compared on
the *paired* difference ``D[s, i] = metric(arm, seed s, article i) - metric(baseline, s, i)``, which
removes the between-article variance that dominates an arm's own mean.

:func:`paired_bootstrap` resamples at both levels the data were drawn at: seeds with replacement, then,
within each drawn seed, articles with replacement; the statistic is the mean of ``D`` over the drawn
cells. It reports the point estimate (the mean over all cells), a percentile 95% interval, the
bootstrap standard error and the minimum detectable difference ``mdd = 2.8 * se`` (80% power at 5%
two-sided for a normal statistic: 1.96 + 0.84), so a null result reads "no effect larger than mdd".

With very few seeds (2-3) the seed level is resampled from 3-10 distinct combinations and its variance
is poorly estimated; the report says so next to the interval.

:func:`paired_bootstrap_test` adds the bootstrap p-value of the same replicates, and :func:`holm` adjusts a
family of them (the routing study's comparisons of every policy with never / always / random-matched).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from judgeloop.loop.metrics_table import keys, shown_in

# Power of the minimum detectable difference: z(0.975) + z(0.80) = 1.960 + 0.842.
MDD_FACTOR = 2.8


@dataclass
class PairedDelta:
    """A paired difference with its bootstrap interval; ``n`` counts the (seed, article) cells used."""

    delta: float | None
    ci95: list[float | None]
    se: float | None
    mdd: float | None
    n: int
    n_seeds: int

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def excludes_zero(self) -> bool:
        lo, hi = self.ci95
        return lo is not None and hi is not None and (lo > 0 or hi < 0)


def paired_matrix(
    rows_a: Mapping[int, Mapping[str, float | None]],
    rows_b: Mapping[int, Mapping[str, float | None]],
) -> np.ndarray:
    """``D[s, i] = a[s][i] - b[s][i]`` over the seeds both have, articles in sorted id order; NaN where
    either side is missing or non-finite. ``rows_x[seed][article_id] = value``."""
    return aligned_differences(rows_b, rows_a)[0]


def paired_bootstrap(diffs: np.ndarray, n_boot: int = 4000, seed: int = 0) -> PairedDelta:
    """Two-level bootstrap of the mean of ``diffs`` (seeds x articles, NaN = missing cell).

    Each replicate draws ``S`` seeds with replacement and, for each drawn seed, that seed's articles
    with replacement (missing cells are skipped by the mean). Deterministic for a given ``seed``.
    A 1-D ``diffs`` is one seed: the ordinary paired bootstrap over independent units (questions).
    """
    return paired_bootstrap_test(diffs, n_boot, seed)[0]


def paired_bootstrap_test(
    diffs: np.ndarray, n_boot: int = 4000, seed: int = 0
) -> tuple[PairedDelta, float | None]:
    """:func:`paired_bootstrap` and its two-sided bootstrap p-value for "the mean difference is 0", from
    the same replicates: ``p = min(1, 2 * min(1 + #{rep <= 0}, 1 + #{rep >= 0}) / (B + 1))``, the
    smallest level at which the percentile interval would reach 0 (Efron & Tibshirani 1993, sec. 16.4;
    the +1s keep it above 0). ``None`` where there is no interval (fewer than two cells)."""
    d = np.asarray(diffs, dtype=float)
    if d.ndim == 1:
        d = d[None, :]
    keep = np.isfinite(d).any(axis=1)
    d = d[keep]
    n = int(np.isfinite(d).sum())
    if n == 0:
        return PairedDelta(None, [None, None], None, None, 0, 0), None
    S, N = d.shape
    point = float(np.nanmean(d))
    if n < 2:
        return PairedDelta(point, [None, None], None, None, n, S), None
    rng = np.random.default_rng(seed)
    stats = np.empty(n_boot)
    chunk = max(1, 2_000_000 // max(S * N, 1))  # bound memory: replicates per vectorized block
    for start in range(0, n_boot, chunk):
        b = min(chunk, n_boot - start)
        s_idx = rng.integers(0, S, size=(b, S))  # (b, S) drawn seeds
        a_idx = rng.integers(0, N, size=(b, S, N))  # (b, S, N) drawn articles within each drawn seed
        cells = d[s_idx[:, :, None], a_idx]  # (b, S, N)
        ok = np.isfinite(cells)
        total = np.where(ok, cells, 0.0).sum(axis=(1, 2))
        count = ok.sum(axis=(1, 2))
        with np.errstate(invalid="ignore", divide="ignore"):
            stats[start : start + b] = total / count
    stats = stats[np.isfinite(stats)]
    lo, hi = np.percentile(stats, [2.5, 97.5])
    se = float(stats.std(ddof=1))
    below, above = int((stats <= 0).sum()), int((stats >= 0).sum())
    p = min(1.0, 2.0 * (1 + min(below, above)) / (stats.size + 1))
    return PairedDelta(point, [float(lo), float(hi)], se, MDD_FACTOR * se, n, S), p


def holm(pvalues: Sequence[float | None]) -> list[float | None]:
    """Holm's step-down adjustment of a family of p-values (Holm 1979): sorted ascending,
    ``adj_(i) = max_{j <= i} min(1, (m - j + 1) * p_(j))`` for ``i = 1..m``; rejecting where ``adj <= alpha``
    keeps the family-wise error rate at ``alpha``. ``None`` entries (no test) stay ``None`` and do not count
    in ``m``. Returned in the input's order."""
    idx = [i for i, p in enumerate(pvalues) if p is not None]
    for i in idx:
        p = pvalues[i]
        if not 0.0 <= p <= 1.0:  # type: ignore[operator]
            raise ValueError(f"p-value {p} at position {i} is not in [0, 1]")
    m = len(idx)
    out: list[float | None] = [None] * len(pvalues)
    running = 0.0
    for rank, i in enumerate(sorted(idx, key=lambda k: pvalues[k])):  # type: ignore[arg-type,return-value]
        running = max(running, min(1.0, (m - rank) * float(pvalues[i])))  # type: ignore[arg-type]
        out[i] = running
    return out


# --- the premise check ------------------------------------------------------------------------------

#: the premise check's metrics and the words for a drift in each (the metrics table's ``premise`` column)
PREMISE_METRICS = keys("premise")
STYLE_WORDS = {m.name: m.style_word for m in shown_in("premise")}


def premise_check(
    start: Mapping[int, Mapping[str, Mapping[str, float | None]]],
    final: Mapping[int, Mapping[str, Mapping[str, float | None]]],
    style_metric: str,
    style_direction: str,
    n_boot: int = 4000,
    seed: int = 0,
    metrics: Sequence[str] = PREMISE_METRICS,
) -> dict[str, Any]:
    """Did the raw arm drift toward the judge's style? Paired change step 0 -> final per metric.

    ``start[seed][article_id][metric]`` / ``final[...]``: per-article values. ``holds`` is true when the
    95% interval of ``style_metric`` excludes 0 in ``style_direction`` (``increase`` or ``decrease``).
    """
    out: dict[str, Any] = {}
    for m in metrics:
        a = {s: {i: r.get(m) for i, r in final[s].items()} for s in final}
        b = {s: {i: r.get(m) for i, r in start[s].items()} for s in start}
        out[m] = paired_bootstrap(paired_matrix(a, b), n_boot, seed).as_dict()
    style = out.get(style_metric)
    holds = False
    if style is not None and style["ci95"][0] is not None:
        lo, hi = style["ci95"]
        holds = bool(lo > 0) if style_direction == "increase" else bool(hi < 0)
    return {
        "holds": holds,
        "style_metric": style_metric,
        "style_direction": style_direction,
        "metrics": out,
        "sentence": premise_sentence(holds, style_metric, style_direction, out.get(style_metric)),
    }


def _ci(d: Mapping[str, Any], digits: int = 3) -> str:
    if d is None or d["delta"] is None:
        return "n/a"
    if d["ci95"][0] is None:
        return f"{d['delta']:+.{digits}f}"
    return f"{d['delta']:+.{digits}f} [{d['ci95'][0]:+.{digits}f}, {d['ci95'][1]:+.{digits}f}]"


def premise_sentence(holds: bool, metric: str, direction: str, delta: Mapping[str, Any] | None) -> str:
    """The report's first sentence: whether the raw judge moved the policy toward its style."""
    style = STYLE_WORDS.get(metric, metric)
    toward = "toward" if direction == "increase" else "away from"
    if delta is None or delta["delta"] is None:
        return f"The premise could not be checked: no per-article values of {metric} in the raw arm."
    if holds:
        return f"The raw judge moved the policy {toward} {style}: {metric} {_ci(delta)} (step 0 -> final, paired)."
    mdd = f"; the smallest drift this run could detect is {delta['mdd']:.3f}" if delta.get("mdd") else ""
    return (
        f"No measurable drift {toward} {style} under the raw judge ({metric} {_ci(delta)}, step 0 -> final, "
        f"paired{mdd}); this ablation cannot show a correction."
    )


# --- the recovered fraction -----------------------------------------------------------------------------


def aligned_differences(
    base: Mapping[int, Mapping[str, float | None]], *arms: Mapping[int, Mapping[str, float | None]]
) -> list[np.ndarray]:
    """``arm - base`` for every arm, on one grid: the seeds all of them have, articles in sorted id order
    (NaN where a cell is missing or non-finite), so a statistic of several differences resamples the
    same (seed, article) cells for each."""
    seeds = sorted(set(base).intersection(*arms))
    ids = sorted({i for s in seeds for rows in (base, *arms) for i in rows[s]})
    out = []
    for arm in arms:
        d = np.full((len(seeds), len(ids)), np.nan)
        for r, s in enumerate(seeds):
            for c, i in enumerate(ids):
                x, y = arm[s].get(i), base[s].get(i)
                if x is not None and y is not None:
                    d[r, c] = float(x) - float(y)
        d[~np.isfinite(d)] = np.nan
        out.append(d)
    return out


def recovered_fraction(
    arm_gain: np.ndarray, oracle_gain: np.ndarray, n_boot: int = 4000, seed: int = 0
) -> dict[str, Any]:
    """The fraction of the oracle's gain over the baseline that an arm recovers,
    ``mean(arm - base) / mean(oracle - base)``, on the (seed, article) cells both differences have, with
    a percentile 95% interval from the same two-level bootstrap as :func:`paired_bootstrap` (numerator
    and denominator drawn from the same cells in each replicate).

    The ratio means something only where the oracle's gain is clearly positive: ``defined`` is false
    (and the fraction and its interval null) unless the oracle's gain interval lies above 0; its gain is
    reported either way. Replicates whose oracle gain is not positive are dropped and counted."""
    num, den = np.asarray(arm_gain, dtype=float), np.asarray(oracle_gain, dtype=float)
    both = np.isfinite(num) & np.isfinite(den)
    num, den = np.where(both, num, np.nan), np.where(both, den, np.nan)
    keep = both.any(axis=1)
    num, den = num[keep], den[keep]
    oracle = paired_bootstrap(den, n_boot, seed)
    out: dict[str, Any] = {
        "fraction": None,
        "ci95": [None, None],
        "defined": False,
        "oracle_gain": oracle.as_dict(),
        "arm_gain": paired_bootstrap(num, n_boot, seed).as_dict(),
        "n": int(both.sum()),
        "replicates_dropped": 0,
    }
    if not oracle.excludes_zero or (oracle.delta or 0.0) <= 0:
        return out
    S, N = num.shape
    rng = np.random.default_rng(seed)
    ratios = np.empty(n_boot)
    chunk = max(1, 2_000_000 // max(S * N, 1))
    for start in range(0, n_boot, chunk):
        b = min(chunk, n_boot - start)
        s_idx = rng.integers(0, S, size=(b, S))
        a_idx = rng.integers(0, N, size=(b, S, N))
        cn, cd = num[s_idx[:, :, None], a_idx], den[s_idx[:, :, None], a_idx]
        ok = np.isfinite(cn)
        with np.errstate(invalid="ignore", divide="ignore"):
            mean_n = np.where(ok, cn, 0.0).sum(axis=(1, 2)) / ok.sum(axis=(1, 2))
            mean_d = np.where(ok, cd, 0.0).sum(axis=(1, 2)) / ok.sum(axis=(1, 2))
            ratios[start : start + b] = np.where(mean_d > 0, mean_n / mean_d, np.nan)
    good = ratios[np.isfinite(ratios)]
    lo, hi = np.percentile(good, [2.5, 97.5])
    out.update(
        fraction=float(np.nanmean(num) / np.nanmean(den)),
        ci95=[float(lo), float(hi)],
        defined=True,
        replicates_dropped=int(n_boot - good.size),
    )
    return out
