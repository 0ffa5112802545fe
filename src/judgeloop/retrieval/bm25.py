"""BM25 negatives (lexical hard negatives, as in DPR, Karpukhin et al. 2020) with the ``bm25s`` package."""

from __future__ import annotations

from collections.abc import Mapping

from judgeloop.retrieval.beir import BeirData, doc_text


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
    import bm25s

    if num_negatives < 1:
        raise ValueError(f"num_negatives={num_negatives} must be >= 1")
    positives = data.positives() if positives is None else positives
    doc_ids = list(data.corpus)
    retriever = bm25s.BM25()
    retriever.index(
        bm25s.tokenize([doc_text(data.corpus[d]) for d in doc_ids], stopwords="en", show_progress=False),
        show_progress=False,
    )
    query_ids = list(data.queries)
    # Query tokens as strings, so they are looked up in the corpus vocabulary (unknown words are dropped).
    q_tokens = bm25s.tokenize(
        [data.queries[q] for q in query_ids], stopwords="en", return_ids=False, show_progress=False
    )
    k = min(len(doc_ids), range_max + max((len(p) for p in positives.values()), default=0))
    indices, scores = retriever.retrieve(q_tokens, k=k, show_progress=False)
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
