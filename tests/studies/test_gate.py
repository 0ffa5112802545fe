"""Weak-retrieval gate: AUC, Youden point on a known ROC, signal selection, the fitted gate."""

from __future__ import annotations

import math

import numpy as np
import pytest

from judgeloop.retrieval.gate import (
    GateInputs,
    WeakRetrievalGate,
    auc,
    bootstrap_auc,
    compute_signals,
    gate_metrics,
    recall_threshold,
    register_signal,
    roc_points,
    select_signals,
    term_coverage,
    weak_labels,
    youden_threshold,
)


def test_auc_matches_sklearn_with_ties():
    from sklearn.metrics import roc_auc_score

    rng = np.random.default_rng(0)
    s = rng.integers(0, 5, 200).astype(float)  # many ties
    y = rng.random(200) < 0.3
    assert auc(s, y) == pytest.approx(roc_auc_score(y, s))
    assert math.isnan(auc(s, np.ones(200, bool)))


def test_youden_on_known_roc():
    # weak retrievals have low signal. Flag "weak" when signal <= t.
    weak = np.array([1, 1, 1, 1, 0, 0, 0, 0, 0, 0], dtype=bool)
    signal = np.array([0.1, 0.2, 0.3, 0.6, 0.4, 0.5, 0.7, 0.8, 0.9, 1.0])
    t, tpr, fpr = roc_points(signal, weak)
    # by hand: t=0.3 -> TPR 3/4, FPR 0 (J = .75); t=0.6 -> TPR 1, FPR 2/6 (J = .667); t=0.5 -> J = .75 - 2/6
    j = dict(zip(t.round(3), (tpr - fpr).round(4)))
    assert (
        j[0.3] == 0.75
        and j[0.6] == pytest.approx(0.6667, abs=1e-4)
        and j[0.5] == pytest.approx(0.4167, abs=1e-4)
    )
    assert youden_threshold(signal, weak) == pytest.approx(0.3)
    # target recall 1.0 needs t = 0.6 (the weak one at 0.6); 0.5 recall needs only t = 0.2
    assert recall_threshold(signal, weak, 1.0) == pytest.approx(0.6)
    assert recall_threshold(signal, weak, 0.5) == pytest.approx(0.2)
    with pytest.raises(ValueError, match="one class only"):
        roc_points(signal, np.zeros(10, bool))
    with pytest.raises(ValueError, match="target_recall=0"):
        recall_threshold(signal, weak, 0.0)


def _signals(n: int, rng: np.random.Generator):
    weak = rng.random(n) < 0.3
    strong_sig = rng.normal(0, 1, n) - 1.5 * weak  # low when weak
    inverted = rng.normal(0, 1, n) + 1.2 * weak  # high when weak (must be negated)
    copy = strong_sig + rng.normal(0, 0.05, n)  # near-duplicate of strong_sig
    noise = rng.normal(0, 1, n)
    return weak, {"strong": strong_sig, "inverted": inverted, "copy": copy, "noise": noise}


def test_select_signals_separation_orientation_and_correlation():
    rng = np.random.default_rng(1)
    weak, sig = _signals(2000, rng)
    stats = {s.name: s for s in select_signals(sig, weak, min_separation=0.65, max_correlation=0.85)}
    twin = max(("strong", "copy"), key=lambda k: stats[k].separation)  # equally strong up to noise
    assert stats[twin].kept and stats[twin].orientation == 1
    assert stats["inverted"].kept and stats["inverted"].orientation == -1
    assert stats["inverted"].auc < 0.35
    assert not stats["noise"].kept and "min_separation" in stats["noise"].reason
    weaker_twin = min(("strong", "copy"), key=lambda k: stats[k].separation)
    assert not stats[weaker_twin].kept and "spearman" in stats[weaker_twin].reason


def test_gate_fit_predict_single_and_or():
    rng = np.random.default_rng(2)
    weak, sig = _signals(3000, rng)
    cal = slice(0, 1500)
    test = slice(1500, 3000)
    single = WeakRetrievalGate().fit({k: v[cal] for k, v in sig.items()}, weak[cal])
    assert single.state_.signals in (["strong"], ["copy"])
    m1 = gate_metrics(single.predict({k: v[test] for k, v in sig.items()}), weak[test])
    assert m1["recall"] > 0.6 and m1["precision"] > 0.5
    both = WeakRetrievalGate(combine="or").fit({k: v[cal] for k, v in sig.items()}, weak[cal])
    assert len(both.state_.signals) == 2 and "inverted" in both.state_.signals
    m2 = gate_metrics(both.predict({k: v[test] for k, v in sig.items()}), weak[test])
    # two independent signals beat one on Youden's J
    j1 = m1["recall"] - (m1["num_escalated"] - m1["recall"] * weak[test].sum()) / (~weak[test]).sum()
    j2 = m2["recall"] - (m2["num_escalated"] - m2["recall"] * weak[test].sum()) / (~weak[test]).sum()
    assert j2 > j1
    rec = WeakRetrievalGate(threshold_rule="recall", target_recall=0.9, combine="or").fit(
        {k: v[cal] for k, v in sig.items()}, weak[cal]
    )
    assert gate_metrics(rec.predict({k: v[cal] for k, v in sig.items()}), weak[cal])["recall"] >= 0.9
    clone = WeakRetrievalGate().load_state_dict(both.state_dict())
    np.testing.assert_array_equal(clone.predict(sig), both.predict(sig))


def test_gate_errors():
    rng = np.random.default_rng(3)
    weak = rng.random(200) < 0.5
    with pytest.raises(ValueError, match="no gate signal reaches min_separation=0.65"):
        WeakRetrievalGate().fit({"noise": rng.normal(size=200)}, weak)
    with pytest.raises(ValueError, match="one class only"):
        select_signals({"x": rng.normal(size=10)}, np.zeros(10, bool))
    with pytest.raises(ValueError, match="min_separation=0.3"):
        WeakRetrievalGate(min_separation=0.3)
    with pytest.raises(RuntimeError, match="not fitted"):
        WeakRetrievalGate().predict({})


def test_signals_from_retrieved_lists():
    inputs = GateInputs(
        scores=np.array([[0.9, 0.5, 0.4], [0.6, 0.59, 0.58]]),
        ids=np.array([["a", "b", "c"], ["d", "e", "f"]]),
        bm25_ids=np.array([["a", "x", "c"], ["y", "z", "w"]]),
        dense2_ids=np.array([["c", "b", "a"], ["d", "q", "r"]]),
        queries=["Vitamin D lowers fracture risk", "the of and"],
        docs=[["vitamin d and bone fracture", "risk"], ["nothing"]],
    )
    sig = compute_signals(
        inputs, ["max_score", "top_gap", "score_range", "bm25_overlap", "dense_agreement", "term_coverage"]
    )
    np.testing.assert_allclose(sig["max_score"], [0.9, 0.6])
    np.testing.assert_allclose(sig["top_gap"], [0.4, 0.01])
    np.testing.assert_allclose(sig["score_range"], [0.5, 0.02])
    np.testing.assert_allclose(sig["bm25_overlap"], [2 / 3, 0])
    np.testing.assert_allclose(sig["dense_agreement"], [1.0, 1 / 3])
    # terms: vitamin, lowers, fracture, risk ("d" too short) -> 3 of 4 seen; no content terms -> 1.0
    np.testing.assert_allclose(sig["term_coverage"], [0.75, 1.0])
    with pytest.raises(ValueError, match="unknown gate signal 'max_scor'; did you mean 'max_score'"):
        compute_signals(inputs, ["max_scor"])
    with pytest.raises(ValueError, match="needs GateInputs.bm25_ids"):
        compute_signals(GateInputs(scores=inputs.scores, ids=inputs.ids), ["bm25_overlap"])
    register_signal("neg_max", lambda x: -np.asarray(x.scores)[:, 0])
    np.testing.assert_allclose(compute_signals(inputs, ["neg_max"])["neg_max"], [-0.9, -0.6])
    assert term_coverage(["alpha beta"], [[]]).tolist() == [0.0]


def test_weak_labels_and_bootstrap():
    w = weak_labels([["a", "b", "c"], ["a", "b", "c"]], [{"a", "c"}, {"a", "z"}], k=2)
    assert w.tolist() == [True, True]
    assert weak_labels([["a", "b"]], [{"b"}], k=2).tolist() == [False]
    rng = np.random.default_rng(4)
    y = rng.random(300) < 0.4
    s = rng.normal(size=300) + y
    lo, hi = bootstrap_auc(s, y, num_resamples=200)
    assert lo < auc(s, y) < hi
