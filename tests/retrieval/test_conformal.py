"""Conformal retrieval: the quantile rule, coverage over random splits, Mondrian fallback, ACI, base rates."""

from __future__ import annotations

import json
import logging
import math

import numpy as np
import pytest

from judgeloop.retrieval.conformal import (
    AdaptiveConformal,
    ConformalRetriever,
    base_rate_alpha,
    base_rate_threshold,
    base_rates,
    clopper_pearson_interval,
    conformal_quantile,
    coverage_and_size,
    map_scores,
    nonconformity,
    quantile_buckets,
    wilson_interval,
)

# ---------------------------------------------------------------------------------------------- quantile rule


def test_quantile_rule_hand_computed():
    s = [0.7, 0.1, 0.3, 0.9, 0.5, 0.2, 1.0, 0.4, 0.8, 0.6]  # n = 10, sorted 0.1 ... 1.0
    # alpha = 0.2: ceil(11 * 0.8) = ceil(8.8) = 9 -> 9th smallest = 0.9
    assert conformal_quantile(s, 0.2) == pytest.approx(0.9)
    # alpha = 0.1: ceil(11 * 0.9) = ceil(9.9) = 10 -> 1.0
    assert conformal_quantile(s, 0.1) == pytest.approx(1.0)
    # alpha = 0.5: ceil(5.5) = 6 -> 0.6
    assert conformal_quantile(s, 0.5) == pytest.approx(0.6)
    # alpha = 0.05: ceil(10.45) = 11 > n -> infinite threshold (whole corpus)
    assert conformal_quantile(s, 0.05) == math.inf
    assert conformal_quantile([], 0.1) == math.inf


def test_quantile_rule_exact_integer_index_does_not_round_up():
    # n = 19, alpha = 0.05: (n+1)(1-alpha) = 19 exactly (19.000000000000004 in floating point)
    s = np.arange(1, 20, dtype=float)
    assert conformal_quantile(s, 0.05) == 19.0


def test_quantile_rule_infinite_scores_count_as_misses():
    # two of ten relevant docs outside the top-K: the 9th smallest is inf at alpha = 0.2
    s = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, math.inf, math.inf]
    assert conformal_quantile(s, 0.2) == math.inf
    assert conformal_quantile(s, 0.3) == pytest.approx(0.8)  # ceil(11 * 0.7) = 8


def test_quantile_rule_rejects_bad_alpha():
    with pytest.raises(ValueError, match="alpha=1.5 must be in"):
        conformal_quantile([0.1], 1.5)


# ---------------------------------------------------------------------------------------------- scores


def test_map_scores():
    s = np.array([[1.0, 0.0, -1.0]])
    np.testing.assert_allclose(map_scores(s, "affine"), [[1.0, 0.5, 0.0]])
    p = map_scores(s, "softmax", temperature=1.0)
    np.testing.assert_allclose(p.sum(axis=1), 1.0)
    np.testing.assert_allclose(p, np.exp(s) / np.exp(s).sum())
    with pytest.raises(ValueError, match="score_map='identity' needs scores in"):
        map_scores(s, "identity")
    with pytest.raises(ValueError, match="temperature=0"):
        map_scores(s, "softmax", temperature=0)


def test_nonconformity_hand_computed():
    scores = np.array([[0.9, 0.6, 0.2], [0.8, 0.7, 0.1], [0.5, 0.4, 0.3]])
    rel = np.array([[True, False, True], [False, False, False], [False, True, False]])
    missing = np.array([0, 1, 1])
    v, q = nonconformity(scores, rel, missing, "document")
    # pairs: q0 d0 (0.1), q0 d2 (0.8), q2 d1 (0.6), then the missing ones (q1, q2) at +inf
    np.testing.assert_allclose(v, [0.1, 0.8, 0.6, math.inf, math.inf])
    np.testing.assert_array_equal(q, [0, 0, 2, 1, 2])
    v, q = nonconformity(scores, rel, missing, "any")
    np.testing.assert_allclose(v, [0.1, math.inf, 0.6])
    v, q = nonconformity(scores, rel, missing, "all")
    np.testing.assert_allclose(v, [0.8, math.inf, math.inf])
    v, q = nonconformity(scores, rel, missing, "labels")
    np.testing.assert_allclose(v[:3], [0.1, 0.6, 0.8])  # y=1: 1-s, y=0: s, y=1: 1-s
    with pytest.raises(ValueError, match="shapes do not match"):
        nonconformity(scores, rel[:2], missing, "document")
    with pytest.raises(ValueError, match="guarantee='best'"):
        nonconformity(scores, rel, missing, "best")  # type: ignore[arg-type]


def test_coverage_and_size_full_corpus_on_infinite_threshold():
    scores = np.array([[0.9, 0.6, 0.2], [0.8, 0.7, 0.1]])
    rel = np.array([[True, False, False], [False, False, False]])
    missing = np.array([0, 1])
    out = coverage_and_size(scores, rel, missing, np.array([0.5, math.inf]), "document", corpus_size=100)
    np.testing.assert_allclose(out["covered"], [1.0, 1.0])  # the whole corpus holds the missing doc
    np.testing.assert_allclose(out["size"], [2.0, 100.0])  # {0.9, 0.6} have 1 - s <= 0.5
    np.testing.assert_array_equal(out["full"], [False, True])


# ---------------------------------------------------------------------------------------------- coverage


def _synthetic(n_queries: int, k: int, rng: np.random.Generator, shift: float = 0.0):
    """Exchangeable queries: one relevant doc, ranked among K noise docs, 5% outside the top-K."""
    noise = rng.beta(2, 5, size=(n_queries, k))
    rel_score = np.clip(rng.beta(5, 2, size=n_queries) - shift, 0, 1)
    scores = np.concatenate([rel_score[:, None], noise], axis=1)
    rel = np.zeros_like(scores, dtype=bool)
    rel[:, 0] = True
    order = np.argsort(-scores, axis=1)
    scores = np.take_along_axis(scores, order, 1)[:, :k]
    rel = np.take_along_axis(rel, order, 1)[:, :k]
    missing = (~rel.any(axis=1)).astype(int)
    lost = rng.random(n_queries) < 0.05  # retriever recall limit
    rel[lost] = False
    missing[lost] = 1
    return scores, rel, missing


@pytest.mark.parametrize("guarantee", ["document", "any"])
@pytest.mark.parametrize("alpha", [0.1, 0.2])
def test_coverage_holds_over_random_splits(guarantee, alpha):
    """Mean coverage over 300 random splits lies in [1 - alpha - 0.01, 1 - alpha + 1/(n+1) + 0.01].

    The expected coverage is in [1 - alpha, 1 - alpha + 1/(n+1)]; the tolerance 0.01 is > 4 standard
    errors of a 300-trial mean here (per-trial std ~ 0.025), so the test fails only on a real error.
    """
    rng = np.random.default_rng(0)
    n_cal, n_test, trials = 150, 150, 300
    covs = []
    for _ in range(trials):
        s, r, m = _synthetic(n_cal + n_test, 20, rng)
        model = ConformalRetriever(alpha, guarantee).fit(s[:n_cal], r[:n_cal], m[:n_cal])
        q = model.thresholds_for(n_test)
        out = coverage_and_size(s[n_cal:], r[n_cal:], m[n_cal:], q, guarantee, corpus_size=1000)
        covs.append(np.average(out["covered"], weights=out["weight"]))
    mean = float(np.mean(covs))
    assert 1 - alpha - 0.01 <= mean <= 1 - alpha + 1 / (n_cal + 1) + 0.01, mean


def test_label_sets_cover_true_labels():
    rng = np.random.default_rng(1)
    alpha, covs, sizes = 0.1, [], []
    for _ in range(100):
        s, r, m = _synthetic(200, 10, rng)
        model = ConformalRetriever(alpha, "labels").fit(s[:100], r[:100], m[:100])
        sets = model.predict(s[100:])  # (Q, K, 2)
        assert sets.shape == (100, 10, 2)
        truth = r[100:].astype(int)
        covs.append(np.take_along_axis(sets, truth[..., None], -1).mean())
        sizes.append(sets.sum(-1).mean())
    assert 0.89 <= np.mean(covs) <= 0.92
    assert 1.0 <= np.mean(sizes) <= 2.0


# ---------------------------------------------------------------------------------------------- Mondrian


def test_mondrian_fallback_to_parent_then_global():
    rng = np.random.default_rng(2)
    s, r, m = _synthetic(130, 10, rng)
    groups = ["qa/short"] * 60 + ["qa/long"] * 10 + ["chat"] * 10 + ["code"] * 50
    model = ConformalRetriever(0.1, "any", min_group_size=50).fit(s, r, m, groups)
    values, _ = nonconformity(s, r, m, "any")
    g = np.asarray(groups)
    assert model.groups_["qa/short"].source == "own"
    assert model.groups_["qa/short"].threshold == conformal_quantile(values[g == "qa/short"], 0.1)
    # 10 points: falls back to its parent "qa", which pools both qa/* groups (70 points)
    assert model.groups_["qa/long"].source == "parent:qa"
    assert model.groups_["qa/long"].threshold == conformal_quantile(values[np.char.startswith(g, "qa/")], 0.1)
    assert model.groups_["qa/long"].n_cal == 10
    # no parent: the global threshold
    assert model.groups_["chat"].source == "global"
    assert model.group_threshold("chat")[0] == model.threshold_ == conformal_quantile(values, 0.1)
    assert model.groups_["code"].source == "own"
    # a group with no calibration data does not fall back: it gets the most conservative threshold
    top = max(model.threshold_, *(f.threshold for f in model.groups_.values() if f.source == "own"))
    assert model.group_threshold("qa/new") == (top, "most_conservative")
    assert model.group_threshold("unknown") == (top, "most_conservative")


def test_mondrian_gives_group_conditional_coverage():
    """Two groups with different score distributions: one global threshold under-covers the hard group,
    per-group thresholds cover both."""
    rng = np.random.default_rng(3)
    alpha, cov_g, cov_m = 0.1, {"easy": [], "hard": []}, {"easy": [], "hard": []}
    for _ in range(200):
        se, re_, me = _synthetic(200, 10, rng)
        sh, rh, mh = _synthetic(200, 10, rng, shift=0.3)
        s, r, m = np.concatenate([se, sh]), np.concatenate([re_, rh]), np.concatenate([me, mh])
        groups = np.asarray(["easy"] * 200 + ["hard"] * 200, dtype=object)
        perm = rng.permutation(400)
        cal, test = perm[:200], perm[200:]
        glob = ConformalRetriever(alpha, "any").fit(s[cal], r[cal], m[cal])
        mond = ConformalRetriever(alpha, "any", min_group_size=50).fit(
            s[cal], r[cal], m[cal], groups[cal].tolist()
        )
        for model, acc in ((glob, cov_g), (mond, cov_m)):
            gl = groups[test].tolist() if model is mond else None
            out = coverage_and_size(s[test], r[test], m[test], model.thresholds_for(200, gl), "any", 1000)
            for name in ("easy", "hard"):
                acc[name].append(out["covered"][groups[test] == name].mean())
    assert np.mean(cov_g["hard"]) < 1 - alpha - 0.03  # global threshold fails the hard group
    for name in ("easy", "hard"):
        assert 1 - alpha - 0.01 <= np.mean(cov_m[name]) <= 1 - alpha + 0.03


def test_state_dict_round_trip_through_json():
    rng = np.random.default_rng(4)
    s, r, m = _synthetic(80, 10, rng)
    model = ConformalRetriever(0.01, "document", min_group_size=5).fit(s, r, m, ["a"] * 40 + ["b"] * 40)
    assert model.threshold_ == math.inf  # n = 80 is too small for alpha = 0.01
    from judgeloop.io import _clean_floats

    state = json.loads(json.dumps(_clean_floats(model.state_dict())))
    clone = ConformalRetriever().load_state_dict(state)
    np.testing.assert_array_equal(clone.predict(s, ["a"] * 80), model.predict(s, ["a"] * 80))
    assert clone.threshold_ == math.inf


def test_fit_errors():
    with pytest.raises(ValueError, match="guarantee='top'"):
        ConformalRetriever(0.1, "top")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="holds no relevant documents"):
        ConformalRetriever(0.1).fit(np.zeros((2, 3)), np.zeros((2, 3), bool), np.zeros(2, int))
    with pytest.raises(RuntimeError, match="not fitted"):
        ConformalRetriever(0.1).predict(np.zeros((2, 3)))


# ---------------------------------------------------------------------------------------------- online


def test_aci_reacts_to_drift():
    """Scores shift up at t = 1000: a frozen threshold loses coverage and alarms; ACI recovers."""
    rng = np.random.default_rng(5)
    alpha = 0.1
    stream = np.concatenate([rng.uniform(0, 1, 1000), rng.uniform(0.3, 1.3, 2000)])
    calib = rng.uniform(0, 1, 1000)
    aci = AdaptiveConformal(alpha, gamma=0.02, window=200, warmup=0, monitor_window=100).fit(calib)

    # frozen: threshold from calibration only
    q0 = conformal_quantile(calib, alpha)
    frozen_cov = float(np.mean(stream[1000:] <= q0))
    assert frozen_cov < 1 - alpha - 0.15
    r = aci.run(stream)
    post = r["covered"][1500:]  # after a few hundred steps of adaptation
    assert abs(post.mean() - (1 - alpha)) < 0.03
    assert r["alpha_t"][1100] < alpha  # alpha_t drops after misses pile up
    # alarm: a slowly adapting monitor (all history, gamma 0) flags the drift and stays quiet before it
    mon = AdaptiveConformal(alpha, gamma=0.0, window=None, warmup=0, monitor_window=200, tolerance=0.07).fit(
        calib
    )
    res = mon.run(stream)
    assert res["alarm"][:1000].sum() == 0
    assert res["alarm"][1000:].sum() > 0
    # and it survives a state_dict round trip mid-stream
    clone = AdaptiveConformal().load_state_dict(aci.state_dict())
    assert clone.threshold() == aci.threshold()


def test_aci_extreme_alpha_t():
    aci = AdaptiveConformal(0.1, gamma=0.5, window=10, warmup=0).fit([0.5] * 10)
    aci.alpha_t_ = 0.0
    assert aci.threshold() == math.inf
    aci.alpha_t_ = 1.0
    assert aci.threshold() == -math.inf


# ---------------------------------------------------------------------------------------------- base rates


@pytest.mark.parametrize("k,n", [(0, 10), (3, 10), (8, 10), (50, 50), (37, 120)])
def test_intervals_match_scipy(k, n):
    from scipy.stats import binomtest

    ref = binomtest(k, n).proportion_ci(0.95, method="wilson")
    assert wilson_interval(k, n) == pytest.approx((ref.low, ref.high), abs=1e-9)
    ref = binomtest(k, n).proportion_ci(0.95, method="exact")
    assert clopper_pearson_interval(k, n) == pytest.approx((ref.low, ref.high), abs=1e-9)


def test_base_rates_per_group():
    ok = [True, True, False, True, False, False]
    rates = base_rates(ok, ["a", "a", "a", "b", "b", "b"])
    assert rates["__global__"]["rate"] == 0.5 and rates["__global__"]["n"] == 6
    assert rates["a"]["rate"] == pytest.approx(2 / 3)
    assert rates["b"]["successes"] == 1
    assert rates["a"]["low"] < rates["a"]["rate"] < rates["a"]["high"]


# ---------------------------------------------------------------------------------------------- tau(alpha, beta)


def test_base_rate_threshold_hand_computed():
    # 99 scores 0.01 ... 0.99, all candidates (base rate 99/99). Clopper-Pearson at beta = 0.5 with k = n has
    # the closed form pi_low = ((1 - 0.5) / 2)^(1/99) = 0.25^(1/99) = exp(-1.386294 / 99) = 0.986095;
    # alpha = 0.1: alpha' = 1 - 0.9 / 0.986095 = 0.087309; index ceil(100 * 0.912691) = 92 -> 0.92
    # (the plain rule: ceil(100 * 0.9) = 90 -> 0.90).
    v = np.arange(1, 100) / 100
    tau, info = base_rate_threshold(v, 0.1, beta=0.5, interval="clopper_pearson")
    assert info["low"] == pytest.approx(0.986095, abs=1e-6)
    assert info["alpha_eff"] == pytest.approx(0.087309, abs=1e-6)
    assert tau == pytest.approx(0.92) and conformal_quantile(v, 0.1) == pytest.approx(0.90)


def test_a_low_base_rate_needs_a_larger_threshold():
    # The same 45 finite scores 0.02 ... 0.90; group "low" also has 5 relevant documents outside the top-K.
    finite = np.arange(1, 46) * 0.02
    # "high": k = n = 45, Wilson at beta = 0.9 (z = 1.644854, z^2 = 2.705545): centre (1 + z^2/90) / (1 + z^2/45)
    # = 1.030062 / 1.060123 = 0.971644, half-width (z^2 / 90) / 1.060123 = 0.028357 -> pi_low = 0.943287;
    # alpha = 0.3: alpha' = 1 - 0.7 / 0.943287 = 0.257914; index ceil(46 * 0.742086) = ceil(34.14) = 35 -> 0.70.
    tau_high, info = base_rate_threshold(finite, 0.3, beta=0.9)
    assert info["low"] == pytest.approx(0.943287, abs=1e-6) and tau_high == pytest.approx(0.70)
    # "low": k = 45 of n = 50 (rate 0.9): denominator 1 + z^2/50 = 1.054111, centre (0.9 + z^2/100) / 1.054111
    # = 0.879458, half-width z * sqrt(0.9 * 0.1 / 50 + z^2 / 10000) / 1.054111 = 0.070996 -> pi_low = 0.808462;
    # alpha' = 1 - 0.7 / 0.808462 = 0.134159; index ceil(46 * 0.865841) = ceil(39.83) = 40 -> 0.80.
    low_values = np.concatenate([finite, np.full(5, math.inf)])
    tau_low, info = base_rate_threshold(low_values, 0.3, beta=0.9)
    assert info["rate"] == 0.9 and info["low"] == pytest.approx(0.808462, abs=1e-6)
    assert info["alpha_eff"] == pytest.approx(0.134159, abs=1e-6) and tau_low == pytest.approx(0.80)
    # the plain quantile of the same 50 points is smaller: ceil(51 * 0.7) = 36 -> 0.72
    assert conformal_quantile(low_values, 0.3) == pytest.approx(0.72)
    # alpha = 0.2 asks for 0.8 / 0.808462 = 0.9895 of the candidates: index ceil(46 * 0.9895) = 46 > 45
    assert base_rate_threshold(low_values, 0.2, beta=0.9)[0] == math.inf
    # a wider interval (higher beta) is more conservative, and the base rate below 1 - alpha is infeasible
    assert base_rate_threshold(low_values, 0.3, beta=0.99)[0] >= tau_low
    assert base_rate_alpha(0.1, 0.85) < 0 and base_rate_alpha(0.1, 0.0) == -math.inf


@pytest.mark.parametrize("interval", ["wilson", "clopper_pearson"])
def test_base_rate_threshold_is_never_below_the_plain_quantile(interval):
    """pi_low <= k / n and (k + 1) n / k >= n + 1, so the index is never below the plain rule's."""
    rng = np.random.default_rng(7)
    for _ in range(300):
        n = int(rng.integers(1, 200))
        v = rng.uniform(0, 1, n)
        v[rng.random(n) < rng.uniform(0, 0.3)] = math.inf
        alpha, beta = float(rng.uniform(0.02, 0.5)), float(rng.uniform(0.05, 0.99))
        tau, _ = base_rate_threshold(v, alpha, beta, interval)  # type: ignore[arg-type]
        assert tau >= conformal_quantile(v, alpha)


def test_base_rate_threshold_errors():
    with pytest.raises(ValueError, match="beta=1.0 must be in"):
        base_rate_threshold([0.1], 0.1, beta=1.0)
    with pytest.raises(ValueError, match="interval='exact' is not one of"):
        base_rate_threshold([0.1], 0.1, interval="exact")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="threshold_rule='mean' is not one of"):
        ConformalRetriever(0.1, threshold_rule="mean")  # type: ignore[arg-type]


def _one_candidate(n: int, base_rate: float, rng: np.random.Generator):
    """Exchangeable queries with one candidate: the relevant document's nonconformity is U(0, 1) when it is
    a candidate (probability ``base_rate``), +inf when it is not. Given a threshold t, coverage is
    ``base_rate * min(t, 1)`` exactly."""
    scores = rng.uniform(0, 1, (n, 1))
    lost = rng.random(n) >= base_rate
    rel = ~lost[:, None]
    return scores, rel, lost.astype(int)


def test_base_rate_coverage_lies_in_its_band_per_group():
    """Two groups with base rates 0.98 and 0.90, exchangeable within each. Per group, mean test coverage over
    300 splits lies within 0.01 (> 4 standard errors) of the rule's exact expected coverage
    ``base_rate * min(tau, 1)``, averaged over the same splits, and that expectation is at least 1 - alpha."""
    rng = np.random.default_rng(11)
    alpha, rates = 0.2, {"easy": 0.98, "hard": 0.90}
    covs: dict[str, list[float]] = {g: [] for g in rates}
    expect: dict[str, list[float]] = {g: [] for g in rates}
    taus: dict[str, list[float]] = {g: [] for g in rates}
    for _ in range(300):
        parts = [_one_candidate(600, r, rng) for r in rates.values()]
        s, r, m = (np.concatenate([p[i] for p in parts]) for i in range(3))
        groups = np.repeat(list(rates), 600)
        perm = rng.permutation(1200)
        cal, test = perm[:600], perm[600:]
        model = ConformalRetriever(alpha, "any", threshold_rule="base_rate", beta=0.9).fit(
            s[cal], r[cal], m[cal], groups[cal].tolist()
        )
        out = coverage_and_size(
            s[test], r[test], m[test], model.thresholds_for(600, groups[test].tolist()), "any", 1000
        )
        for g, rate in rates.items():
            tau = model.groups_[g].threshold
            assert model.groups_[g].source == "own"
            covs[g].append(out["covered"][groups[test] == g].mean())
            expect[g].append(rate * min(tau, 1.0))
            taus[g].append(tau)
    for g in rates:
        band = float(np.mean(expect[g]))
        assert band >= 1 - alpha
        assert abs(np.mean(covs[g]) - band) <= 0.01, (g, np.mean(covs[g]), band)
    # the lower base rate needs the larger threshold
    assert np.mean(taus["hard"]) > np.mean(taus["easy"]) + 0.05


def test_unseen_group_gets_the_most_conservative_threshold_and_it_is_logged(caplog):
    rng = np.random.default_rng(12)
    s, r, m = _synthetic(300, 10, rng)
    s[200:] = s[200:] * 0.7  # group "c" scores lower: the largest threshold
    groups = ["a"] * 100 + ["b"] * 100 + ["c"] * 100
    model = ConformalRetriever(0.2, "any", min_group_size=50, threshold_rule="base_rate").fit(s, r, m, groups)
    own = {g: model.groups_[g].threshold for g in "abc"}
    assert max(own, key=own.__getitem__) == "c" and own["c"] > model.threshold_

    with caplog.at_level(logging.INFO, logger="judgeloop.retrieval.conformal"):
        assert model.group_threshold("d") == (own["c"], "most_conservative")
        assert model.group_threshold("d") == (own["c"], "most_conservative")  # logged once
        q = model.thresholds_for(3, ["a", "d", "b"])
    np.testing.assert_allclose(q, [own["a"], own["c"], own["b"]])
    assert [r.getMessage() for r in caplog.records] == [
        f"unseen group 'd' (no calibration data): the most conservative threshold, tau={own['c']:.4f} "
        "(from group 'c')"
    ]
    assert model.unseen_ == {"d": own["c"]}
    # not the global threshold, and a seen group keeps its own
    assert model.group_threshold("d")[0] != model.threshold_ and model.group_threshold("a") == (
        own["a"],
        "own",
    )


def test_set_size_cap_and_its_coverage_cost():
    scores = np.array([[0.9, 0.8, 0.7, 0.2], [0.6, 0.5, 0.4, 0.3]])
    rel = np.array([[False, False, True, False], [True, False, False, False]])
    missing = np.array([0, 1])
    q = np.array([0.35, math.inf])  # row 0: {0.9, 0.8, 0.7}; row 1: the whole corpus
    free = coverage_and_size(scores, rel, missing, q, "document", corpus_size=100)
    np.testing.assert_allclose(free["covered"], [1.0, 1.0])
    np.testing.assert_allclose(free["size"], [3.0, 100.0])
    capped = coverage_and_size(scores, rel, missing, q, "document", corpus_size=100, max_set_size=2)
    # row 0 keeps {0.9, 0.8}: loses its relevant third; row 1 keeps its top 2: 1 of its 2 relevant documents
    np.testing.assert_allclose(capped["covered"], [0.0, 0.5])
    np.testing.assert_allclose(capped["size"], [2.0, 2.0])
    np.testing.assert_array_equal(capped["capped"], [True, True])
    np.testing.assert_array_equal(capped["full"], [False, False])
    # a cap the sets never reach changes nothing
    same = coverage_and_size(scores, rel, missing, np.array([0.35, 0.35]), "document", 100, max_set_size=3)
    np.testing.assert_array_equal(same["capped"], [False, False])
    model = ConformalRetriever(0.5, "document", max_set_size=1).fit(scores, rel, np.zeros(2, int))
    assert model.predict(scores).sum(axis=1).max() <= 1
    with pytest.raises(ValueError, match="max_set_size=2 caps a retrieval set"):
        coverage_and_size(scores, rel, missing, q, "labels", 100, max_set_size=2)
    with pytest.raises(ValueError, match="max_set_size=0 must be >= 1"):
        ConformalRetriever(0.1, max_set_size=0)


def test_aci_set_size_alarm():
    """Scores drift up at t = 300: ACI widens its sets to keep coverage, and the set-size alarm says so."""
    rng = np.random.default_rng(13)
    stream = np.concatenate([rng.uniform(0, 0.5, 300), rng.uniform(0.4, 0.9, 700)])
    # each point's 50 candidates: nonconformity spread evenly over [0, 1], so size = 50 * threshold
    cands = [np.linspace(0, 1, 50)] * stream.size
    aci = AdaptiveConformal(0.1, 0.05, window=100, warmup=0, monitor_window=50, max_mean_set_size=30).fit(
        rng.uniform(0, 0.5, 100)
    )
    r = aci.run(stream, cands)
    assert r["size"][:300].mean() < 30 and r["size_alarm"][:300].sum() == 0
    assert r["size"][-300:].mean() > 30 and r["size_alarm"][-300:].all()
    quiet = AdaptiveConformal(0.1, 0.05, window=100, warmup=0, monitor_window=50).fit(
        rng.uniform(0, 0.5, 100)
    )
    assert quiet.run(stream, cands)["size_alarm"].sum() == 0
    clone = AdaptiveConformal().load_state_dict(aci.state_dict())
    assert clone.max_mean_set_size == 30 and clone.size_alarm
    with pytest.raises(ValueError, match="max_mean_set_size=0 must be > 0"):
        AdaptiveConformal(max_mean_set_size=0)


def test_quantile_buckets():
    labels = quantile_buckets(np.arange(9, dtype=float), 3, prefix="top1")
    assert labels.tolist() == ["top1/1"] * 3 + ["top1/2"] * 3 + ["top1/3"] * 3
    with pytest.raises(ValueError, match="num_buckets=0"):
        quantile_buckets(np.arange(3.0), 0)
