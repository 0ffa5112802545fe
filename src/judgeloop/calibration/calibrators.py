"""Calibrators that map a judge's raw preference logit to P(a better than b).

All follow ``fit(scores, labels[, features]) -> self``, ``predict_proba(scores[, features])``,
``state_dict()`` / ``load_state_dict()`` and ``save(path)`` / ``load(path)`` (JSON).

Pairwise calibration must be antisymmetric: P(a over b) = 1 - P(b over a). With ``symmetric=True``
(the default) every calibration pair is used in both orientations, (s, y) and (-s, 1 - y), and Platt
scaling has no free intercept, so the fitted map satisfies p(-s) = 1 - p(s) by construction.
Model an intercept (``fit_intercept=True``) only to study position bias on purpose.

Caveats: calibration data must be disjoint from the data the calibrated probabilities are used
on (and from policy training articles); isotonic regression needs many points (hundreds) and
warns below ``min_points_isotonic``.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
from scipy.optimize import minimize
from scipy.special import expit

from judgeloop.calibration.features import both_orientations
from judgeloop.errors import UserError
from judgeloop.io import atomic_write_json


class CalibrationError(UserError):
    """The calibration set cannot support a fit (one class, too small, non-finite scores)."""


def _validate(scores: Any, labels: Any, min_points: int, method: str, features: Any = None) -> tuple:
    s = np.asarray(scores, dtype=float).ravel()
    y = np.asarray(labels, dtype=float).ravel()
    if s.shape != y.shape:
        raise CalibrationError(f"{method}: got {s.size} scores but {y.size} labels; they must pair up")
    bad = ~np.isfinite(s)
    if bad.any():
        raise CalibrationError(
            f"{method}: {int(bad.sum())} of {s.size} scores are NaN or infinite; drop pairs whose judge status "
            "is not 'ok'/'truncated' before fitting"
        )
    if not np.all((y == 0) | (y == 1)):
        raise CalibrationError(
            f"{method}: labels must be 0 or 1, got values {sorted(set(np.unique(y)) - {0.0, 1.0})[:5]}"
        )
    if s.size < min_points:
        raise CalibrationError(
            f"{method}: calibration set has {s.size} pairs, fewer than min_points={min_points}; "
            "use more calibration articles or lower min_points"
        )
    if len(np.unique(y)) < 2:
        raise CalibrationError(
            f"{method}: calibration set has one class only (all {int(y[0])}); need both outcomes to fit. "
            "With symmetric=True both orientations are used, so this means every pair was oriented the same way "
            "with symmetric=False; enable symmetric fitting or add pairs where b is better"
        )
    f = None
    if features is not None:
        f = np.asarray(features, dtype=float)
        if f.ndim == 1:
            f = f[:, None]
        if f.shape[0] != s.size:
            raise CalibrationError(f"{method}: features have {f.shape[0]} rows but there are {s.size} scores")
        if not np.all(np.isfinite(f)):
            raise CalibrationError(f"{method}: features contain NaN or infinite values")
    return s, y, f


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _check_value(value: Any, kind: type, where: str) -> None:
    if kind is bool and not isinstance(value, bool):
        raise CalibrationError(f"{where} must be true or false, got {_shown(value)}")
    if kind is int and not (isinstance(value, int) and not isinstance(value, bool)):
        raise CalibrationError(f"{where} must be an integer, got {_shown(value)}")
    if kind is float and not (_is_number(value) and math.isfinite(value)):
        raise CalibrationError(f"{where} must be a finite number, got {_shown(value)}")
    if kind is np.ndarray:
        flat = value
        while isinstance(flat, list) and flat and isinstance(flat[0], list):
            flat = [x for row in flat for x in (row if isinstance(row, list) else [row])]
        if not isinstance(value, list) or not all(_is_number(x) and math.isfinite(x) for x in flat):
            raise CalibrationError(f"{where} must be a list of finite numbers, got {_shown(value)}")


def check_state(state: Any, method: str, params: dict[str, type]) -> None:
    """One :class:`CalibrationError` line unless ``state`` is a ``method`` calibrator's state dict: the
    method named, the settings and exactly the parameters ``params`` of their kinds, numbers finite."""
    if not isinstance(state, dict):
        raise CalibrationError(f"calibrator state must be an object, got {type(state).__name__}")
    if state.get("method") != method:
        raise CalibrationError(f"state is for a {state.get('method')!r} calibrator, not {method!r}")
    for name, kind in (("symmetric", bool), ("min_points", int), ("n_fit_", int)):
        if name not in state:
            raise CalibrationError(f"{method} calibrator state has no '{name}'")
        _check_value(state[name], kind, f"'{name}'")
    if state["n_fit_"] < 0:
        raise CalibrationError(f"'n_fit_' must be 0 (not fitted) or more, got {state['n_fit_']}")
    got = state.get("params")
    if not isinstance(got, dict):
        raise CalibrationError(f"{method} calibrator state: 'params' must be an object, got {_shown(got)}")
    missing, extra = sorted(set(params) - set(got)), sorted(set(got) - set(params))
    if missing or extra:
        raise CalibrationError(
            f"the parameters do not match method {method!r}: "
            + "; ".join(t for t in (missing and f"missing {missing}", extra and f"unexpected {extra}") if t)
            + f" (a {method} calibrator has {sorted(params)})"
        )
    for name, kind in params.items():
        _check_value(got[name], kind, f"params.{name}")


def _symmetrize(s: np.ndarray, y: np.ndarray, f: np.ndarray | None) -> tuple:
    s2 = np.concatenate([s, -s])
    y2 = np.concatenate([y, 1 - y])
    f2 = None if f is None else both_orientations(f)  # pair features are differences, so they flip sign
    return s2, y2, f2


def fit_logistic(X: np.ndarray, t: np.ndarray, l2: float = 0.0) -> np.ndarray:
    """Minimize the cross-entropy of sigmoid(X w) against (possibly soft) targets t, plus l2 * |w|^2 / 2."""

    def loss_grad(w: np.ndarray) -> tuple[float, np.ndarray]:
        z = X @ w
        # log(1 + e^z) computed stably; loss = sum softplus(z) - t z
        loss = np.sum(np.logaddexp(0.0, z) - t * z) + 0.5 * l2 * w @ w
        grad = X.T @ (expit(z) - t) + l2 * w
        return float(loss), grad

    w0 = np.zeros(X.shape[1])
    res = minimize(loss_grad, w0, jac=True, method="L-BFGS-B", options={"maxiter": 1000, "gtol": 1e-10})
    return res.x


def _label_free_inputs(
    method: str, scores: Any, features: Any, min_points: int
) -> tuple[np.ndarray, np.ndarray]:
    """The raw logits (n,) and pair features (n, F) a label-free calibrator fits on, checked."""
    s = np.asarray(scores, dtype=float).ravel()
    if features is None:
        raise CalibrationError(f"{method}: needs pair features (length / copy-rate differences)")
    f = np.asarray(features, dtype=float)
    f = f[:, None] if f.ndim == 1 else f
    if f.shape[0] != s.size:
        raise CalibrationError(f"{method}: features have {f.shape[0]} rows but there are {s.size} scores")
    if not (np.all(np.isfinite(s)) and np.all(np.isfinite(f))):
        raise CalibrationError(f"{method}: scores or features contain NaN or infinite values")
    if s.size < max(min_points, f.shape[1] + 2):
        raise CalibrationError(
            f"{method}: {s.size} pairs, fewer than min_points={min_points}; use more calibration articles"
        )
    return s, f


def linear_style_term(s: np.ndarray, f: np.ndarray) -> tuple[np.ndarray, float]:
    """The least-squares fit ``s = f . beta + e`` (no intercept: both sides are antisymmetric) and the
    p-value of a Wald test of ``beta = 0`` on the ``n`` pairs given (not a doubled, symmetrized set)."""
    from scipy.stats import chi2

    beta, *_ = np.linalg.lstsq(f, s, rcond=None)
    resid = s - f @ beta
    sigma2 = float(resid @ resid) / (s.size - f.shape[1])
    xtx = f.T @ f
    if sigma2 <= 0 or np.linalg.matrix_rank(xtx) < f.shape[1]:
        return beta, (0.0 if sigma2 <= 0 and np.any(beta != 0) else 1.0)
    stat = float(beta @ xtx @ beta) / sigma2  # beta' (sigma^2 (X'X)^-1)^-1 beta
    return beta, float(chi2.sf(stat, f.shape[1]))


class Calibrator:
    """Base class; subclasses set ``method`` and implement ``_fit`` and ``_predict``."""

    method = "base"
    uses_features = False

    def __init__(self, symmetric: bool = True, min_points: int = 10):
        self.symmetric = symmetric
        self.min_points = min_points
        self.n_fit_: int = 0

    def fit(self, scores: Any, labels: Any, features: Any = None) -> Calibrator:
        """Fit on raw logits ``scores`` (positive = a preferred) and 0/1 ``labels`` (1 = a better).

        Raises:
            CalibrationError: one class only, fewer than ``min_points`` pairs, non-finite scores.
        """
        s, y, f = _validate(
            scores, labels, self.min_points, self.method, features if self.uses_features else None
        )
        if self.uses_features and f is None:
            raise CalibrationError(
                f"{self.method}: needs pair features (length / copy-rate differences); pass features="
            )
        if self.symmetric:
            s, y, f = _symmetrize(s, y, f)
        self.n_fit_ = int(s.size)
        self._fit(s, y, f)
        return self

    def predict_proba(self, scores: Any, features: Any = None) -> np.ndarray:
        """P(a better than b) for each raw logit (NaN in, NaN out; +-inf gives the limit of the map)."""
        if not self.n_fit_:
            raise RuntimeError(
                f"{self.method} calibrator is not fitted; call fit() or load_state_dict() first"
            )
        s = np.asarray(scores, dtype=float).ravel()
        f = None
        if self.uses_features:
            if features is None:
                raise ValueError(f"{self.method}: predict_proba needs the pair features it was fitted with")
            f = np.asarray(features, dtype=float)
            f = f[:, None] if f.ndim == 1 else f
        out = np.full(s.shape, np.nan)
        ok = ~np.isnan(s)
        if ok.any():
            with np.errstate(invalid="ignore"):  # 0 * inf in a map with a zero slope stays NaN
                out[ok] = self._predict(s[ok], None if f is None else f[ok])
        return out

    # -- persistence --------------------------------------------------------------------------
    # the fitted state and settings a subclass saves, each with the type it is read back as (an array is
    # saved as a list)
    PARAMS: ClassVar[dict[str, type]] = {}

    def _params(self) -> dict[str, Any]:
        values = {name: getattr(self, name) for name in self.PARAMS}
        return {k: v.tolist() if isinstance(v, np.ndarray) else v for k, v in values.items()}

    def _set_params(self, params: dict[str, Any]) -> None:
        for name, kind in self.PARAMS.items():
            value = params[name]
            setattr(self, name, np.asarray(value, dtype=float) if kind is np.ndarray else kind(value))

    def state_dict(self) -> dict[str, Any]:
        settings = {name: getattr(self, name) for name in ("method", "symmetric", "min_points", "n_fit_")}
        return {**settings, "params": self._params()}

    def load_state_dict(self, state: dict[str, Any]) -> Calibrator:
        """Restore a :meth:`state_dict`, checked first: the method, every setting and parameter present and
        of its kind, every number finite.

        Raises:
            CalibrationError: one line naming the first bad entry (the state is left unapplied).
        """
        check_state(state, self.method, self.PARAMS)
        self._check_params(state["params"], fitted=state["n_fit_"] > 0)
        self.symmetric = state["symmetric"]
        self.min_points = state["min_points"]
        self.n_fit_ = state["n_fit_"]
        self._set_params(state["params"])
        return self

    def _check_params(self, params: dict[str, Any], fitted: bool) -> None:
        """Checks between parameters a subclass adds (the kinds and finiteness are checked already)."""

    def save(self, path: str | Path) -> None:
        atomic_write_json(path, self.state_dict())

    def _fit(self, s: np.ndarray, y: np.ndarray, f: np.ndarray | None) -> None:
        raise NotImplementedError

    def _predict(self, s: np.ndarray, f: np.ndarray | None) -> np.ndarray:
        raise NotImplementedError


class IdentityCalibrator(Calibrator):
    """The ``raw`` arm: p = sigmoid(s). Needs no fit."""

    method = "raw"

    def __init__(self, symmetric: bool = True, min_points: int = 0):
        super().__init__(symmetric, min_points)
        self.n_fit_ = 1  # always usable

    def fit(self, scores: Any, labels: Any, features: Any = None) -> Calibrator:
        return self

    def _predict(self, s: np.ndarray, f: np.ndarray | None) -> np.ndarray:
        return expit(s)


class PlattCalibrator(Calibrator):
    """Platt scaling: p = sigmoid(a_ * s + b_) (Platt, 1999).

    Targets are Platt's smoothed labels, t+ = (N+ + 1) / (N+ + 2) and t- = 1 / (N- + 2), as in
    scikit-learn's ``_sigmoid_calibration``; ``target_smoothing=False`` fits the plain labels
    (ordinary logistic regression). ``b_`` is fixed at 0 unless ``fit_intercept``.
    """

    method = "platt"
    PARAMS: ClassVar[dict[str, type]] = {
        "a_": float,
        "b_": float,
        "fit_intercept": bool,
        "target_smoothing": bool,
    }

    def __init__(
        self,
        symmetric: bool = True,
        fit_intercept: bool = False,
        target_smoothing: bool = True,
        min_points: int = 10,
    ):
        super().__init__(symmetric, min_points)
        self.fit_intercept = fit_intercept
        self.target_smoothing = target_smoothing
        self.a_ = 1.0
        self.b_ = 0.0

    def _fit(self, s: np.ndarray, y: np.ndarray, f: np.ndarray | None) -> None:
        t = y.copy()
        if self.target_smoothing:
            n_pos, n_neg = y.sum(), (1 - y).sum()
            t = np.where(y == 1, (n_pos + 1.0) / (n_pos + 2.0), 1.0 / (n_neg + 2.0))
        X = np.stack([s, np.ones_like(s)], axis=1) if self.fit_intercept else s[:, None]
        w = fit_logistic(X, t)
        self.a_ = float(w[0])
        self.b_ = float(w[1]) if self.fit_intercept else 0.0

    def _predict(self, s: np.ndarray, f: np.ndarray | None) -> np.ndarray:
        return expit(self.a_ * s + self.b_)


class TemperatureCalibrator(Calibrator):
    """Temperature scaling (Guo et al., 2017): p = sigmoid(s / T_), T_ > 0 by maximum likelihood."""

    method = "temperature"
    PARAMS: ClassVar[dict[str, type]] = {"temperature_": float}

    def __init__(self, symmetric: bool = True, min_points: int = 10):
        super().__init__(symmetric, min_points)
        self.temperature_ = 1.0

    def _check_params(self, params: dict[str, Any], fitted: bool) -> None:
        if params["temperature_"] <= 0:
            raise CalibrationError(f"params.temperature_ must be positive, got {params['temperature_']}")

    def _fit(self, s: np.ndarray, y: np.ndarray, f: np.ndarray | None) -> None:
        def loss_grad(log_t: np.ndarray) -> tuple[float, np.ndarray]:
            inv_t = np.exp(-log_t[0])
            z = s * inv_t
            loss = np.sum(np.logaddexp(0.0, z) - y * z)
            # d loss / d log_t = sum (sigmoid(z) - y) * (-z)
            return float(loss), np.array([np.sum((expit(z) - y) * -z)])

        res = minimize(loss_grad, np.zeros(1), jac=True, method="L-BFGS-B", bounds=[(-10.0, 10.0)])
        self.temperature_ = float(np.exp(res.x[0]))

    def _predict(self, s: np.ndarray, f: np.ndarray | None) -> np.ndarray:
        return expit(s / self.temperature_)


class IsotonicCalibrator(Calibrator):
    """Isotonic regression (Zadrozny & Elkan, 2002) of the label on the raw logit.

    Scores outside the fitted range are clipped to its ends. With ``symmetric`` the prediction is
    averaged with its mirror, p(s) = (f(s) + 1 - f(-s)) / 2, which is antisymmetric exactly and still
    non-decreasing. Probabilities are clipped to [eps, 1 - eps] so NLL stays finite; ``eps=0``
    reproduces scikit-learn's ``IsotonicRegression`` exactly.
    """

    method = "isotonic"
    PARAMS: ClassVar[dict[str, type]] = {
        "x_": np.ndarray,
        "y_": np.ndarray,
        "eps": float,
        "min_points_warn": int,
    }

    def __init__(
        self, symmetric: bool = True, min_points: int = 10, min_points_warn: int = 200, eps: float = 1e-3
    ):
        super().__init__(symmetric, min_points)
        self.min_points_warn = min_points_warn
        self.eps = eps
        self.x_: np.ndarray = np.zeros(0)
        self.y_: np.ndarray = np.zeros(0)

    def _fit(self, s: np.ndarray, y: np.ndarray, f: np.ndarray | None) -> None:
        from sklearn.isotonic import IsotonicRegression

        if s.size < self.min_points_warn:
            warnings.warn(
                f"isotonic calibration on only {s.size} points (< {self.min_points_warn}) tends to overfit; "
                "prefer Platt scaling or add calibration data",
                UserWarning,
                stacklevel=3,
            )
        iso = IsotonicRegression(out_of_bounds="clip", y_min=0.0, y_max=1.0).fit(s, y)
        self.x_ = np.asarray(iso.X_thresholds_, dtype=float)
        self.y_ = np.asarray(iso.y_thresholds_, dtype=float)

    def _check_params(self, params: dict[str, Any], fitted: bool) -> None:
        x, y = np.asarray(params["x_"], dtype=float), np.asarray(params["y_"], dtype=float)
        if x.ndim != 1 or x.shape != y.shape or (fitted and x.size == 0):
            raise CalibrationError(
                f"params.x_ and params.y_ must be two lists of the same length (non-empty once fitted), got {x.size} and {y.size}"
            )
        if np.any(np.diff(x) < 0) or np.any((y < 0) | (y > 1)):
            raise CalibrationError("params.x_ must be non-decreasing and params.y_ within [0, 1]")

    def _raw(self, s: np.ndarray) -> np.ndarray:
        return np.interp(
            s, self.x_, self.y_
        )  # np.interp clips outside [x_min, x_max], like out_of_bounds="clip"

    def _predict(self, s: np.ndarray, f: np.ndarray | None) -> np.ndarray:
        p = self._raw(s)
        if self.symmetric:
            p = 0.5 * (p + 1.0 - self._raw(-s))
        return np.clip(p, self.eps, 1.0 - self.eps)


class FeaturePlattCalibrator(Calibrator):
    """Platt scaling with pair features: p = sigmoid(a_ * s + w_ . f), no intercept.

    Features are differences between the two summaries (e.g. log length ratio, copy-rate
    difference), so swapping a and b negates them and the map stays antisymmetric. A style-biased
    judge gets a negative weight on the feature it over-rewards, which discounts the bias.
    A small L2 penalty (``l2``) keeps weights finite when a feature separates the labels.
    """

    method = "feature_platt"
    PARAMS: ClassVar[dict[str, type]] = {"a_": float, "w_": np.ndarray, "l2": float}
    uses_features = True

    def __init__(self, symmetric: bool = True, l2: float = 1e-3, min_points: int = 10):
        super().__init__(symmetric, min_points)
        self.l2 = l2
        self.a_ = 1.0
        self.w_: np.ndarray = np.zeros(0)

    def _fit(self, s: np.ndarray, y: np.ndarray, f: np.ndarray | None) -> None:
        assert f is not None
        X = np.concatenate([s[:, None], f], axis=1)
        w = fit_logistic(X, y, l2=self.l2)
        self.a_, self.w_ = float(w[0]), w[1:].copy()

    def _predict(self, s: np.ndarray, f: np.ndarray | None) -> np.ndarray:
        assert f is not None
        if f.shape[1] != self.w_.size:
            raise ValueError(f"feature_platt was fitted with {self.w_.size} features, got {f.shape[1]}")
        return expit(self.a_ * s + f @ self.w_)


class StyleResidualCalibrator(Calibrator):
    """The label-free arm: remove the part of the judge's logit that the style features explain.

    Fit on fresh policy pairs, **without labels**: regress the raw logit on the antisymmetric pair
    features (log length ratio, copy-rate difference), ``s = f . beta + e``, no intercept (swapping a
    and b negates both sides), by least squares; then ``p = sigmoid(s - f . beta)``. This is the
    regression adjustment of length-controlled win rates applied to a pairwise judge: whatever of the
    judge's preference a style difference predicts is taken out, and what is left is its preference at
    equal style.

    Why this and not a labeled fit: Platt or isotonic maps are monotone in ``s`` and cannot change
    *which* summary the judge prefers, only how sure it is; ``feature_platt`` can discount a style but
    needs neutral labels. This arm needs neither labels nor references, so it works wherever the judge
    itself is all there is. What it cannot tell apart: a real quality difference that happens to
    correlate with the style features is removed with the bias (a longer summary that *is* better loses
    that credit too). So the style term is subtracted only when it is detectable: a Wald test of
    ``beta = 0`` on the ``n`` fitted pairs (not the doubled, symmetrized set) at level ``alpha``; a judge
    whose logit carries no style term is left exactly unchanged (``p = sigmoid(s)``).

    ``labels`` passed to :meth:`fit` are ignored (the loop passes them, and uses them only to report ECE).
    """

    method = "style_residual"
    PARAMS: ClassVar[dict[str, type]] = {"beta_": np.ndarray, "alpha": float, "wald_p_": float}
    uses_features = True

    def __init__(self, symmetric: bool = True, min_points: int = 10, alpha: float = 0.05):
        super().__init__(symmetric, min_points)
        self.alpha = alpha
        self.beta_: np.ndarray = np.zeros(0)
        self.wald_p_: float = 1.0

    def fit(self, scores: Any, labels: Any = None, features: Any = None) -> Calibrator:
        s, f = _label_free_inputs(self.method, scores, features, self.min_points)
        beta, self.wald_p_ = linear_style_term(s, f)
        self.beta_ = beta if self.wald_p_ < self.alpha else np.zeros_like(beta)
        self.n_fit_ = int(s.size) * (2 if self.symmetric else 1)
        return self

    def _predict(self, s: np.ndarray, f: np.ndarray | None) -> np.ndarray:
        assert f is not None
        if f.shape[1] != self.beta_.size:
            raise ValueError(f"style_residual was fitted with {self.beta_.size} features, got {f.shape[1]}")
        return expit(s - f @ self.beta_)


class BiasCurveCalibrator(Calibrator):
    """The label-free arm with a non-parametric bias curve: the judge's logit regressed on each style
    feature by a monotone curve, the residual used as the preference.

    Fit on fresh policy pairs **without labels**, like :class:`StyleResidualCalibrator`, of which this is
    the non-parametric form: ``s = g_1(f_1) + ... + g_F(f_F) + e``, each ``g_j`` an isotonic regression
    (increasing or decreasing as the feature's linear coefficient says), fitted jointly by backfitting
    on both orientations of every pair, then made exactly odd (``g(-x) = -g(x)``: swapping a and b negates
    the feature and the judge's logit, so it must negate the curve). ``p = sigmoid(s - sum_j g_j(f_j))``.
    A linear term cannot follow a bias that saturates (a copy bonus that counts up to some overlap and
    not beyond) or that grows only past a threshold; a monotone curve can, with no labels and no
    parametric form (the post-hoc reward calibration of Huang et al. 2024, which estimates the bias as a
    locally weighted curve of the length difference, is this idea with another smoother).

    As ``style_residual``, the curve is subtracted only when the style term is detectable (a Wald test of
    the linear term at level ``alpha``), so a judge with no style term is left exactly unchanged; and what
    it cannot tell apart: quality that correlates with a style feature is removed with the bias. Each
    curve is stored on ``grid_size`` points over ``[-range_j, range_j]`` (``range_j`` the largest |f_j|
    seen) and read by linear interpolation, flat beyond the range.
    """

    method = "bias_curve"
    PARAMS: ClassVar[dict[str, type]] = {
        "curve_": np.ndarray,
        "range_": np.ndarray,
        "alpha": float,
        "wald_p_": float,
    }
    uses_features = True

    def __init__(
        self,
        symmetric: bool = True,
        min_points: int = 10,
        alpha: float = 0.05,
        grid_size: int = 65,
        rounds: int = 20,
    ):
        super().__init__(symmetric, min_points)
        self.alpha = alpha
        self.grid_size = grid_size
        self.rounds = rounds
        self.curve_: np.ndarray = np.zeros((0, grid_size))
        self.range_: np.ndarray = np.zeros(0)
        self.wald_p_: float = 1.0

    def fit(self, scores: Any, labels: Any = None, features: Any = None) -> Calibrator:
        from sklearn.isotonic import IsotonicRegression

        s, f = _label_free_inputs(self.method, scores, features, self.min_points)
        beta, self.wald_p_ = linear_style_term(s, f)
        n_feat = f.shape[1]
        self.range_ = np.maximum(np.abs(f).max(axis=0), 1e-12)
        self.curve_ = np.zeros((n_feat, self.grid_size))
        self.n_fit_ = int(s.size) * (2 if self.symmetric else 1)
        if self.wald_p_ >= self.alpha:  # no detectable style term: the judge is left as it is
            return self
        s2, f2 = np.concatenate([s, -s]), both_orientations(f)
        fitted = np.zeros_like(f2)
        grids = [np.linspace(-r, r, self.grid_size) for r in self.range_]
        for _ in range(self.rounds):  # backfitting: each curve on what the others leave
            before = fitted.copy()
            for j in range(n_feat):
                partial = s2 - fitted.sum(axis=1) + fitted[:, j]
                iso = IsotonicRegression(increasing=bool(beta[j] >= 0), out_of_bounds="clip")
                iso.fit(f2[:, j], partial)
                on_grid = iso.predict(grids[j])
                odd = 0.5 * (on_grid - on_grid[::-1])  # the grid is symmetric about 0
                self.curve_[j] = odd
                fitted[:, j] = np.interp(f2[:, j], grids[j], odd)
            if np.max(np.abs(fitted - before)) < 1e-9:
                break
        return self

    def bias(self, f: np.ndarray) -> np.ndarray:
        """The fitted bias ``sum_j g_j(f_j)`` of pairs with features ``f`` (n, F)."""
        if f.shape[1] != self.curve_.shape[0]:
            raise ValueError(f"bias_curve was fitted with {self.curve_.shape[0]} features, got {f.shape[1]}")
        out = np.zeros(f.shape[0])
        for j, r in enumerate(self.range_):
            out += np.interp(f[:, j], np.linspace(-r, r, self.curve_.shape[1]), self.curve_[j])
        return out

    def _check_params(self, params: dict[str, Any], fitted: bool) -> None:
        curve, rng = np.asarray(params["curve_"], dtype=float), np.asarray(params["range_"], dtype=float)
        if curve.ndim != 2 or curve.shape[0] != rng.size or (rng <= 0).any():
            raise CalibrationError(
                f"bias_curve params: curve_ must be one row per feature of range_ (> 0), got shapes "
                f"{curve.shape} and {rng.shape}"
            )

    def _set_params(self, params: dict[str, Any]) -> None:
        super()._set_params(params)
        self.curve_ = self.curve_.reshape(self.range_.size, -1)
        self.grid_size = self.curve_.shape[1]

    def _predict(self, s: np.ndarray, f: np.ndarray | None) -> np.ndarray:
        assert f is not None
        return expit(s - self.bias(f))


CALIBRATORS: dict[str, type[Calibrator]] = {
    "raw": IdentityCalibrator,
    "platt": PlattCalibrator,
    "temperature": TemperatureCalibrator,
    "isotonic": IsotonicCalibrator,
    "feature_platt": FeaturePlattCalibrator,
    "style_residual": StyleResidualCalibrator,
    "bias_curve": BiasCurveCalibrator,
}


def make_calibrator(method: str, **kwargs: Any) -> Calibrator:
    """Build a calibrator by name: raw, platt, temperature, isotonic, feature_platt, style_residual, bias_curve."""
    if method not in CALIBRATORS:
        raise ValueError(f"unknown calibrator {method!r}; choose one of {sorted(CALIBRATORS)}")
    return CALIBRATORS[method](**kwargs)


def load_calibrator(path: str | Path) -> Calibrator:
    """A fitted calibrator read from a JSON file written by :meth:`Calibrator.save`.

    Raises:
        CalibrationError: one line naming the file: missing, truncated or not JSON, or a state that
            :meth:`Calibrator.load_state_dict` refuses.
    """
    from judgeloop.io import DataError, read_json

    fix = "fit and save the calibrator again"
    try:
        state = read_json(path, "calibrator file", fix)
        return calibrator_from_state(state)
    except DataError as err:
        raise CalibrationError(str(err)) from None
    except CalibrationError as err:
        raise CalibrationError(f"calibrator file {path}: {err}; {fix}") from None


def calibrator_from_state(state: dict[str, Any]) -> Calibrator:
    """A fitted calibrator rebuilt from its :meth:`Calibrator.state_dict` (checked; see ``load_state_dict``)."""
    method = state.get("method") if isinstance(state, dict) else None
    if method not in CALIBRATORS:
        raise CalibrationError(f"calibrator method {method!r} is not one of {sorted(CALIBRATORS)}")
    return make_calibrator(method).load_state_dict(state)
