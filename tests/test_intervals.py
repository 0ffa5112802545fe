"""The one percentile bootstrap (judgeloop.intervals) and its users: several statistics on the same
resamples, and the gate's AUC interval and the refit's ECE intervals drawn by it."""

from __future__ import annotations

import math

import numpy as np
import pytest

from judgeloop.intervals import bootstrap_interval, bootstrap_intervals, bootstrap_mean_interval


def test_several_statistics_share_the_resamples_and_each_equals_its_own_interval():
    rng = np.random.default_rng(0)
    a, b = rng.normal(0.3, 1, 50), rng.normal(0.0, 1, 50)
    both = bootstrap_intervals(lambda i: [a[i].mean(), b[i].mean(), (a[i] - b[i]).mean()], 50, 800, seed=4)
    assert both[0] == bootstrap_interval(lambda i: a[i].mean(), 50, 800, seed=4)
    assert both[1] == bootstrap_interval(lambda i: b[i].mean(), 50, 800, seed=4)
    assert both[2] == bootstrap_mean_interval(a - b, 800, seed=4)  # the paired difference, same draws
    assert bootstrap_intervals(lambda i: [float(i.size and np.nan), 1.0], 0, 10) == [(math.nan, math.nan)] * 2


def test_a_non_finite_replicate_is_dropped_per_statistic():
    x = np.arange(10.0)
    (lo, hi), (nlo, nhi) = bootstrap_intervals(lambda i: [x[i].mean(), math.nan], 10, 200, seed=1)
    assert 0 <= lo < hi <= 9 and math.isnan(nlo) and math.isnan(nhi)
    with pytest.raises(ValueError, match="num_resamples=0"):
        bootstrap_interval(lambda i: 0.0, 0, 0)


def test_the_gate_auc_interval_and_the_refit_ece_intervals_are_this_bootstrap():
    from judgeloop.calibration import PlattCalibrator, ece
    from judgeloop.loop.pairs import CalibrationPairs, _oriented, ece_intervals
    from judgeloop.retrieval.gate import auc, bootstrap_auc

    rng = np.random.default_rng(2)
    s, y = rng.normal(size=60), rng.random(60) < 0.4
    assert bootstrap_auc(s, y, 300, seed=5) == bootstrap_interval(lambda i: auc(s[i], y[i]), 60, 300, seed=5)

    n = 40
    scores = rng.normal(0, 2, n)
    labels = (rng.random(n) < 1 / (1 + np.exp(-scores))).astype(int)
    pairs = CalibrationPairs(
        [f"x{i}" for i in range(n)], ["art"] * n, ["a"] * n, ["b"] * n, list(scores), list(labels)
    )
    before, after = PlattCalibrator(), PlattCalibrator()
    before.fit(np.concatenate([scores, -scores]), np.concatenate([labels, 1 - labels]))
    after.fit(np.concatenate([2 * scores, -2 * scores]), np.concatenate([labels, 1 - labels]))
    got = ece_intervals(before, after, pairs, 10, 300, seed=7)
    # the refit's resampling, written out: pairs with replacement, both orientations together
    pa, ya = _oriented(after, pairs)
    pb = _oriented(before, pairs)[0]
    draw = np.random.default_rng(7)
    aft, bef = [], []
    for _ in range(300):
        i = draw.integers(0, n, n)
        aft.append(ece(pa[i].ravel(), ya[i].ravel(), n_bins=10))
        bef.append(ece(pb[i].ravel(), ya[i].ravel(), n_bins=10))
    aft, bef = np.array(aft), np.array(bef)
    assert got["ece_after_ci95"] == pytest.approx(list(np.percentile(aft, [2.5, 97.5])), abs=1e-12)
    assert got["ece_before_ci95"] == pytest.approx(list(np.percentile(bef, [2.5, 97.5])), abs=1e-12)
    assert got["ece_delta_ci95"] == pytest.approx(list(np.percentile(aft - bef, [2.5, 97.5])), abs=1e-12)
