"""The gate that acts (``judgeloop gate`` with ``escalation:``): the queries the fitted weak-retrieval gate
flags on the test split get an escalation (:mod:`judgeloop.retrieval.escalation`), the others keep the
primary retriever's top window, and the report compares

* nDCG@k and recall@k of all test queries before and after (gated), and with every query escalated;
* the flagged queries before and after, and the unflagged ones had they been escalated too;
* the extra cost (retrievals, model calls) per 100 queries, gated against escalating every query;

with percentile-bootstrap intervals over queries for each paired delta. :func:`escalation_report`
returns the report's ``escalation`` block.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from judgeloop.config import bounded, check_fields
from judgeloop.intervals import bootstrap_mean_interval
from judgeloop.logging import get_logger
from judgeloop.retrieval.escalation import (
    REWRITE_PROMPT,
    apply_escalation,
    escalation_cost,
    expand_query,
    rrf_fuse,
)
from judgeloop.retrieval.metrics import per_query_metrics
from judgeloop.text import fmt_number

logger = get_logger(__name__)


@dataclass
class EscalationSection:
    """What a flagged query gets. ``method``: ``none`` (report the gate only), ``fuse`` (RRF of the primary
    list with ``fuse_with``'s list, each ``depth`` deep), ``rewrite`` (``rewrite_model`` rewrites the query,
    the primary retriever runs again on the expanded query) or ``abstain`` (no documents)."""

    method: Literal["none", "fuse", "rewrite", "abstain"] = "none"
    fuse_with: Literal["bm25", "second_encoder"] = "bm25"
    depth: int = bounded(100, ge=1, shape="section")
    rrf_k: float = bounded(60.0, ge=0.0, hint=" (60 in Cormack et al. 2009)", shape="section")
    rewrite_model: str = "HuggingFaceTB/SmolLM2-135M-Instruct"
    rewrite_max_new_tokens: int = bounded(32, ge=1, shape="section")
    rewrite_batch_size: int = bounded(8, ge=1, shape="section")
    num_bootstrap: int = bounded(1000, ge=1, shape="section")

    def __post_init__(self) -> None:
        check_fields("escalation", self)


def check_escalation(esc: EscalationSection) -> None:
    """The checks that need more than the config: the rewrite model must be loadable (before any work)."""
    if esc.method == "rewrite":
        from judgeloop.config import ConfigError
        from judgeloop.models import check_model

        try:
            check_model(esc.rewrite_model, "escalation.rewrite_model")
        except ValueError as err:
            raise ConfigError(str(err)) from None


def _fused(cfg: Any, rq: Any, beir: Any, test: np.ndarray) -> tuple[list[list[int]], float]:
    """Every test query's RRF ranking (top window) and the measured seconds per escalation."""
    from judgeloop.retrieval.dense import retrieve_dense

    e = cfg.escalation
    deep = retrieve_dense(beir, cfg.encoder, max(e.depth, cfg.gate.window_k), cfg.cache_dir)
    primary = deep.indices[test]  # (T, depth)
    t0 = time.perf_counter()
    if e.fuse_with == "bm25":
        from judgeloop.retrieval.bm25 import bm25_topk, build_bm25

        index = build_bm25(rq.doc_texts)
        t0 = time.perf_counter()  # the per-query cost: the BM25 search (the index is built once)
        _, other = bm25_topk(index, [rq.query_texts[i] for i in test], e.depth)
    else:
        other = retrieve_dense(beir, cfg.second_encoder, e.depth, cfg.cache_dir).indices[test]
    fused = [rrf_fuse([p, o], e.rrf_k, cfg.gate.window_k) for p, o in zip(primary, other)]
    return fused, (time.perf_counter() - t0) / max(len(test), 1)


def _rewritten(cfg: Any, rq: Any, test: np.ndarray) -> tuple[list[list[int]], float, list[str]]:
    """Every test query rewritten by the model and retrieved again; seconds per escalation; the rewrites."""
    from judgeloop.models import load_causal_lm, load_tokenizer
    from judgeloop.retrieval.dense import dense_topk, encode_with
    from judgeloop.routing.llm import generate

    e = cfg.escalation
    enc = cfg.encoder.load()
    corpus_emb = encode_with(enc, rq.doc_texts, cfg.cache_dir, cfg.encoder.batch_size)
    tok, model = load_tokenizer(e.rewrite_model), load_causal_lm(e.rewrite_model)
    queries = [rq.query_texts[i] for i in test]
    t0 = time.perf_counter()
    gens = generate(
        model,
        tok,
        [REWRITE_PROMPT.format(query=q) for q in queries],
        e.rewrite_max_new_tokens,
        e.rewrite_batch_size,
        desc="rewrite",
    )
    expanded = [expand_query(q, g.raw) for q, g in zip(queries, gens)]
    q_emb = encode_with(enc, expanded, None, cfg.encoder.batch_size, is_query=True)
    _, idx = dense_topk(q_emb, corpus_emb, cfg.gate.window_k)
    return idx.tolist(), (time.perf_counter() - t0) / max(len(test), 1), expanded


def _scores(ranked: list[list[int]], rq: Any, test: np.ndarray, k: int) -> dict[str, np.ndarray]:
    ids = [[rq.doc_ids[j] for j in row] for row in ranked]
    qrels = [{d: 1 for d in rq.positives[i]} for i in test]
    return per_query_metrics(ids, qrels, k)


def _mean(m: dict[str, np.ndarray], mask: np.ndarray | None = None) -> dict[str, float | None]:
    """Each metric's mean over the queries in ``mask`` (all when None); None over no query."""
    keep = np.ones(len(next(iter(m.values()))), dtype=bool) if mask is None else mask
    return {k: float(v[keep].mean()) if keep.any() else None for k, v in m.items()}


def _delta(a: dict[str, np.ndarray], b: dict[str, np.ndarray], mask: np.ndarray, cfg: Any) -> dict[str, Any]:
    """Paired ``a - b`` over the queries in ``mask``, per metric, with a bootstrap interval."""
    out: dict[str, Any] = {}
    for k in a:
        d = (a[k] - b[k])[mask]
        ci = bootstrap_mean_interval(d, cfg.escalation.num_bootstrap, seed=cfg.seed)
        out[k] = {"delta": float(d.mean()) if d.size else None, "ci95": list(ci), "n": int(d.size)}
    return out


def escalation_report(cfg: Any, rq: Any, beir: Any, flagged: np.ndarray, test: np.ndarray) -> dict[str, Any]:
    """The ``escalation`` block of the gate report for the test queries ``test`` (corpus-query indices) and
    the gate's ``flagged`` ``(T,)`` on them."""
    e = cfg.escalation
    k = cfg.gate.window_k
    f = np.asarray(flagged, dtype=bool)
    before = [row[:k].tolist() for row in rq.indices[test]]
    extra: dict[str, Any] = {}
    seconds = 0.0
    escalated: list[list[int]] | None = None
    if e.method == "fuse":
        escalated, seconds = _fused(cfg, rq, beir, test)
        extra["fuse_with"] = e.fuse_with
    elif e.method == "rewrite":
        escalated, seconds, expanded = _rewritten(cfg, rq, test)
        extra["rewrite_model"] = e.rewrite_model
        extra["rewrite_samples"] = [
            {"query": rq.query_texts[i], "expanded": x} for i, x in zip(test[:5].tolist(), expanded[:5])
        ]
    m_before = _scores(before, rq, test, k)
    m_gated = _scores(apply_escalation(before, escalated, f), rq, test, k)
    m_every = _scores(apply_escalation(before, escalated, np.ones_like(f)), rq, test, k)
    everyone = np.ones_like(f)
    block: dict[str, Any] = {
        "method": e.method,
        **extra,
        "split": "test",
        "k": k,
        "num_queries": int(f.size),
        "num_flagged": int(f.sum()),
        "all_before": _mean(m_before),
        "all_after": _mean(m_gated),
        "all_escalate_every": _mean(m_every),
        "flagged_before": _mean(m_before, f),
        "flagged_after": _mean(m_gated, f),
        "unflagged_before": _mean(m_before, ~f),
        "unflagged_if_escalated": _mean(m_every, ~f),
        "deltas": {
            "flagged_after_minus_before": _delta(m_gated, m_before, f, cfg),
            "all_after_minus_before": _delta(m_gated, m_before, everyone, cfg),
            "unflagged_if_escalated_minus_before": _delta(m_every, m_before, ~f, cfg),
            "escalate_every_minus_gated": _delta(m_every, m_gated, everyone, cfg),
        },
        "extra_cost_per_100_queries": {
            "gated": escalation_cost(e.method, int(f.sum()), f.size),
            "escalate_every": escalation_cost(e.method, f.size, f.size),
        },
        "measured_seconds_per_escalation": seconds,
    }
    if e.method == "abstain":
        block["answered"] = {"coverage": float((~f).mean()), **_mean(m_before, ~f)}
    return block


def render_escalation(block: dict[str, Any]) -> list[str]:
    """The escalation section of ``report.md``."""
    k = block["k"]
    keys = (f"ndcg@{k}", f"recall@{k}")
    how = {
        "fuse": f"reciprocal rank fusion with {block.get('fuse_with')}",
        "rewrite": f"query rewrite by {block.get('rewrite_model')}",
        "abstain": "abstention",
    }[block["method"]]
    lines = [
        "",
        f"## Escalation: {how}, on the {block['num_flagged']} of {block['num_queries']} test queries the gate flags",
        "",
        f"| queries | n | {keys[0]} | {keys[1]} |",
        "|---|---|---|---|",
    ]
    n, nf = block["num_queries"], block["num_flagged"]
    rows = [
        ("all, before", n, "all_before"),
        ("all, gated escalation", n, "all_after"),
        ("all, every query escalated", n, "all_escalate_every"),
        ("flagged, before", nf, "flagged_before"),
        ("flagged, after", nf, "flagged_after"),
        ("unflagged, before", n - nf, "unflagged_before"),
        ("unflagged, had they been escalated", n - nf, "unflagged_if_escalated"),
    ]
    for label, count, key in rows:
        m = block[key]
        lines.append(f"| {label} | {count} | {fmt_number(m[keys[0]])} | {fmt_number(m[keys[1]])} |")
    lines += [
        "",
        f"| paired delta (95% bootstrap CI over queries) | {keys[0]} | {keys[1]} |",
        "|---|---|---|",
    ]
    for name, d in block["deltas"].items():
        cells = [
            f"{fmt_number(d[x]['delta'], 4)} [{fmt_number(d[x]['ci95'][0], 4)}, {fmt_number(d[x]['ci95'][1], 4)}]"
            for x in keys
        ]
        lines.append(f"| {name.replace('_', ' ')} (n={d[keys[0]]['n']}) | {cells[0]} | {cells[1]} |")
    g, a = block["extra_cost_per_100_queries"]["gated"], block["extra_cost_per_100_queries"]["escalate_every"]
    lines += [
        "",
        f"Extra cost per 100 queries: gated {fmt_number(g['retrievals'], 1)} retrievals and "
        f"{fmt_number(g['model_calls'], 1)} model calls; escalating every query {fmt_number(a['retrievals'], 1)} "
        f"retrievals and {fmt_number(a['model_calls'], 1)} model calls "
        f"({block['measured_seconds_per_escalation'] * 1000:.1f} ms per escalation measured).",
    ]
    if "answered" in block:
        ans = block["answered"]
        lines.append(
            f"Abstention answers {ans['coverage']:.1%} of test queries; on those, {keys[0]} "
            f"{fmt_number(ans[keys[0]])}, {keys[1]} {fmt_number(ans[keys[1]])} (an abstained query scores 0 above)."
        )
    return lines
