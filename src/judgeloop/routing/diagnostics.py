"""Diagnostics of a routing confidence, as the verbalized-confidence routing account reports them.

Three questions about the probe's confidence ``c`` (NaN = none, left out and counted):

* is it **calibrated**? The expected calibration error of ``c`` against the closed-book answer being
  correct (token F1 above ``correct_min_f1``): :func:`judgeloop.calibration.metrics.ece`, equal-width bins;
* does it **rank answers by quality**? Spearman's rho of ``c`` with the closed-book answer's F1;
* does it **find the questions retrieval helps**? The AUROC of the uncertainty ``1 - c`` for "retrieval
  helps" (the answer with passages has a higher F1 than the closed-book one): 0.5 is chance, and this is
  the ranking a threshold router relies on.

Each comes with a percentile bootstrap 95% interval over questions (:func:`judgeloop.intervals.bootstrap_intervals`);
a statistic that is undefined on the data (one class, a constant confidence, fewer than two questions) is
``None`` with the reason, never a number.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

__all__ = ["confidence_diagnostics"]


def _ece(c: np.ndarray, correct: np.ndarray, n_bins: int) -> float:
    from judgeloop.calibration.metrics import ece

    return float(ece(c, correct.astype(float), n_bins=n_bins, strategy="uniform"))


def _spearman(c: np.ndarray, f1: np.ndarray) -> float:
    from scipy.stats import spearmanr

    if c.size < 2 or np.ptp(c) == 0 or np.ptp(f1) == 0:
        return math.nan
    return float(spearmanr(c, f1).statistic)


def _auroc(score: np.ndarray, positive: np.ndarray) -> float:
    from judgeloop.retrieval.gate import auc

    if positive.all() or not positive.any():
        return math.nan
    return float(auc(score, positive))


def confidence_diagnostics(
    confidence: np.ndarray,
    f1_closed: np.ndarray,
    f1_rag: np.ndarray,
    correct_min_f1: float = 0.5,
    n_bins: int = 10,
    num_bootstrap: int = 2000,
    seed: int = 0,
) -> dict[str, Any]:
    """ECE, Spearman rho and the AUROC of ``1 - confidence`` for "retrieval helps" (module docstring).

    Args:
        confidence: ``(Q,)`` the probe's confidence in [0, 1], NaN where it gave none.
        f1_closed, f1_rag: ``(Q,)`` token F1 of the closed-book and the retrieval-augmented answer.
        correct_min_f1: a closed-book answer is correct when its F1 is above this.
        n_bins: equal-width bins of the ECE.

    Returns:
        ``{"n", "missing", "correct_rate", "retrieval_helps_rate", "ece", "spearman_rho",
        "auroc_uncertainty_retrieval_helps"}``; each statistic ``{"value", "ci95", "why_none"}``.
    """
    c = np.asarray(confidence, dtype=np.float64)
    fc, fr = np.asarray(f1_closed, dtype=np.float64), np.asarray(f1_rag, dtype=np.float64)
    if not (c.shape == fc.shape == fr.shape) or c.ndim != 1:
        raise ValueError(
            f"confidence {c.shape}, f1_closed {fc.shape} and f1_rag {fr.shape} must be equal 1-D"
        )
    ok = np.isfinite(c)
    if ok.any() and (c[ok].min() < 0 or c[ok].max() > 1):
        raise ValueError(f"confidence must lie in [0, 1]; got [{c[ok].min():.3g}, {c[ok].max():.3g}]")
    c, fc, fr = c[ok], fc[ok], fr[ok]
    correct, helps = fc > correct_min_f1, fr > fc
    n = int(c.size)

    def stats(idx: np.ndarray) -> list[float]:
        return [
            _ece(c[idx], correct[idx], n_bins) if idx.size else math.nan,
            _spearman(c[idx], fc[idx]),
            _auroc(1.0 - c[idx], helps[idx]),
        ]

    point = stats(np.arange(n))
    why = [
        "no question has a confidence" if n == 0 else "",
        "no question has a confidence"
        if n == 0
        else "fewer than two questions, or the confidence or the closed-book F1 is constant"
        if math.isnan(point[1])
        else "",
        "no question has a confidence"
        if n == 0
        else "retrieval helps on every question or on none"
        if math.isnan(point[2])
        else "",
    ]
    intervals: list[tuple[float, float]] = [(math.nan, math.nan)] * 3
    if n >= 2:
        from judgeloop.intervals import bootstrap_intervals

        intervals = bootstrap_intervals(stats, n, num_bootstrap, seed=seed)

    def entry(k: int) -> dict[str, Any]:
        if why[k]:
            return {"value": None, "ci95": [None, None], "why_none": why[k]}
        lo, hi = intervals[k]
        ci = [None if math.isnan(lo) else float(lo), None if math.isnan(hi) else float(hi)]
        return {"value": float(point[k]), "ci95": ci, "why_none": ""}

    return {
        "n": n,
        "missing": int((~ok).sum()),
        "correct_min_f1": correct_min_f1,
        "correct_rate": float(correct.mean()) if n else None,
        "retrieval_helps_rate": float(helps.mean()) if n else None,
        "ece": entry(0),
        "spearman_rho": entry(1),
        "auroc_uncertainty_retrieval_helps": entry(2),
    }
