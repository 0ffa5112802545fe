"""Abstention for the answer step: a calibrated answer confidence, a refusal threshold chosen on a
risk-coverage curve, and the reason for each refusal.

*Selective prediction* (Geifman & El-Yaniv 2017, "Selective classification for deep neural networks"):
a system that may refuse is judged by its **coverage** (share of questions answered) and its **selective
risk** (mean loss over the answered ones). Ranking the questions by confidence and answering the top
``c`` of them traces the *risk-coverage curve*; its area (AURC; Geifman, Uziel & El-Yaniv 2019) is the
mean of the selective risk over every coverage point, lower is better. Here the loss of an answer is
``1 - F1`` (SQuAD token F1; any answer to an unanswerable question has F1 0), so the selective F1 at
coverage ``c`` is ``1 -`` the curve's risk there.

* :class:`AnswerConfidence`: the answer's expected quality by logistic regression on named features (the
  reader's answer log-probability, its yes-probability that the passages answer the question, the top
  retrieval similarity...), fitted on the calibration split to 0/1 labels (P(correct); with one feature,
  Platt scaling with an intercept, Platt 1999) or to soft targets in [0, 1] such as the answer's F1 (then
  the confidence estimates E[F1], the quantity the selective risk averages; cross-entropy with soft
  targets is a proper scoring rule for a mean in [0, 1]).
* :class:`RiskThreshold`: the lowest confidence threshold whose selective risk on the calibration split
  stays at or below ``target_risk`` (the most coverage that meets the target), frozen for test.
* :func:`refusal_reasons`: the first of the pipeline's flags that holds for a refused question, in a
  fixed order (``REASONS``), or ``low_confidence`` when none does.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

__all__ = [
    "REASONS",
    "AnswerConfidence",
    "RiskThreshold",
    "aurc",
    "refusal_reasons",
    "risk_coverage",
    "selective_risk",
]

# The refusal reasons in the order they are checked: what the retriever saw, then the conformal set,
# then the evidence against itself, then the reader; ``low_confidence`` is what is left.
REASONS = (
    "no_passage_above_gate",
    "conformal_set_empty",
    "passages_disagree",
    "reader_predicts_unanswerable",
    "low_confidence",
)


def _order(confidence: np.ndarray) -> np.ndarray:
    """Most confident first; ties keep index order; NaN confidence last (never answered before a number)."""
    c = np.asarray(confidence, dtype=np.float64)
    key = np.where(np.isnan(c), -np.inf, c)
    return np.lexsort((np.arange(c.size), -key))


def risk_coverage(confidence: np.ndarray, loss: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The risk-coverage curve: answering the ``i`` most confident questions, ``i = 1..N``.

    Returns ``(coverage (N,), risk (N,))``: ``coverage[i-1] = i / N`` and ``risk[i-1]`` the mean loss of
    those ``i``. Ties in confidence are broken by index (a threshold cannot split them, but the points in
    between are what a random tie-break would give in expectation only approximately; see :func:`aurc`).
    """
    c = np.asarray(confidence, dtype=np.float64)
    x = np.asarray(loss, dtype=np.float64)
    if c.shape != x.shape or c.ndim != 1 or c.size == 0:
        raise ValueError(f"confidence {c.shape} and loss {x.shape} must be equal non-empty 1-D arrays")
    if not np.isfinite(x).all():
        raise ValueError("loss has NaN or infinite values; score every question before the curve")
    ordered = x[_order(c)]
    n = np.arange(1, c.size + 1)
    return n / c.size, np.cumsum(ordered) / n


def aurc(confidence: np.ndarray, loss: np.ndarray) -> float:
    """Area under the risk-coverage curve: the mean selective risk over the ``N`` coverage points."""
    _, risk = risk_coverage(confidence, loss)
    return float(risk.mean())


def selective_risk(confidence: np.ndarray, loss: np.ndarray, coverage: float) -> float:
    """Mean loss of the ``ceil(coverage * N)`` most confident questions (at least one)."""
    if not 0.0 < coverage <= 1.0:
        raise ValueError(f"coverage={coverage} must be in (0, 1]")
    c = np.asarray(confidence, dtype=np.float64)
    m = max(1, math.ceil(coverage * c.size - 1e-9))
    return float(np.asarray(loss, dtype=np.float64)[_order(c)[:m]].mean())


class AnswerConfidence:
    """P(the answer is correct) from named features by L2-light logistic regression with an intercept.

    Args:
        features: the feature names, in the column order :meth:`fit` and :meth:`predict` take them.
        l2: a small ridge penalty on every weight (:func:`judgeloop.calibration.calibrators.fit_logistic`),
            so a feature that separates the calibration labels keeps a finite weight.

    Learned attributes: ``w_`` (one weight per feature), ``b_`` (intercept), ``mean_`` / ``scale_`` (the
    standardization fitted on calibration data), ``n_fit_``.
    """

    def __init__(self, features: Sequence[str], l2: float = 1e-3, min_points: int = 10) -> None:
        if not features:
            raise ValueError("AnswerConfidence needs at least one feature name")
        self.features = list(features)
        self.l2 = l2
        self.min_points = min_points

    def _matrix(self, x: Mapping[str, np.ndarray] | np.ndarray) -> np.ndarray:
        if isinstance(x, Mapping):
            missing = [f for f in self.features if f not in x]
            if missing:
                raise ValueError(f"confidence features {missing} are missing; got {sorted(x)}")
            return np.stack([np.asarray(x[f], dtype=np.float64) for f in self.features], axis=1)
        return np.asarray(x, dtype=np.float64).reshape(len(x), -1)

    def fit(self, x: Mapping[str, np.ndarray] | np.ndarray, target: np.ndarray) -> AnswerConfidence:
        """Fit on calibration features and targets in [0, 1] (0/1 correctness, or a soft score like F1)."""
        from judgeloop.calibration.calibrators import CalibrationError, fit_logistic

        X = self._matrix(x)
        y = np.asarray(target, dtype=np.float64)
        if y.size and (np.nanmin(y) < 0 or np.nanmax(y) > 1):
            raise ValueError(
                f"confidence targets must lie in [0, 1]; got [{np.nanmin(y):.3g}, {np.nanmax(y):.3g}]"
            )
        if X.shape[0] != y.size:
            raise ValueError(f"{X.shape[0]} feature rows for {y.size} labels")
        if not np.isfinite(X).all():
            raise CalibrationError(
                f"answer confidence: {int((~np.isfinite(X)).any(axis=1).sum())} calibration rows have NaN or "
                "infinite features; score every question before fitting"
            )
        if y.size < self.min_points or len(np.unique(y)) < 2:
            raise CalibrationError(
                f"answer confidence: the calibration split has {y.size} questions whose targets are all "
                f"{y[0] if y.size else 'missing'} (sum {y.sum():.3g}); need >= {self.min_points} questions and "
                "targets that differ to fit (a reader that is never right cannot be calibrated)"
            )
        self.mean_ = X.mean(axis=0)
        self.scale_ = np.where(X.std(axis=0) > 0, X.std(axis=0), 1.0)
        Z = np.concatenate([(X - self.mean_) / self.scale_, np.ones((X.shape[0], 1))], axis=1)
        w = fit_logistic(Z, y, l2=self.l2)
        self.w_, self.b_ = w[:-1].copy(), float(w[-1])
        self.n_fit_ = int(y.size)
        return self

    def predict(self, x: Mapping[str, np.ndarray] | np.ndarray) -> np.ndarray:
        """``(N,)`` the calibrated confidence (P(correct), or E[target] for soft targets); NaN where a
        feature is NaN."""
        from scipy.special import expit

        if not hasattr(self, "w_"):
            raise RuntimeError("AnswerConfidence is not fitted; call fit(...) on the calibration split first")
        X = self._matrix(x)
        with np.errstate(invalid="ignore"):
            return np.asarray(expit(((X - self.mean_) / self.scale_) @ self.w_ + self.b_))

    def state_dict(self) -> dict[str, Any]:
        fitted = hasattr(self, "w_")
        return {
            "features": self.features,
            "l2": self.l2,
            "min_points": self.min_points,
            "w_": self.w_.tolist() if fitted else None,
            "b_": self.b_ if fitted else None,
            "mean_": self.mean_.tolist() if fitted else None,
            "scale_": self.scale_.tolist() if fitted else None,
            "n_fit_": getattr(self, "n_fit_", 0),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> AnswerConfidence:
        self.features, self.l2, self.min_points = list(state["features"]), state["l2"], state["min_points"]
        if state["w_"] is not None:
            self.w_, self.b_ = np.asarray(state["w_"], dtype=float), float(state["b_"])
            self.mean_, self.scale_ = np.asarray(state["mean_"]), np.asarray(state["scale_"])
            self.n_fit_ = int(state["n_fit_"])
        return self


class RiskThreshold:
    """Answer when the confidence is at or above ``threshold_``, chosen on calibration data as the lowest
    threshold whose selective risk is at most ``target_risk`` (the largest coverage that meets it).

    Args:
        target_risk: the selective risk (mean ``1 - F1`` of the answered questions) to meet, in (0, 1).

    Learned attributes: ``threshold_`` (``+inf``: no threshold meets the target, refuse everything),
    ``coverage_`` and ``risk_`` on the calibration split, ``met_`` (whether the target was met).
    """

    def __init__(self, target_risk: float) -> None:
        if not 0.0 < target_risk < 1.0:
            raise ValueError(
                f"target_risk={target_risk} must be in (0, 1): the mean 1 - F1 allowed on answered questions"
            )
        self.target_risk = target_risk

    def fit(self, confidence: np.ndarray, loss: np.ndarray) -> RiskThreshold:
        c = np.asarray(confidence, dtype=np.float64)
        x = np.asarray(loss, dtype=np.float64)
        ok = np.isfinite(c)
        if not ok.any():
            raise ValueError("no calibration question has a finite confidence; cannot choose a threshold")
        # candidate thresholds: every distinct confidence; answering {c >= t} keeps ties together
        best: tuple[float, float, float] | None = None  # (coverage, risk, threshold)
        for t in np.unique(c[ok]):
            answered = ok & (c >= t)
            risk = float(x[answered].mean())
            if risk <= self.target_risk + 1e-12:
                cov = float(answered.mean())
                if best is None or cov > best[0]:
                    best = (cov, risk, float(t))
        self.met_ = best is not None
        if best is None:
            self.threshold_, self.coverage_, self.risk_ = math.inf, 0.0, math.nan
        else:
            self.coverage_, self.risk_, self.threshold_ = best
        return self

    def predict(self, confidence: np.ndarray) -> np.ndarray:
        """``(N,)`` bool: answer (NaN confidence never answers)."""
        if not hasattr(self, "threshold_"):
            raise RuntimeError("RiskThreshold is not fitted; call fit(...) on the calibration split first")
        return np.asarray(confidence, dtype=np.float64) >= self.threshold_

    def state_dict(self) -> dict[str, Any]:
        return {
            "target_risk": self.target_risk,
            "threshold_": getattr(self, "threshold_", None),
            "coverage_": getattr(self, "coverage_", None),
            "risk_": getattr(self, "risk_", None),
            "met_": getattr(self, "met_", None),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> RiskThreshold:
        self.target_risk = float(state["target_risk"])
        if state["threshold_"] is not None:
            self.threshold_ = float(state["threshold_"])
            self.coverage_, self.risk_, self.met_ = state["coverage_"], state["risk_"], state["met_"]
        elif state.get("met_") is False:  # JSON wrote the infinite threshold as null
            self.threshold_, self.coverage_, self.risk_, self.met_ = math.inf, 0.0, math.nan, False
        return self


def refusal_reasons(flags: Mapping[str, np.ndarray], refused: np.ndarray) -> list[str | None]:
    """Per question, the first reason in :data:`REASONS` whose flag holds, for refused questions (``None``
    for answered ones); ``low_confidence`` when no flag holds. ``flags`` maps each reason but the last to a
    ``(N,)`` bool array."""
    r = np.asarray(refused, dtype=bool)
    missing = [k for k in REASONS[:-1] if k not in flags]
    if missing:
        raise ValueError(f"refusal flags {missing} are missing; pass all of {list(REASONS[:-1])}")
    out: list[str | None] = []
    for i in range(r.size):
        if not r[i]:
            out.append(None)
            continue
        out.append(next((k for k in REASONS[:-1] if bool(flags[k][i])), REASONS[-1]))
    return out
