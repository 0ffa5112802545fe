from __future__ import annotations

import numpy as np
import pytest
from scipy.special import expit

from judgeloop.calibration import (
    CalibrationError,
    IsotonicCalibrator,
    PlattCalibrator,
    brier,
    calibrator_from_state,
    ece,
    make_calibrator,
    mce,
    nll,
)
from judgeloop.calibration.metrics import accuracy, reliability_bins


def test_ece_brier_hand_computed():
    p = np.array([0.1, 0.2, 0.8, 0.9])
    y = np.array([0, 1, 1, 1])
    # 2 bins: [0, .5] holds (.1, .2) with conf .15, freq .5; (.5, 1] holds (.8, .9) with conf .85, freq 1
    assert ece(p, y, n_bins=2) == pytest.approx(0.5 * 0.35 + 0.5 * 0.15)
    assert mce(p, y, n_bins=2) == pytest.approx(0.35)
    assert brier(p, y) == pytest.approx((0.01 + 0.64 + 0.04 + 0.01) / 4)
    assert nll(p, y) == pytest.approx(-(np.log(0.9) + np.log(0.2) + np.log(0.8) + np.log(0.9)) / 4)
    assert accuracy(np.array([0.5, 0.7, 0.2]), np.array([1, 1, 1])) == pytest.approx(0.5)
    bins = reliability_bins(p, y, 2, "quantile")
    assert bins["count"].sum() == 4


def _data(n=600, seed=0, slope=0.5, bias=0.0):
    rng = np.random.default_rng(seed)
    s = rng.normal(scale=3.0, size=n)
    y = (rng.random(n) < expit(slope * s + bias)).astype(int)
    return s, y


def test_platt_matches_sklearn():
    from sklearn.calibration import _sigmoid_calibration
    from sklearn.linear_model import LogisticRegression

    s, y = _data()
    ours = PlattCalibrator(symmetric=False, fit_intercept=True).fit(s, y)
    a, b = _sigmoid_calibration(s, y)  # sklearn's parametrization: p = 1 / (1 + exp(a s + b))
    assert ours.a_ == pytest.approx(-a, abs=1e-4) and ours.b_ == pytest.approx(-b, abs=1e-4)
    plain = PlattCalibrator(symmetric=False, fit_intercept=False, target_smoothing=False).fit(s, y)
    lr = LogisticRegression(C=np.inf, fit_intercept=False, tol=1e-10, max_iter=1000).fit(s[:, None], y)
    assert plain.a_ == pytest.approx(lr.coef_[0, 0], rel=1e-4)


def test_isotonic_matches_sklearn():
    from sklearn.isotonic import IsotonicRegression

    s, y = _data()
    ours = IsotonicCalibrator(symmetric=False, eps=0.0).fit(s, y)
    ref = IsotonicRegression(out_of_bounds="clip", y_min=0, y_max=1).fit(s, y)
    grid = np.linspace(-12, 12, 101)
    np.testing.assert_allclose(ours.predict_proba(grid), ref.predict(grid), atol=1e-12)


@pytest.mark.parametrize("method", ["platt", "temperature", "isotonic"])
def test_symmetric_calibrators_are_antisymmetric_and_calibrate(method):
    s, y = _data(n=2000, slope=0.3)
    cal = make_calibrator(method).fit(s, y)
    p = cal.predict_proba(s)
    np.testing.assert_allclose(cal.predict_proba(-s), 1 - p, atol=1e-12)
    s2, y2 = _data(n=4000, seed=1, slope=0.3)
    assert ece(cal.predict_proba(s2), y2) < ece(expit(s2), y2)
    clone = calibrator_from_state(cal.state_dict())
    np.testing.assert_allclose(clone.predict_proba(s2), cal.predict_proba(s2))


def test_feature_platt_discounts_style_bias():
    rng = np.random.default_rng(0)
    n = 3000
    quality = rng.normal(size=n)  # true quality difference
    copy = rng.normal(size=n)  # copy-rate difference the judge over-rewards
    s = 2.0 * quality + 3.0 * copy
    y = (rng.random(n) < expit(2.0 * quality)).astype(int)
    cal = make_calibrator("feature_platt").fit(s, y, copy[:, None])
    assert cal.w_[0] < -1.0  # learned to subtract the copy bias
    plain = make_calibrator("platt").fit(s, y)
    assert nll(cal.predict_proba(s, copy[:, None]), y) < nll(plain.predict_proba(s), y)
    with pytest.raises(CalibrationError, match="needs pair features"):
        make_calibrator("feature_platt").fit(s, y)


def test_fit_errors_name_the_problem():
    with pytest.raises(CalibrationError, match=r"one class only \(all 1\)"):
        PlattCalibrator(symmetric=False).fit(np.arange(20.0), np.ones(20))
    with pytest.raises(CalibrationError, match="fewer than min_points=10"):
        PlattCalibrator().fit(np.arange(5.0), np.array([0, 1, 0, 1, 1]))
    s = np.arange(20.0)
    s[3] = np.nan
    with pytest.raises(CalibrationError, match="1 of 20 scores are NaN"):
        PlattCalibrator().fit(s, np.arange(20) % 2)
    with pytest.raises(CalibrationError, match="20 scores but 19 labels"):
        PlattCalibrator().fit(np.arange(20.0), np.arange(19) % 2)
    with pytest.raises(ValueError, match="unknown calibrator 'plat'"):
        make_calibrator("plat")
    with pytest.raises(RuntimeError, match="not fitted"):
        PlattCalibrator().predict_proba([0.0])


def test_isotonic_warns_on_few_points():
    s, y = _data(n=40)
    with pytest.warns(UserWarning, match="isotonic calibration on only 80 points"):
        IsotonicCalibrator().fit(s, y)


def test_nan_scores_predict_nan():
    cal = PlattCalibrator().fit(*_data())
    p = cal.predict_proba([0.0, np.nan])
    assert p[0] == pytest.approx(0.5) and np.isnan(p[1])


def test_infinite_logits_map_to_the_limits_and_nan_stays_nan():
    import numpy as np

    from judgeloop.calibration import make_calibrator

    rng = np.random.default_rng(0)
    s = rng.normal(0, 2, 300)
    y = (rng.random(300) < 1 / (1 + np.exp(-s))).astype(int)
    f = rng.normal(0, 0.3, (300, 2))
    for method in ("platt", "temperature", "feature_platt", "style_residual", "isotonic"):
        cal = make_calibrator(method).fit(s, y, f if method in ("feature_platt", "style_residual") else None)
        p = cal.predict_proba(np.array([np.inf, -np.inf, np.nan]), f[:3] if cal.uses_features else None)
        assert p[0] > 0.99 and p[1] < 0.01 and np.isnan(p[2]), method


def test_a_reversed_judge_is_flagged():
    import numpy as np

    from judgeloop.calibration.coupling import coupling_line, judge_coupling

    rng = np.random.default_rng(1)
    y = rng.integers(0, 2, 60)
    s = np.where(y == 1, -1.0, 1.0) + rng.normal(0, 0.3, 60)  # prefers the worse summary
    c = judge_coupling(s, y, ["an article"] * 60, ["a b c d"] * 60, ["a b"] * 60)
    assert c["auc_label"] < 0.2
    assert coupling_line(c).startswith("WARNING: the judge prefers the worse summary (AUC 0.")


def _saturating_bias_judge(n: int = 400, seed: int = 0):
    """A constructed judge whose logit is a quality term plus a known saturating style bias."""
    rng = np.random.default_rng(seed)
    f = np.column_stack([rng.normal(0, 0.3, n), rng.uniform(-0.8, 0.8, n)])
    quality = rng.normal(0, 1, n)
    bias = 4 * np.tanh(6 * f[:, 1])  # a copy bonus that counts up to some overlap and not beyond
    return quality + bias, f, quality, bias


def test_bias_curve_removes_a_known_saturating_bias_without_labels():
    """bias_curve, fit on unlabeled pairs, recovers the bias curve and the quality ordering that a linear
    style term (style_residual) cannot; swapping a and b gives 1 - p; a judge with no bias is left as is."""
    from scipy.stats import spearmanr

    from judgeloop.calibration import calibrator_from_state, make_calibrator

    s, f, quality, bias = _saturating_bias_judge()
    curve = make_calibrator("bias_curve").fit(s, None, f)
    linear = make_calibrator("style_residual").fit(s, None, f)
    assert np.abs(curve.bias(f) - bias).mean() < 0.25  # of a bias spanning [-4, 4]
    logit = lambda c: np.log(c.predict_proba(s, f) / (1 - c.predict_proba(s, f)))  # noqa: E731
    assert spearmanr(logit(curve), quality)[0] > 0.95 > 0.6 > spearmanr(logit(linear), quality)[0]
    assert np.allclose(curve.predict_proba(s, f), 1 - curve.predict_proba(-s, -f))
    again = calibrator_from_state(curve.state_dict())
    assert np.array_equal(again.predict_proba(s, f), curve.predict_proba(s, f))
    unbiased = make_calibrator("bias_curve").fit(quality, None, f)
    assert unbiased.wald_p_ >= unbiased.alpha
    assert np.array_equal(unbiased.predict_proba(quality, f), expit(quality))


def test_bias_curve_refuses_a_damaged_state_in_one_line():
    from judgeloop.calibration import CalibrationError, calibrator_from_state, make_calibrator

    s, f, _, _ = _saturating_bias_judge(n=100)
    state = make_calibrator("bias_curve").fit(s, None, f).state_dict()
    state["params"]["range_"] = [0.5]  # two curves, one range
    with pytest.raises(CalibrationError, match="one row per feature"):
        calibrator_from_state(state)
