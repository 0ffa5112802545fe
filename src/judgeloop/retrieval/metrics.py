"""IR metrics (nDCG@k, Recall@k, MRR@k, MAP@k) from a run and qrels, computed by ``ranx``.

A *run* maps query id -> {doc id: score} (higher is better); *qrels* map query id -> {doc id: grade}.
Metric names follow ranx/trec_eval (``ndcg@10``, ``recall@100``, ``mrr@10``, ``map@100``); nDCG uses
linear gains (Jarvelin & Kekalainen 2002), as trec_eval and BEIR do.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

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
