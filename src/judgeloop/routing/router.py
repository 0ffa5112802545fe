"""Routing policies over precomputed outcomes: the confidence router and its four baselines.

For every question we hold both outcomes (closed-book answer from the probe, retrieval-augmented
answer) with their scores and costs; a policy is a boolean "retrieve" per question. That makes the
comparison exact: every policy is scored on the same answers.

Costs: answering closed-book costs the probe; answering with retrieval costs the RAG answer, plus the
probe for policies that need it to decide (the confidence router, and, for comparability, the
oracle). ``always`` pays only the RAG answer; ``random`` (retrieval count matched to the router) pays
what it uses, and its scores and costs are the exact expectation over random subsets of that size.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass
class RoutingOutcomes:
    """Per-question arrays ``(Q,)`` (``confidence`` is NaN where the probe gave none)."""

    confidence: np.ndarray
    em_closed: np.ndarray
    f1_closed: np.ndarray
    em_rag: np.ndarray
    f1_rag: np.ndarray
    tokens_probe: np.ndarray
    tokens_rag: np.ndarray
    latency_probe: np.ndarray
    latency_rag: np.ndarray
    passages_rag: np.ndarray

    def subset(self, idx: np.ndarray) -> RoutingOutcomes:
        return RoutingOutcomes(**{k: np.asarray(v)[idx] for k, v in vars(self).items()})


class ConfidenceRouter:
    """Retrieve when the probe's confidence is below ``threshold_`` (or missing).

    Args:
        max_retrieval_rate: optional budget; the threshold maximizes F1 among thresholds whose
            retrieval rate on the selection split stays within it.

    Learned attribute: ``threshold_`` (``-inf``: retrieve only when the confidence is missing;
    ``+inf``: always retrieve).
    """

    def __init__(self, max_retrieval_rate: float | None = None) -> None:
        if max_retrieval_rate is not None and not 0.0 <= max_retrieval_rate <= 1.0:
            raise ValueError(f"max_retrieval_rate={max_retrieval_rate} must be in [0, 1] or None")
        self.max_retrieval_rate = max_retrieval_rate

    @staticmethod
    def route(confidence: np.ndarray, threshold: float) -> np.ndarray:
        """``(Q,)`` bool: retrieve. NaN confidence (unparseable or missing) always retrieves."""
        c = np.asarray(confidence, dtype=np.float64)
        return ~(c >= threshold)  # NaN >= t is False -> retrieve

    def fit(self, confidence: np.ndarray, f1_closed: np.ndarray, f1_rag: np.ndarray) -> ConfidenceRouter:
        c = np.asarray(confidence, dtype=np.float64)
        if c.size == 0:
            raise ValueError("the threshold-selection split is empty; give the router some questions")
        finite = np.unique(c[np.isfinite(c)])
        # t = -inf keeps every confident answer; t just above a value retrieves it and everything below
        candidates = np.concatenate([[-math.inf], np.nextafter(finite, math.inf), [math.inf]])
        best: tuple[float, float, float] | None = None  # (f1, -rate, threshold)
        for t in candidates:
            r = self.route(c, t)
            rate = float(r.mean())
            if self.max_retrieval_rate is not None and rate > self.max_retrieval_rate + 1e-12:
                continue
            f1 = float(np.where(r, f1_rag, f1_closed).mean())
            key = (f1, -rate, float(t))
            if best is None or key[:2] > best[:2]:
                best = key
        if best is None:
            raise ValueError(
                f"no threshold keeps the retrieval rate within max_retrieval_rate={self.max_retrieval_rate} "
                f"({int(np.isnan(c).sum())} of {c.size} questions have no confidence and must retrieve); "
                "raise the budget"
            )
        self.threshold_ = best[2]
        self.selection_f1_ = best[0]
        self.selection_retrieval_rate_ = -best[1]
        return self

    def predict(self, confidence: np.ndarray) -> np.ndarray:
        if not hasattr(self, "threshold_"):
            raise RuntimeError("ConfidenceRouter is not fitted; call fit(...) on the selection split first")
        return self.route(confidence, self.threshold_)

    def state_dict(self) -> dict[str, Any]:
        return {
            "max_retrieval_rate": self.max_retrieval_rate,
            "threshold_": getattr(self, "threshold_", None),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> ConfidenceRouter:
        self.max_retrieval_rate = state["max_retrieval_rate"]
        if state["threshold_"] is not None:
            self.threshold_ = float(state["threshold_"])
        return self


def _policy(o: RoutingOutcomes, retrieve: np.ndarray, pays_probe: bool) -> dict[str, float]:
    r = np.asarray(retrieve, dtype=bool)
    probe_on_rag = o.tokens_probe if pays_probe else 0.0
    probe_lat_on_rag = o.latency_probe if pays_probe else 0.0
    tokens = np.where(r, o.tokens_rag + probe_on_rag, o.tokens_probe)
    latency = np.where(r, o.latency_rag + probe_lat_on_rag, o.latency_probe)
    return {
        "exact_match": float(np.where(r, o.em_rag, o.em_closed).mean()),
        "f1": float(np.where(r, o.f1_rag, o.f1_closed).mean()),
        "retrieval_rate": float(r.mean()),
        "passages_retrieved": float(np.where(r, o.passages_rag, 0).sum()),
        "total_tokens": float(tokens.sum()),
        "tokens_per_question": float(tokens.mean()),
        "latency_s_per_question": float(latency.mean()),
    }


def routing_table(o: RoutingOutcomes, retrieve: np.ndarray) -> dict[str, dict[str, float]]:
    """Metrics of the router (``retrieve``) and the four baselines on the same questions."""
    n = o.f1_closed.size
    r = np.asarray(retrieve, dtype=bool)
    never = _policy(o, np.zeros(n, bool), pays_probe=False)
    always = _policy(o, np.ones(n, bool), pays_probe=False)
    p = float(r.mean())
    # random routing with the router's retrieval count: the exact expectation over random subsets
    random = {k: (1 - p) * never[k] + p * always[k] for k in never}
    random["retrieval_rate"] = p
    oracle_r = o.f1_rag > o.f1_closed  # ties: no retrieval (cheaper)
    table = {
        "router": _policy(o, r, pays_probe=True),
        "never": never,
        "always": always,
        "random_matched": random,
        "oracle": _policy(o, oracle_r, pays_probe=True),
    }
    return table
