"""The study behind ``judgeloop gate``: fit the weak-retrieval gate on a calibration split of a BEIR
data set, report on test.

The primary retriever is a dense encoder; its top-``window_k`` is the window the system consumes.
A retrieval is weak when a relevant document (qrels) is missing from that window. Signals come from
the primary list, a BM25 retrieval (bm25s), a second dense encoder (by default the same MiniLM with
CLS pooling, a cheap "second opinion" that shares the weights), and the retrieved text.
:func:`gate_study` returns the report and the fitted gate. With ``escalation.method`` set, the gate acts:
the test queries it flags are escalated (:mod:`judgeloop.studies.escalation`) and the report gains an
``escalation`` block.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from judgeloop.config import bounded, check_choices, check_fields
from judgeloop.logging import get_logger
from judgeloop.retrieval.bm25 import bm25_topk, build_bm25
from judgeloop.retrieval.dense import EncoderConfig, RetrievalDataConfig, load_retrieval_data, retrieve_dense
from judgeloop.retrieval.gate import (
    SIGNALS,
    GateInputs,
    WeakRetrievalGate,
    auc,
    bootstrap_auc,
    compute_signals,
    gate_metrics,
    select_signals,
)
from judgeloop.studies.escalation import (
    EscalationSection,
    check_escalation,
    escalation_report,
    render_escalation,
)
from judgeloop.text import fmt_number

logger = get_logger(__name__)

DEFAULT_SIGNALS = [
    "max_score",
    "score_std",
    "score_range",
    "top_gap",
    "bm25_overlap",
    "dense_agreement",
    "term_coverage",
]


@dataclass
class GateSection:
    """How the gate is chosen: window, signal selection, threshold rule, combination."""

    signals: list[str] = field(default_factory=lambda: list(DEFAULT_SIGNALS))
    window_k: int = bounded(10, ge=2, hint=" (top_gap needs two results)", shape="section")
    min_separation: float = bounded(
        0.65, ge=0.5, le=1, hint=" (a signal's max(AUC, 1 - AUC); 0.5 keeps every signal)"
    )
    max_correlation: float = bounded(
        0.85, ge=0, le=1, hint=" (an absolute Spearman correlation; 1 drops none)"
    )
    threshold_rule: Literal["youden", "recall"] = "youden"
    target_recall: float = bounded(0.8, gt=0, le=1, hint=" (the share of weak retrievals the gate must flag)")
    combine: Literal["single", "or"] = "single"
    num_bootstrap: int = bounded(1000, ge=0)

    def __post_init__(self) -> None:
        check_fields("gate", self)
        from judgeloop.retrieval.gate import SIGNALS

        check_choices("gate.signals", self.signals, sorted(SIGNALS))


@dataclass
class GateConfig:
    """Schema of ``judgeloop gate``."""

    data: RetrievalDataConfig = field(default_factory=RetrievalDataConfig)
    encoder: EncoderConfig = field(default_factory=EncoderConfig)
    second_encoder: EncoderConfig = field(default_factory=lambda: EncoderConfig(pooling="cls", max_length=64))
    gate: GateSection = field(default_factory=GateSection)
    escalation: EscalationSection = field(default_factory=EscalationSection)
    calibration_fraction: float = bounded(0.5, gt=0.0, lt=1.0, hint="; e.g. 0.5", shape="section")
    seed: int = bounded(0, ge=0, le=2**32 - 1)
    output_dir: str = "runs/gate"
    overwrite: bool = False  # true: clear an output_dir that holds another run (judgeloop.rundir)
    cache_dir: str | None = "auto"  # the judgeloop cache (embedding_cache.resolve_cache_dir); None: none

    def __post_init__(self) -> None:
        check_fields("", self)


def gate_signals(cfg: GateConfig, beir: Any, rq: Any) -> tuple[dict[str, np.ndarray], dict[str, float]]:
    """Every configured signal per query, and the measured extra seconds per query of the costly ones."""
    g = cfg.gate
    inputs = GateInputs(
        scores=rq.raw_scores,
        ids=rq.indices,
        queries=rq.query_texts,
        docs=[[rq.doc_texts[j] for j in row] for row in rq.indices],
    )
    timing: dict[str, float] = {}
    if "bm25_overlap" in g.signals:
        index = build_bm25(rq.doc_texts)
        t0 = time.perf_counter()
        _, inputs.bm25_ids = bm25_topk(index, rq.query_texts, g.window_k)
        timing["bm25_overlap"] = (time.perf_counter() - t0) / len(rq.query_ids)
    if "dense_agreement" in g.signals:
        rq2 = retrieve_dense(beir, cfg.second_encoder, g.window_k, cfg.cache_dir)
        assert rq2.doc_ids == rq.doc_ids
        inputs.dense2_ids = rq2.indices
        # the per-query cost: encode the queries with the second encoder and search its index (model loaded)
        e = cfg.second_encoder
        enc = e.load()
        t0 = time.perf_counter()
        enc.encode(rq.query_texts, batch_size=e.batch_size, is_query=True)
        timing["dense_agreement"] = (time.perf_counter() - t0) / len(rq.query_ids)
    return compute_signals(inputs, g.signals), timing


def _signal_table(
    cfg: GateConfig,
    gate: WeakRetrievalGate,
    signals: dict[str, np.ndarray],
    weak: np.ndarray,
    test: np.ndarray,
    timing: dict[str, float],
) -> dict[str, Any]:
    g = cfg.gate
    out: dict[str, Any] = {}
    for st in gate.stats_:
        x = signals[st.name][test]
        a = auc(x, ~weak[test])
        lo, hi = bootstrap_auc(x, ~weak[test], g.num_bootstrap, seed=cfg.seed)
        out[st.name] = {
            "auc_cal": st.auc,
            "separation_cal": st.separation,
            "auc_test": a,
            "auc_test_ci95": [lo, hi],
            "separation_test": max(a, 1 - a),
            "orientation": st.orientation,
            "kept": st.kept,
            "dropped_because": st.reason or None,
            "extra_cost_per_query": SIGNALS[st.name].cost,
            "measured_seconds_per_query": timing.get(st.name),
        }
    return out


def _gate_entry(
    cfg: GateConfig,
    gate: WeakRetrievalGate,
    signals: dict[str, np.ndarray],
    weak: np.ndarray,
    cal: np.ndarray,
    test: np.ndarray,
    timing: dict[str, float],
) -> dict[str, Any]:
    used = gate.state_.signals
    esc_test = gate.predict({k: v[test] for k, v in signals.items()})
    esc_cal = gate.predict({k: v[cal] for k, v in signals.items()})
    return {
        "signals": used,
        "orientation": gate.state_.orientation,
        "thresholds": gate.state_.thresholds,
        "threshold_rule": cfg.gate.threshold_rule,
        "combine": cfg.gate.combine,
        "cal": gate_metrics(esc_cal, weak[cal]),
        "test": gate_metrics(esc_test, weak[test]),
        "cost": {
            "extra_retrievals_per_query": sum(1 for s in used if s in ("bm25_overlap", "dense_agreement")),
            "extra_query_encodings_per_query": sum(1 for s in used if s == "dense_agreement"),
            "measured_seconds_per_query": sum(timing.get(s, 0.0) for s in used),
            "escalations_per_query_test": float(esc_test.mean()),
        },
    }


def gate_study(cfg: GateConfig) -> tuple[dict[str, Any], WeakRetrievalGate]:
    """Retrieve, compute the signals, fit the gate on the calibration queries, measure it on the test
    queries; returns the report and the (possibly unfitted) gate."""
    g = cfg.gate
    check_escalation(cfg.escalation)  # before any data or weights load
    beir, _ = load_retrieval_data(cfg.data)
    rq = retrieve_dense(beir, cfg.encoder, g.window_k, cfg.cache_dir)
    weak = rq.num_missing > 0  # (Q,) a relevant doc is missing from the window
    signals, timing = gate_signals(cfg, beir, rq)
    perm = np.random.default_rng(cfg.seed).permutation(len(rq.query_ids))
    n_cal = int(round(cfg.calibration_fraction * len(perm)))
    cal, test = perm[:n_cal], perm[n_cal:]
    gate = WeakRetrievalGate(
        g.min_separation, g.max_correlation, g.threshold_rule, g.target_recall, g.combine
    )
    try:
        gate.fit({k: v[cal] for k, v in signals.items()}, weak[cal])
        fit_error = None
    except ValueError as err:  # no signal separates: reported, not turned into a gate
        fit_error = str(err)
        gate.stats_ = select_signals(
            {k: v[cal] for k, v in signals.items()}, weak[cal], g.min_separation, g.max_correlation
        )
    report: dict[str, Any] = {
        "data": {
            "queries_path": cfg.data.queries_path,
            "num_queries": len(rq.query_ids),
            "corpus_size": len(rq.doc_ids),
            "n_cal": int(cal.size),
            "n_test": int(test.size),
        },
        "primary_encoder": _describe(cfg.encoder),
        "second_encoder": _describe(cfg.second_encoder),
        "window_k": g.window_k,
        "weak_rate_cal": float(weak[cal].mean()),
        "weak_rate_test": float(weak[test].mean()),
        "signals": _signal_table(cfg, gate, signals, weak, test, timing),
        "auc_note": "AUC of the raw signal for good (non-weak) retrievals; < 0.5 means high values flag weakness",
        "fit_error": fit_error,
    }
    if fit_error is None:
        report["gate"] = _gate_entry(cfg, gate, signals, weak, cal, test, timing)
        if cfg.escalation.method != "none":
            flagged = gate.predict({k: v[test] for k, v in signals.items()})
            report["escalation"] = escalation_report(cfg, rq, beir, flagged, test)
    elif cfg.escalation.method != "none":
        report["escalation"] = None  # no gate, nothing flagged: fit_error says why
    return report, gate


def _describe(e: EncoderConfig) -> str:
    return f"{e.name} ({e.pooling} pooling, {e.max_length} tokens)"


def render_markdown(report: dict[str, Any]) -> str:
    """The report as markdown (what the command writes to ``report.md``)."""
    d = report["data"]
    lines = [
        "# Weak-retrieval gate report",
        "",
        f"- data: `{d['queries_path']}`, {d['num_queries']} queries ({d['n_cal']} calibration / {d['n_test']} test), "
        f"corpus {d['corpus_size']}",
        f"- primary retriever: {report['primary_encoder']}; second dense encoder: {report['second_encoder']}; "
        f"window top-{report['window_k']}",
        f"- weak = a relevant document missing from the window: {report['weak_rate_cal']:.1%} of calibration, "
        f"{report['weak_rate_test']:.1%} of test queries",
        f"- {report['auc_note']}",
        "",
        "| signal | AUC cal | AUC test | 95% CI (bootstrap) | kept | why dropped | extra cost per query |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, s in report["signals"].items():
        lo, hi = s["auc_test_ci95"]
        lines.append(
            f"| {name} | {fmt_number(s['auc_cal'])} | {fmt_number(s['auc_test'])} | [{fmt_number(lo)}, {fmt_number(hi)}] | "
            f"{'yes' if s['kept'] else 'no'} | {s['dropped_because'] or ''} | {s['extra_cost_per_query']} |"
        )
    if report.get("fit_error"):
        lines += ["", f"**No gate fitted:** {report['fit_error']}"]
    else:
        gt = report["gate"]
        parts = []
        for k in gt["signals"]:
            t = gt["thresholds"][k]
            if t is None or (isinstance(t, float) and math.isinf(t)):
                parts.append(f"{k} never fires (the joint search gave it no threshold)")
            else:
                parts.append(
                    f"{k} {'>=' if gt['orientation'][k] < 0 else '<='} {fmt_number(gt['orientation'][k] * t, 4)}"
                )
        thr = " or ".join(parts)
        lines += [
            "",
            f"## Gate: escalate when {thr} ({gt['threshold_rule']}, combine={gt['combine']})",
            "",
            "| split | precision | recall | escalation rate | weak rate |",
            "|---|---|---|---|---|",
        ]
        for split in ("cal", "test"):
            m = gt[split]
            lines.append(
                f"| {split} | {fmt_number(m['precision'])} | {fmt_number(m['recall'])} | {fmt_number(m['escalation_rate'])} | {fmt_number(m['weak_rate'])} |"
            )
        c = gt["cost"]
        lines += [
            "",
            f"Cost: {c['extra_retrievals_per_query']} extra retrieval(s) and {c['extra_query_encodings_per_query']} "
            f"extra query encoding(s) per query ({c['measured_seconds_per_query'] * 1000:.1f} ms/query measured); "
            f"escalations on {c['escalations_per_query_test']:.1%} of test queries.",
        ]
    if report.get("escalation"):
        lines += render_escalation(report["escalation"])
    return "\n".join(lines) + "\n"
