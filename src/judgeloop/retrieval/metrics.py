"""IR metrics (nDCG@k, Recall@k, MRR@k, MAP@k) from a run and qrels, computed by ``ranx``.

A *run* maps query id -> {doc id: score} (higher is better); *qrels* map query id -> {doc id: grade}.
Metric names follow ranx/trec_eval (``ndcg@10``, ``recall@100``, ``mrr@10``, ``map@100``); nDCG uses
linear gains (Jarvelin & Kekalainen 2002), as trec_eval and BEIR do. :func:`per_query_metrics` gives the
per-query nDCG@k and recall@k of ranked id lists (for paired comparisons); their means are ranx's.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
import torch

from judgeloop.retrieval.mining import exact_topk

DEFAULT_METRICS = ("ndcg@10", "recall@10", "recall@100", "mrr@10", "map@100")


def retrieve(
    query_ids: Sequence[str],
    query_emb: torch.Tensor,
    doc_ids: Sequence[str],
    doc_emb: torch.Tensor,
    k: int = 100,
    chunk_size: int = 1024,
) -> dict[str, dict[str, float]]:
    """Dense retrieval by exact inner product: a run with the top ``k`` docs of each query."""
    scores, indices = exact_topk(query_emb, doc_emb, k, chunk_size)
    return {
        qid: {doc_ids[j]: float(s) for s, j in zip(scores[i].tolist(), indices[i].tolist())}
        for i, qid in enumerate(query_ids)
    }


def evaluate_run(
    run: Mapping[str, Mapping[str, float]],
    qrels: Mapping[str, Mapping[str, int]],
    metrics: Sequence[str] = DEFAULT_METRICS,
) -> dict[str, float]:
    """Mean of each metric over the queries in ``qrels`` (a query missing from ``run`` scores 0).

    Only judged queries with at least one grade > 0 are scored, as in trec_eval.
    """
    from ranx import Qrels, Run, evaluate

    judged = {
        q: {d: int(g) for d, g in docs.items()}
        for q, docs in qrels.items()
        if any(g > 0 for g in docs.values())
    }
    if not judged:
        raise ValueError("qrels hold no query with a relevant (grade > 0) document; nothing to evaluate")
    # ranx needs every qrels query in the run; an empty ranking is given one dummy entry that is never relevant.
    full_run: dict[str, dict[str, float]] = {}
    for q in judged:
        ranking = {str(d): float(s) for d, s in run.get(q, {}).items()}
        full_run[q] = ranking or {"\x00no-result": 0.0}
    result = evaluate(Qrels(judged), Run(full_run), list(metrics), make_comparable=True)
    if isinstance(result, float):  # ranx returns a bare float for a single metric
        result = {metrics[0]: result}
    return {m: float(result[m]) for m in metrics}


def per_query_metrics(
    ranked: Sequence[Sequence[str]], qrels: Sequence[Mapping[str, int]], k: int = 10
) -> dict[str, np.ndarray]:
    """``{"ndcg@k": (Q,), "recall@k": (Q,)}`` of ranked document ids (best first) against each query's
    graded qrels. An empty ranking (an abstention) scores 0; a query without a relevant document is an
    error (trec_eval would skip it, which would change the number of queries a mean is over).

    nDCG@k with linear gains: ``sum_{i<k} g_i / log2(i + 2)`` over the ideal ordering's value.
    """
    if len(ranked) != len(qrels):
        raise ValueError(f"{len(ranked)} rankings for {len(qrels)} queries; pass one ranking per query")
    ndcg = np.zeros(len(ranked))
    recall = np.zeros(len(ranked))
    for i, (ids, grades) in enumerate(zip(ranked, qrels)):
        rel = {d: float(g) for d, g in grades.items() if g > 0}
        if not rel:
            raise ValueError(f"query {i} has no relevant document (grade > 0); drop it before scoring")
        top = list(ids)[:k]
        dcg = sum(rel.get(d, 0.0) / math.log2(r + 2) for r, d in enumerate(top))
        ideal = sorted(rel.values(), reverse=True)[:k]
        ndcg[i] = dcg / sum(g / math.log2(r + 2) for r, g in enumerate(ideal))
        recall[i] = len(set(top) & set(rel)) / len(rel)
    return {f"ndcg@{k}": ndcg, f"recall@{k}": recall}
