"""What a flagged retrieval gets: the escalations the weak-retrieval gate (:mod:`judgeloop.retrieval.gate`)
can pay for, applied to the flagged queries only.

Three escalations, each a plain function over ranked corpus indices so any retriever can feed it:

* ``fuse``: rerank the union of the primary list and the other retriever's list (BM25, or a second
  dense encoder) by reciprocal rank fusion, ``RRF(d) = sum_r 1 / (k + rank_r(d))`` with ranks from 1
  and ``k = 60`` (Cormack, Clarke & Buettcher 2009, "Reciprocal rank fusion outperforms Condorcet and
  individual rank learning methods"); one extra retrieval per escalated query;
* ``rewrite``: a configured language model rewrites the query as search terms, and the primary retriever
  runs again on the query expanded with them (the original is kept, as in query2doc: Wang, Yang & Wei
  2023, "Query2doc: Query Expansion with Large Language Models"); one model call and one extra
  retrieval per escalated query;
* ``abstain``: the flagged query gets no documents (an empty ranking scores 0); no extra work.

:func:`apply_escalation` swaps the escalated rankings in for the flagged queries and leaves the others as
they were; :func:`escalation_cost` counts the extra calls per 100 queries.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import numpy as np

Escalation = Literal["fuse", "rewrite", "abstain"]
ESCALATIONS = ("fuse", "rewrite", "abstain")

__all__ = [
    "ESCALATIONS",
    "REWRITE_PROMPT",
    "apply_escalation",
    "escalation_cost",
    "expand_query",
    "rrf_fuse",
]

REWRITE_PROMPT = (
    "Rewrite this search query for a search engine over scientific abstracts. Reply with one line of "
    "key terms and their synonyms, no explanation.\nQuery: {query}"
)


def rrf_fuse(rankings: Sequence[Sequence[int]], k: float = 60.0, depth: int | None = None) -> list[int]:
    """One query's reciprocal rank fusion of several rankings (corpus indices, best first).

    Returns the fused ranking of the union, best first; ties are broken by the first ranking's order,
    then by index, so the result is deterministic. ``depth`` keeps the top ``depth`` of the fusion.
    """
    if k < 0:
        raise ValueError(f"rrf_k={k} must be >= 0 (60 in Cormack et al. 2009)")
    score: dict[int, float] = {}
    first: dict[int, int] = {}
    for ranking in rankings:
        for r, d in enumerate(ranking):
            d = int(d)
            score[d] = score.get(d, 0.0) + 1.0 / (k + r + 1)
            first.setdefault(d, len(first))
    fused = sorted(score, key=lambda d: (-score[d], first[d], d))
    return fused if depth is None else fused[:depth]


def expand_query(query: str, rewrite: str) -> str:
    """The query the retriever runs after a rewrite: the original, then the rewrite's first line."""
    line = rewrite.strip().split("\n")[0].strip()
    return f"{query} {line}" if line else query


def apply_escalation(
    before: Sequence[Sequence[int]], escalated: Sequence[Sequence[int]] | None, flagged: np.ndarray
) -> list[list[int]]:
    """Per query, the escalated ranking where ``flagged`` ``(Q,)`` is set, else the ranking it had.

    ``escalated=None`` is abstention: a flagged query gets an empty ranking.
    """
    f = np.asarray(flagged, dtype=bool)
    if f.shape != (len(before),) or (escalated is not None and len(escalated) != len(before)):
        raise ValueError(
            f"flagged has shape {f.shape} for {len(before)} rankings"
            + ("" if escalated is None else f" and {len(escalated)} escalated rankings")
            + "; pass one of each per query"
        )
    out = []
    for i, ranking in enumerate(before):
        if not f[i]:
            out.append([int(d) for d in ranking])
        else:
            out.append([] if escalated is None else [int(d) for d in escalated[i]])
    return out


def escalation_cost(method: Escalation, num_escalated: int, num_queries: int) -> dict[str, float]:
    """Extra work per 100 queries when ``num_escalated`` of ``num_queries`` are escalated by ``method``:
    ``retrievals`` (BM25 / dense searches beyond the primary one) and ``model_calls`` (LM generations)."""
    if method not in ESCALATIONS:
        raise ValueError(f"escalation.method={method!r} is not one of {list(ESCALATIONS)}")
    if num_queries <= 0:
        raise ValueError("no queries to escalate; the cost per 100 queries is undefined")
    per = 100.0 * num_escalated / num_queries
    retrievals = {"fuse": 1.0, "rewrite": 1.0, "abstain": 0.0}[method]
    model_calls = {"fuse": 0.0, "rewrite": 1.0, "abstain": 0.0}[method]
    return {"retrievals": per * retrievals, "model_calls": per * model_calls, "escalated": per}
