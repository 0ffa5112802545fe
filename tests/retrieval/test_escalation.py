"""The gate's escalations: reciprocal rank fusion by hand, flagged-only application, the cost per 100
queries, query expansion, and the one bootstrap interval of a mean."""

from __future__ import annotations

import math

import numpy as np
import pytest

from judgeloop.intervals import bootstrap_mean_interval
from judgeloop.retrieval.escalation import apply_escalation, escalation_cost, expand_query, rrf_fuse


def test_rrf_by_hand():
    # k = 1: d0 = 1/2 + 1/4 = .75, d1 = 1/3 + 1/2 = .8333, d2 = 1/4, d3 = 1/3
    assert rrf_fuse([[0, 1, 2], [1, 3, 0]], k=1.0) == [1, 0, 3, 2]
    # k = 60: equal contributions tie d0 and d1; the first ranking's order breaks it
    assert rrf_fuse([[0, 1], [1, 0]], k=60.0) == [0, 1]
    assert rrf_fuse([[5, 4, 3], [4, 9]], depth=2) == [4, 5]
    assert rrf_fuse([[], []]) == []
    with pytest.raises(ValueError, match="rrf_k=-1"):
        rrf_fuse([[0]], k=-1)


def test_escalation_applies_to_flagged_queries_only():
    before = [[0, 1], [2, 3], [4, 5]]
    esc = [[9, 8], [7, 6], [5, 4]]
    flagged = np.array([False, True, False])
    assert apply_escalation(before, esc, flagged) == [[0, 1], [7, 6], [4, 5]]
    assert apply_escalation(before, None, flagged) == [[0, 1], [], [4, 5]]  # abstention
    with pytest.raises(ValueError, match=r"flagged has shape \(2,\) for 3 rankings"):
        apply_escalation(before, esc, np.array([True, False]))


def test_escalation_cost_per_100_queries():
    assert escalation_cost("fuse", 25, 200) == {"retrievals": 12.5, "model_calls": 0.0, "escalated": 12.5}
    assert escalation_cost("rewrite", 200, 200) == {
        "retrievals": 100.0,
        "model_calls": 100.0,
        "escalated": 100.0,
    }
    assert escalation_cost("abstain", 50, 100)["retrievals"] == 0.0
    with pytest.raises(ValueError, match="escalation.method='rerank' is not one of"):
        escalation_cost("rerank", 1, 2)  # type: ignore[arg-type]


def test_expand_query_keeps_the_original():
    assert (
        expand_query("vitamin d bone", " calcitriol; osteoporosis\nmore text")
        == "vitamin d bone calcitriol; osteoporosis"
    )
    assert expand_query("q", "  \n") == "q"


def test_bootstrap_mean_interval():
    rng = np.random.default_rng(0)
    x = rng.normal(0.3, 1.0, 400)
    lo, hi = bootstrap_mean_interval(x, 2000, seed=1)
    se = x.std(ddof=1) / math.sqrt(x.size)
    assert lo < x.mean() < hi
    assert hi - lo == pytest.approx(2 * 1.96 * se, rel=0.1)  # the normal-theory width
    assert bootstrap_mean_interval(x, 500, seed=3) == bootstrap_mean_interval(x, 500, seed=3)
    assert bootstrap_mean_interval([1.0, float("nan"), 1.0]) == (1.0, 1.0)
    assert all(math.isnan(v) for v in bootstrap_mean_interval([float("nan")]))
    with pytest.raises(ValueError, match="confidence=1.5"):
        bootstrap_mean_interval(x, confidence=1.5)
