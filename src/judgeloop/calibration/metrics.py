"""Calibration metrics for binary preference probabilities.

``p`` is the predicted probability that ``a`` is better, ``y`` the 0/1 label. ECE follows
Naeini et al. (2015) / Guo et al. (2017): the bin-weighted mean |accuracy - confidence| gap,
here on the positive-class probability with equal-width (``uniform``) or equal-mass (``quantile``) bins.
"""

from __future__ import annotations

import numpy as np

_EPS = 1e-12


def _check(p: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    p = np.asarray(p, dtype=float).ravel()
    y = np.asarray(y, dtype=float).ravel()
    if p.shape != y.shape:
        raise ValueError(f"probabilities and labels differ in length ({p.size} vs {y.size})")
    if p.size == 0:
        raise ValueError("no predictions to evaluate (0 pairs); check that the evaluation split is not empty")
    if not np.all(np.isfinite(p)) or p.min() < 0 or p.max() > 1:
        raise ValueError("probabilities must be finite and within [0, 1]")
    if not np.all((y == 0) | (y == 1)):
        raise ValueError("labels must be 0 or 1")
    return p, y


def bin_edges(p: np.ndarray, n_bins: int, strategy: str) -> np.ndarray:
    """Edges of ``n_bins`` equal-width (``equal_mass=False``) or equal-mass bins over [0, 1]."""
    if n_bins < 1:
        raise ValueError(f"n_bins must be >= 1, got {n_bins}")
    if strategy == "uniform":
        return np.linspace(0.0, 1.0, n_bins + 1)
    if strategy == "quantile":
        edges = np.quantile(p, np.linspace(0.0, 1.0, n_bins + 1))
        edges[0], edges[-1] = 0.0, 1.0
        return edges
    raise ValueError(f"binning strategy must be 'uniform' or 'quantile', got {strategy!r}")


def reliability_bins(
    p: np.ndarray, y: np.ndarray, n_bins: int = 15, strategy: str = "uniform"
) -> dict[str, np.ndarray]:
    """Per-bin count, mean confidence and observed frequency (empty bins have count 0, nan means)."""
    p, y = _check(p, y)
    edges = bin_edges(p, n_bins, strategy)
    # Bin i holds (edges[i], edges[i+1]], the first bin also holds its left edge.
    idx = np.clip(np.searchsorted(edges, p, side="left") - 1, 0, len(edges) - 2)
    nb = len(edges) - 1
    count = np.bincount(idx, minlength=nb).astype(float)
    sum_p = np.bincount(idx, weights=p, minlength=nb)
    sum_y = np.bincount(idx, weights=y, minlength=nb)
    with np.errstate(invalid="ignore", divide="ignore"):
        conf = sum_p / count
        freq = sum_y / count
    return {"edges": edges, "count": count, "confidence": conf, "frequency": freq}


def ece(p: np.ndarray, y: np.ndarray, n_bins: int = 15, strategy: str = "uniform") -> float:
    """Expected calibration error: sum_b (n_b / n) * |freq_b - conf_b|."""
    bins = reliability_bins(p, y, n_bins, strategy)
    n = bins["count"].sum()
    ok = bins["count"] > 0
    return float(np.sum(bins["count"][ok] / n * np.abs(bins["frequency"][ok] - bins["confidence"][ok])))


def mce(p: np.ndarray, y: np.ndarray, n_bins: int = 15, strategy: str = "uniform") -> float:
    """Maximum calibration error over non-empty bins."""
    bins = reliability_bins(p, y, n_bins, strategy)
    ok = bins["count"] > 0
    return float(np.max(np.abs(bins["frequency"][ok] - bins["confidence"][ok])))


def brier(p: np.ndarray, y: np.ndarray) -> float:
    """Brier score: mean squared error of the probabilities against the 0/1 labels."""
    p, y = _check(p, y)
    return float(np.mean((p - y) ** 2))


def nll(p: np.ndarray, y: np.ndarray) -> float:
    """Mean negative log-likelihood (probabilities clipped to [1e-12, 1 - 1e-12])."""
    p, y = _check(p, y)
    p = np.clip(p, _EPS, 1 - _EPS)
    return float(-np.mean(y * np.log(p) + (1 - y) * np.log(1 - p)))


def accuracy(p: np.ndarray, y: np.ndarray) -> float:
    """Decision accuracy at 0.5; an exact 0.5 (no preference) earns half credit."""
    p, y = _check(p, y)
    credit = np.where(p == 0.5, 0.5, ((p > 0.5) == (y == 1)).astype(float))
    return float(np.mean(credit))


def auc(p: np.ndarray, y: np.ndarray) -> float:
    """ROC AUC (nan when only one class is present)."""
    from sklearn.metrics import roc_auc_score

    p, y = _check(p, y)
    if len(np.unique(y)) < 2:
        return float("nan")
    return float(roc_auc_score(y, p))


def all_metrics(p: np.ndarray, y: np.ndarray, n_bins: int = 15) -> dict[str, float]:
    """ECE (both binnings), MCE, Brier, NLL, AUC and accuracy of probabilities against labels."""
    return {
        "ece": ece(p, y, n_bins, "uniform"),
        "ece_equal_mass": ece(p, y, n_bins, "quantile"),
        "mce": mce(p, y, n_bins, "uniform"),
        "brier": brier(p, y),
        "nll": nll(p, y),
        "auc": auc(p, y),
        "accuracy": accuracy(p, y),
        "n": int(np.asarray(p).size),
    }
