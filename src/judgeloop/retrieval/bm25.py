"""One BM25 index (``bm25s``, English stop words removed) for every lexical ranking in judgeloop: the
baselines of ``gate`` and ``route``, the RAFT builder's BM25 distractors, and BM25 negatives (lexical
hard negatives, as in DPR, Karpukhin et al. 2020)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import bm25s
import numpy as np

from judgeloop.retrieval.beir import BeirData, doc_text


def build_bm25(corpus_texts: Sequence[str]) -> Any:
    """A bm25s index over ``corpus_texts`` (English stop words removed)."""
    retriever = bm25s.BM25()
    retriever.index(
        bm25s.tokenize(list(corpus_texts), stopwords="en", show_progress=False), show_progress=False
    )
    return retriever


def bm25_topk(retriever: Any, queries: Sequence[str], k: int) -> tuple[np.ndarray, np.ndarray]:
    """``(scores (Q, k), corpus indices (Q, k))`` from a :func:`build_bm25` index."""
    # token strings, looked up in the corpus vocabulary (ids from a fresh tokenize call would not match it)
    tokens = bm25s.tokenize(list(queries), stopwords="en", return_ids=False, show_progress=False)
    idx, scores = retriever.retrieve(tokens, k=k, show_progress=False, n_threads=1)
    return np.asarray(scores, dtype=np.float64), np.asarray(idx, dtype=np.int64)


def bm25_negatives(
    data: BeirData,
    num_negatives: int,
    positives: Mapping[str, set[str]] | None = None,
    range_max: int = 30,
) -> dict[str, list[tuple[str, float]]]:
    """Top BM25 documents per query that are not known positives.

    Args:
        data: corpus and queries.
        num_negatives: negatives per query.
        positives: query id -> known positive doc ids (default: from ``data.qrels``).
        range_max: how deep to look in the BM25 ranking.

    Returns:
        query id -> [(doc id, BM25 score), ...], best first.
    """
    if num_negatives < 1:
        raise ValueError(f"num_negatives={num_negatives} must be >= 1")
    positives = data.positives() if positives is None else positives
    doc_ids = list(data.corpus)
    retriever = build_bm25([doc_text(data.corpus[d]) for d in doc_ids])
    query_ids = list(data.queries)
    k = min(len(doc_ids), range_max + max((len(p) for p in positives.values()), default=0))
    scores, indices = bm25_topk(retriever, [data.queries[q] for q in query_ids], k)
    out: dict[str, list[tuple[str, float]]] = {}
    for i, qid in enumerate(query_ids):
        pos = positives.get(qid, set())
        ranked = [
            (doc_ids[j], float(s))
            for j, s in zip(indices[i].tolist(), scores[i].tolist())
            if doc_ids[j] not in pos and s > 0
        ]
        out[qid] = ranked[:num_negatives]
    return out
