"""Weak-retrieval gate: cheap signals of what a retriever returned, selected and thresholded on calibration.

A retrieval is *weak* when some required evidence (a relevant document from qrels) is missing from
the window the system consumes (its top-k). The gate predicts weakness without an LLM, from signals
computed on the retrieved list itself (top score, spread, rank-1/rank-2 gap), from a second cheap
retrieval (BM25 or a second dense encoder: top-k overlap) or from the retrieved text (query-term
coverage). Signals are pluggable: :func:`register_signal`.

Selection on a calibration split (:func:`select_signals`): separation ``max(AUC, 1 - AUC)`` per
signal, keep those with separation >= ``min_separation``, drop any whose absolute Spearman
correlation with a stronger kept signal exceeds ``max_correlation``, and orient every kept signal so
that *lower means weaker*. The gate escalates (retrieve more, re-rank, ask for help) when the oriented
signal is at or below a threshold chosen at the Youden point (max TPR - FPR, Youden 1950) or at a
target recall of weak retrievals; optionally two kept signals are OR-combined.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from judgeloop.intervals import bootstrap_interval
from judgeloop.text import STOPWORDS

__all__ = [
    "SIGNALS",
    "GateInputs",
    "SignalStats",
    "WeakRetrievalGate",
    "auc",
    "bootstrap_auc",
    "compute_signals",
    "gate_metrics",
    "recall_threshold",
    "register_signal",
    "roc_points",
    "select_signals",
    "term_coverage",
    "weak_labels",
    "youden_threshold",
]


# ----------------------------------------------------------------------------------------------
# Labels and signals
# ----------------------------------------------------------------------------------------------


def weak_labels(retrieved_ids: Sequence[Sequence[str]], relevant: Sequence[set[str]], k: int) -> np.ndarray:
    """``(Q,)`` bool: the top-``k`` window misses at least one relevant document of the query."""
    out = np.zeros(len(retrieved_ids), dtype=bool)
    for i, (ids, rel) in enumerate(zip(retrieved_ids, relevant)):
        out[i] = not set(rel) <= set(list(ids)[:k])
    return out


@dataclass
class GateInputs:
    """What the retriever returned for Q queries (only the fields a signal needs must be set).

    Attributes:
        scores: ``(Q, k)`` primary retriever scores, best first.
        ids: ``(Q, k)`` primary retriever document ids.
        bm25_ids: ``(Q, k)`` BM25 top-k ids (for ``bm25_overlap``).
        dense2_ids: ``(Q, k)`` a second dense encoder's top-k ids (for ``dense_agreement``).
        queries: query texts (for ``term_coverage``).
        docs: per query, the retrieved texts of the window (for ``term_coverage``).
    """

    scores: np.ndarray
    ids: np.ndarray | None = None
    bm25_ids: np.ndarray | None = None
    dense2_ids: np.ndarray | None = None
    queries: Sequence[str] | None = None
    docs: Sequence[Sequence[str]] | None = None


def _need(value: Any, name: str, signal: str) -> Any:
    if value is None:
        raise ValueError(
            f"signal '{signal}' needs GateInputs.{name}; set it or drop '{signal}' from gate.signals"
        )
    return value


def _overlap(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Fraction of ``a``'s top-k ids also in ``b``'s top-k: ``(Q,)``."""
    return np.asarray([len(set(x.tolist()) & set(y.tolist())) / max(len(x), 1) for x, y in zip(a, b)])


_STOP = STOPWORDS | frozenset(
    ["can", "do", "does", "into", "may", "without"]
)  # plus the words questions are made of
_TOKEN = re.compile(r"[a-z0-9]+(?:[-'][a-z0-9]+)*")


def content_terms(text: str) -> set[str]:
    """Lower-cased word tokens of length >= 3 minus a small English stop list."""
    return {t for t in _TOKEN.findall(text.lower()) if len(t) >= 3 and t not in _STOP}


def term_coverage(queries: Sequence[str], docs: Sequence[Sequence[str]]) -> np.ndarray:
    """``(Q,)`` fraction of each query's content terms that occur in its retrieved texts (1.0 if none)."""
    out = np.ones(len(queries))
    for i, (q, window) in enumerate(zip(queries, docs)):
        terms = content_terms(q)
        if terms:
            seen = set().union(*(content_terms(d) for d in window)) if window else set()
            out[i] = len(terms & seen) / len(terms)
    return out


@dataclass
class SignalSpec:
    """A weak-retrieval signal: how to compute it and its extra cost per query."""

    fn: Callable[[GateInputs], np.ndarray]
    cost: str  # extra work per query beyond the primary retrieval


SIGNALS: dict[str, SignalSpec] = {
    "max_score": SignalSpec(lambda x: np.asarray(x.scores)[:, 0], "none"),
    "score_std": SignalSpec(lambda x: np.asarray(x.scores).std(axis=1), "none"),
    "score_range": SignalSpec(lambda x: np.asarray(x.scores)[:, 0] - np.asarray(x.scores)[:, -1], "none"),
    "top_gap": SignalSpec(lambda x: np.asarray(x.scores)[:, 0] - np.asarray(x.scores)[:, 1], "none"),
    "bm25_overlap": SignalSpec(
        lambda x: _overlap(
            _need(x.ids, "ids", "bm25_overlap"), _need(x.bm25_ids, "bm25_ids", "bm25_overlap")
        ),
        "1 BM25 retrieval per query (plus a BM25 index of the corpus)",
    ),
    "dense_agreement": SignalSpec(
        lambda x: _overlap(
            _need(x.ids, "ids", "dense_agreement"), _need(x.dense2_ids, "dense2_ids", "dense_agreement")
        ),
        "1 extra query encoding + 1 dense search per query (plus a second corpus index)",
    ),
    "term_coverage": SignalSpec(
        lambda x: term_coverage(
            _need(x.queries, "queries", "term_coverage"), _need(x.docs, "docs", "term_coverage")
        ),
        "none (string matching on the retrieved text)",
    ),
}


def register_signal(name: str, fn: Callable[[GateInputs], np.ndarray], cost: str = "none") -> None:
    """Add a signal: ``fn(inputs) -> (Q,)`` floats; ``cost`` describes its extra work per query."""
    SIGNALS[name] = SignalSpec(fn, cost)


def compute_signals(inputs: GateInputs, names: Sequence[str]) -> dict[str, np.ndarray]:
    """``{name: (Q,)}`` for the requested signals."""
    out = {}
    for name in names:
        if name not in SIGNALS:
            import difflib

            close = difflib.get_close_matches(name, list(SIGNALS), n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            raise ValueError(f"unknown gate signal '{name}'{hint} (known: {sorted(SIGNALS)})")
        out[name] = np.asarray(SIGNALS[name].fn(inputs), dtype=np.float64)
    return out


# ----------------------------------------------------------------------------------------------
# ROC machinery
# ----------------------------------------------------------------------------------------------


def auc(score: np.ndarray, positive: np.ndarray) -> float:
    """ROC AUC = P(score of a random positive > score of a random negative) + 0.5 P(tie).

    Mann-Whitney U via mid-ranks (Hanley & McNeil 1982); NaN when one class is empty.
    """
    from scipy.stats import rankdata

    s = np.asarray(score, dtype=np.float64)
    y = np.asarray(positive, dtype=bool)
    n_pos, n_neg = int(y.sum()), int((~y).sum())
    if n_pos == 0 or n_neg == 0:
        return math.nan
    ranks = rankdata(s)
    return float((ranks[y].sum() - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


def bootstrap_auc(
    score: np.ndarray,
    positive: np.ndarray,
    num_resamples: int = 1000,
    confidence: float = 0.95,
    seed: int = 0,
) -> tuple[float, float]:
    """Percentile bootstrap CI for :func:`auc` (resampling queries with replacement;
    :func:`judgeloop.intervals.bootstrap_interval`)."""
    s = np.asarray(score, dtype=np.float64)
    y = np.asarray(positive, dtype=bool)
    return bootstrap_interval(lambda idx: auc(s[idx], y[idx]), s.size, num_resamples, confidence, seed)


def roc_points(signal: np.ndarray, weak: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For the rule "flag weak when ``signal <= t``", every distinct ``t`` with its TPR and FPR.

    Returns ``(thresholds, tpr, fpr)`` with thresholds ascending; TPR = recall of weak retrievals,
    FPR = share of good retrievals flagged.
    """
    s = np.asarray(signal, dtype=np.float64)
    y = np.asarray(weak, dtype=bool)
    n_pos, n_neg = int(y.sum()), int((~y).sum())
    if n_pos == 0 or n_neg == 0:
        raise ValueError(
            f"calibration split has one class only ({n_pos} weak, {n_neg} good retrievals); "
            "need both to choose a gate threshold"
        )
    t = np.unique(s)
    tpr = np.searchsorted(np.sort(s[y]), t, side="right") / n_pos
    fpr = np.searchsorted(np.sort(s[~y]), t, side="right") / n_neg
    return t, tpr, fpr


def youden_threshold(signal: np.ndarray, weak: np.ndarray) -> float:
    """Threshold maximizing Youden's J = TPR - FPR for "weak when ``signal <= t``" (ties: the lowest t)."""
    t, tpr, fpr = roc_points(signal, weak)
    return float(t[int(np.argmax(tpr - fpr))])


def recall_threshold(signal: np.ndarray, weak: np.ndarray, target_recall: float) -> float:
    """Lowest threshold whose recall of weak retrievals reaches ``target_recall`` (least escalation)."""
    if not 0.0 < target_recall <= 1.0:
        raise ValueError(f"target_recall={target_recall} must be in (0, 1]")
    t, tpr, _ = roc_points(signal, weak)
    ok = np.nonzero(tpr >= target_recall - 1e-12)[0]
    return float(t[ok[0]])


def _spearman(a: np.ndarray, b: np.ndarray) -> float:
    from scipy.stats import spearmanr

    if np.ptp(a) == 0 or np.ptp(b) == 0:
        return 0.0
    return float(spearmanr(a, b).statistic)


# ----------------------------------------------------------------------------------------------
# Selection and the gate
# ----------------------------------------------------------------------------------------------


@dataclass
class SignalStats:
    """A signal's separation of weak from good retrievals on the calibration split."""

    name: str
    auc: float  # AUC of the raw signal for *good* (non-weak) retrievals
    separation: float
    orientation: int  # +1: lower raw value = weaker; -1: the signal is negated
    kept: bool = False
    reason: str = ""


def select_signals(
    signals: Mapping[str, np.ndarray],
    weak: np.ndarray,
    min_separation: float = 0.65,
    max_correlation: float = 0.85,
) -> list[SignalStats]:
    """Per-signal separation on calibration data, the kept set, and why the others were dropped.

    Returns the stats sorted by separation (strongest first).
    """
    y = np.asarray(weak, dtype=bool)
    stats = []
    for name, values in signals.items():
        a = auc(values, ~y)
        if math.isnan(a):
            raise ValueError(
                f"calibration split has one class only ({int(y.sum())} weak of {y.size}); "
                "need weak and good retrievals to select gate signals"
            )
        stats.append(SignalStats(name, a, max(a, 1 - a), 1 if a >= 0.5 else -1))
    stats.sort(key=lambda s: -s.separation)
    kept: list[SignalStats] = []
    for st in stats:
        if st.separation < min_separation:
            st.reason = f"separation {st.separation:.3f} < min_separation {min_separation}"
            continue
        clash = next(
            (k for k in kept if abs(_spearman(signals[st.name], signals[k.name])) > max_correlation), None
        )
        if clash is not None:
            rho = _spearman(signals[st.name], signals[clash.name])
            st.reason = f"|spearman| {abs(rho):.3f} > {max_correlation} with stronger '{clash.name}'"
            continue
        st.kept = True
        kept.append(st)
    return stats


@dataclass
class GateState:
    """A fitted gate: its signals, their orientation and thresholds."""

    signals: list[str] = field(default_factory=list)
    orientation: dict[str, int] = field(default_factory=dict)
    thresholds: dict[str, float] = field(default_factory=dict)


class WeakRetrievalGate:
    """Escalate when (oriented) signal <= threshold; OR-combine two signals when ``combine="or"``.

    Args:
        min_separation: keep signals with ``max(AUC, 1 - AUC)`` at least this on calibration data.
        max_correlation: drop a signal correlated beyond this (|Spearman|) with a stronger kept one.
        threshold_rule: ``"youden"`` or ``"recall"`` (lowest threshold reaching ``target_recall``).
        combine: ``"single"`` (the strongest kept signal) or ``"or"`` (the two strongest kept, flag if
            either fires; thresholds chosen jointly on a grid of calibration quantiles).

    Learned attributes: ``stats_`` (all signals), ``state_`` (:class:`GateState`).
    """

    # the settings a saved gate carries (state_dict) and restores (load_state_dict)
    _SAVED_SETTINGS = ("min_separation", "max_correlation", "threshold_rule", "target_recall", "combine")

    def __init__(
        self,
        min_separation: float = 0.65,
        max_correlation: float = 0.85,
        threshold_rule: Literal["youden", "recall"] = "youden",
        target_recall: float = 0.8,
        combine: Literal["single", "or"] = "single",
        grid_size: int = 41,
    ) -> None:
        if not 0.5 <= min_separation <= 1.0:
            raise ValueError(f"min_separation={min_separation} must be in [0.5, 1]; 0.5 keeps every signal")
        if not 0.0 < max_correlation <= 1.0:
            raise ValueError(f"max_correlation={max_correlation} must be in (0, 1]")
        if threshold_rule not in ("youden", "recall"):
            raise ValueError(f"threshold_rule={threshold_rule!r} must be 'youden' or 'recall'")
        if combine not in ("single", "or"):
            raise ValueError(f"combine={combine!r} must be 'single' or 'or'")
        self.min_separation = min_separation
        self.max_correlation = max_correlation
        self.threshold_rule = threshold_rule
        self.target_recall = target_recall
        self.combine = combine
        self.grid_size = grid_size

    def _threshold(self, signal: np.ndarray, weak: np.ndarray) -> float:
        if self.threshold_rule == "youden":
            return youden_threshold(signal, weak)
        return recall_threshold(signal, weak, self.target_recall)

    def fit(self, signals: Mapping[str, np.ndarray], weak: np.ndarray) -> WeakRetrievalGate:
        y = np.asarray(weak, dtype=bool)
        self.stats_ = select_signals(signals, y, self.min_separation, self.max_correlation)
        kept = [s for s in self.stats_ if s.kept]
        if not kept:
            best = self.stats_[0] if self.stats_ else None
            raise ValueError(
                f"no gate signal reaches min_separation={self.min_separation} on the calibration split"
                + (f" (best: '{best.name}' {best.separation:.3f})" if best else "")
                + "; lower gate.min_separation or add stronger signals"
            )
        oriented = {s.name: s.orientation * np.asarray(signals[s.name], dtype=np.float64) for s in kept}
        state = GateState(orientation={s.name: s.orientation for s in kept})
        if self.combine == "or" and len(kept) >= 2:
            a, b = kept[0].name, kept[1].name
            ta, tb = self._joint_thresholds(oriented[a], oriented[b], y)
            state.signals, state.thresholds = [a, b], {a: ta, b: tb}
        else:
            a = kept[0].name
            state.signals, state.thresholds = [a], {a: self._threshold(oriented[a], y)}
        self.state_ = state
        return self

    def _joint_thresholds(self, a: np.ndarray, b: np.ndarray, weak: np.ndarray) -> tuple[float, float]:
        # candidate thresholds: quantiles of each signal plus "never fires" (-inf)
        qs = np.linspace(0.0, 1.0, self.grid_size)
        grid_a = np.concatenate([[-math.inf], np.unique(np.quantile(a, qs))])
        grid_b = np.concatenate([[-math.inf], np.unique(np.quantile(b, qs))])
        fa = a[None, :] <= grid_a[:, None]  # (Ga, Q)
        fb = b[None, :] <= grid_b[:, None]  # (Gb, Q)
        flag = fa[:, None, :] | fb[None, :, :]  # (Ga, Gb, Q)
        n_pos, n_neg = int(weak.sum()), int((~weak).sum())
        tpr = (flag & weak).sum(-1) / n_pos
        fpr = (flag & ~weak).sum(-1) / n_neg
        if self.threshold_rule == "youden":
            i, j = np.unravel_index(np.argmax(tpr - fpr), tpr.shape)
        else:
            rate = flag.mean(-1)
            cost = np.where(tpr >= self.target_recall - 1e-12, rate, np.inf)
            i, j = np.unravel_index(np.argmin(cost), cost.shape)
        return float(grid_a[i]), float(grid_b[j])

    def predict(self, signals: Mapping[str, np.ndarray]) -> np.ndarray:
        """``(Q,)`` bool: escalate (the retrieval looks weak)."""
        if not hasattr(self, "state_"):
            raise RuntimeError("WeakRetrievalGate is not fitted; call fit(...) first")
        flag = None
        for name in self.state_.signals:
            if name not in signals:
                raise ValueError(f"gate needs signal '{name}' at predict time; got {sorted(signals)}")
            x = self.state_.orientation[name] * np.asarray(signals[name], dtype=np.float64)
            f = x <= self.state_.thresholds[name]
            flag = f if flag is None else flag | f
        assert flag is not None
        return flag

    def state_dict(self) -> dict[str, Any]:
        return {
            **{key: getattr(self, key) for key in self._SAVED_SETTINGS},
            "stats_": [vars(s) for s in getattr(self, "stats_", [])],
            "state_": vars(self.state_) if hasattr(self, "state_") else None,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> WeakRetrievalGate:
        for key in self._SAVED_SETTINGS:
            setattr(self, key, state[key])
        self.stats_ = [SignalStats(**s) for s in state["stats_"]]
        if state["state_"] is not None:
            st = state["state_"]
            self.state_ = GateState(
                list(st["signals"]),
                {k: int(v) for k, v in st["orientation"].items()},
                {k: (-math.inf if v is None else float(v)) for k, v in st["thresholds"].items()},
            )
        return self


def gate_metrics(escalate: np.ndarray, weak: np.ndarray) -> dict[str, float]:
    """Precision and recall of the gate for weak retrievals, and its escalation rate."""
    e = np.asarray(escalate, dtype=bool)
    y = np.asarray(weak, dtype=bool)
    tp = int((e & y).sum())
    return {
        "precision": tp / int(e.sum()) if e.any() else math.nan,
        "recall": tp / int(y.sum()) if y.any() else math.nan,
        "escalation_rate": float(e.mean()) if e.size else math.nan,
        "weak_rate": float(y.mean()) if y.size else math.nan,
        "num_escalated": int(e.sum()),
        "num_queries": int(e.size),
    }
