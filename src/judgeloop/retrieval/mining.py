"""Hard-negative mining: exact (or FAISS) top-k over corpus embeddings, a rank window, and a
false-negative filter.

For each query the corpus is ranked by ``q . d``. Known positives are removed; the remaining
candidates at ranks ``[range_min, range_max)`` are kept unless they score too close to the positive
(likely unlabelled positives, Qu et al. 2021 RocketQA; Moreira et al. 2024 NV-Retriever
"TopK-MarginPos" / "TopK-PercPos"):

* absolute: drop if ``score > positive_score - margin``;
* relative: drop if ``score > positive_score * relative_margin`` (e.g. 0.95 keeps negatives
  below 95% of the positive's score).

``positive_score`` is the score of the query's *lowest-scoring* known positive, so a candidate that
outranks any labelled positive by the margin is treated as suspect. Negatives are then the top
``num_negatives`` survivors or a seeded random sample of them.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from judgeloop.config import bounded, check_fields
from judgeloop.io import atomic_write_jsonl, check_kind, check_row, read_jsonl
from judgeloop.logging import get_logger

logger = get_logger(__name__)

Negatives = dict[str, list[tuple[str, float]]]


@dataclass
class MiningConfig:
    """Hard-negative mining settings.

    Attributes:
        num_negatives: negatives kept per query.
        range_min: first rank (0-based, positives removed) a negative may come from; skipping the very
            top guards against unlabelled positives.
        range_max: candidates are taken from ranks below this.
        margin: absolute false-negative margin (None: off).
        relative_margin: relative false-negative threshold in (0, 1] (None: off).
        sampling: ``top`` survivors or ``random`` among them.
        seed: seed for random sampling.
        chunk_size: queries scored per matrix product in exact search.
        use_faiss: search with a FAISS inner-product index (needs ``faiss`` installed).
    """

    num_negatives: int = bounded(3, ge=1, shape="section")
    range_min: int = 0
    range_max: int = 30
    margin: float | None = bounded(None, ge=0, hint=" or null", shape="section")
    relative_margin: float | None = bounded(
        0.95, gt=0.0, le=1.0, hint=" (e.g. 0.95) or null", shape="section"
    )
    sampling: Literal["top", "random"] = "top"
    seed: int = bounded(0, ge=0, le=2**32 - 1)
    chunk_size: int = bounded(1024, ge=1, shape="section")
    use_faiss: bool = False

    def __post_init__(self) -> None:
        check_fields("mining", self)
        if not 0 <= self.range_min < self.range_max:
            raise ValueError(
                f"mining.range_min={self.range_min}, range_max={self.range_max}: need 0 <= range_min < range_max"
            )
        if self.range_max - self.range_min < self.num_negatives:
            raise ValueError(
                f"mining window [{self.range_min}, {self.range_max}) holds fewer than "
                f"num_negatives={self.num_negatives} candidates; widen range_max"
            )


def exact_topk(
    query_emb: torch.Tensor, corpus_emb: torch.Tensor, k: int, chunk_size: int = 1024
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact inner-product top-k by matrix product, ``chunk_size`` queries at a time.

    Args:
        query_emb: (Q, D).
        corpus_emb: (N, D).
        k: results per query (clipped to N).

    Returns:
        (scores, indices), both (Q, min(k, N)), best first.
    """
    if query_emb.shape[-1] != corpus_emb.shape[-1]:
        raise ValueError(
            f"query dim {query_emb.shape[-1]} != corpus dim {corpus_emb.shape[-1]}; same encoder?"
        )
    k = min(k, corpus_emb.shape[0])
    scores, indices = [], []
    with torch.inference_mode():
        corpus_t = corpus_emb.T.contiguous()  # (D, N)
        for start in range(0, query_emb.shape[0], chunk_size):
            sim = query_emb[start : start + chunk_size] @ corpus_t  # (C, N)
            s, i = torch.topk(sim, k, dim=1)
            scores.append(s)
            indices.append(i)
    if not scores:
        return torch.empty(0, k), torch.empty(0, k, dtype=torch.long)
    return torch.cat(scores), torch.cat(indices)


def faiss_topk(
    query_emb: torch.Tensor, corpus_emb: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k with a flat FAISS inner-product index (same results as :func:`exact_topk`)."""
    try:
        import faiss
    except ImportError as err:
        raise ImportError(
            "mining.use_faiss=true needs FAISS: pip install faiss-cpu (or set use_faiss=false)"
        ) from err
    k = min(k, corpus_emb.shape[0])
    index = faiss.IndexFlatIP(corpus_emb.shape[1])
    index.add(corpus_emb.float().numpy())
    s, i = index.search(query_emb.float().numpy(), k)
    return torch.from_numpy(s), torch.from_numpy(i).long()


def mine_hard_negatives(
    query_ids: Sequence[str],
    query_emb: torch.Tensor,
    doc_ids: Sequence[str],
    doc_emb: torch.Tensor,
    positives: Mapping[str, set[str]],
    cfg: MiningConfig | None = None,
) -> Negatives:
    """Mine hard negatives for each query from precomputed embeddings.

    Args:
        query_ids: ids of the rows of ``query_emb`` (Q, D).
        doc_ids: ids of the rows of ``doc_emb`` (N, D).
        positives: query id -> known positive doc ids; these are never returned as negatives.
        cfg: window, margins and sampling (:class:`MiningConfig`).

    Returns:
        query id -> [(doc id, score), ...], best-scoring first; fewer than ``num_negatives`` entries when
        the filter leaves fewer (counted in the log), none for a query with no candidates.
    """
    cfg = cfg or MiningConfig()
    if len(query_ids) != query_emb.shape[0] or len(doc_ids) != doc_emb.shape[0]:
        raise ValueError(
            f"{len(query_ids)} query ids for {query_emb.shape[0]} query embeddings, "
            f"{len(doc_ids)} doc ids for {doc_emb.shape[0]} doc embeddings; they must match"
        )
    row_of = {d: i for i, d in enumerate(doc_ids)}
    max_pos = max((len(positives.get(q, ())) for q in query_ids), default=0)
    k = cfg.range_max + max_pos
    if cfg.use_faiss:
        scores, indices = faiss_topk(query_emb, doc_emb, k)
    else:
        scores, indices = exact_topk(query_emb, doc_emb, k, cfg.chunk_size)
    rng = random.Random(cfg.seed)
    out: Negatives = {}
    n_filtered = n_short = 0
    for qi, qid in enumerate(query_ids):
        pos = positives.get(qid, set())
        pos_rows = [row_of[d] for d in pos if d in row_of]
        pos_score = float((doc_emb[pos_rows] @ query_emb[qi]).min()) if pos_rows else None
        ranked = [
            (doc_ids[j], float(s))
            for s, j in zip(scores[qi].tolist(), indices[qi].tolist())
            if doc_ids[j] not in pos
        ][cfg.range_min : cfg.range_max]
        kept = []
        for doc_id, s in ranked:
            if pos_score is not None and (
                (cfg.margin is not None and s > pos_score - cfg.margin)
                or (cfg.relative_margin is not None and s > pos_score * cfg.relative_margin)
            ):
                n_filtered += 1
                continue
            kept.append((doc_id, s))
        if cfg.sampling == "random" and len(kept) > cfg.num_negatives:
            kept = sorted(rng.sample(kept, cfg.num_negatives), key=lambda x: -x[1])
        kept = kept[: cfg.num_negatives]
        n_short += len(kept) < cfg.num_negatives
        out[qid] = kept
    logger.info(
        "mined negatives for %d queries: %d candidates dropped as likely false negatives, %d queries short of %d",
        len(query_ids),
        n_filtered,
        n_short,
        cfg.num_negatives,
    )
    return out


def save_negatives(path: str | Path, negatives: Mapping[str, Sequence[tuple[str, float]]]) -> None:
    """Write ``{"query_id": .., "negatives": [{"doc_id": .., "score": ..}, ...]}`` lines (atomically)."""
    atomic_write_jsonl(
        path,
        (
            {"query_id": qid, "negatives": [{"doc_id": d, "score": float(s)} for d, s in negs]}
            for qid, negs in negatives.items()
        ),
    )


def load_negatives(path: str | Path) -> Negatives:
    """Read a file written by :func:`save_negatives`; every negative checked to be ``{"doc_id": str or
    int, "score": number}`` (a :class:`~judgeloop.io.DataError` names the query and the negative)."""
    out: Negatives = {}
    kinds = {"doc_id": "id", "score": "number"}
    for row in read_jsonl(
        path, required=["query_id", "negatives"], kinds={"query_id": "id", "negatives": "list"}
    ):
        negatives = []
        for j, n in enumerate(row["negatives"]):
            where = f"{path}: query {row['query_id']}, negatives[{j}]"
            n = check_row(check_kind(n, "mapping", where, "negatives[]"), where, list(kinds), kinds)
            negatives.append((str(n["doc_id"]), float(n["score"])))
        out[str(row["query_id"])] = negatives
    return out
