"""The retriever's training batches: (query, positive) examples, shuffled batches with no query twice,
their texts with hard negatives, and the masks that keep a known positive from being a negative
(:func:`judgeloop.retrieval.trainer.train_step` reads them)."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from judgeloop.retrieval import beir
from judgeloop.retrieval.beir import BeirData
from judgeloop.retrieval.mining import Negatives


@dataclass
class Example:
    """One training pair: a query and one of its positive documents."""

    query_id: str
    positive_id: str


def make_examples(data: BeirData) -> list[Example]:
    """One training example per (query, positive document) pair."""
    return [Example(q, d) for q, docs in data.positives().items() for d in sorted(docs)]


def make_batches(
    examples: Sequence[Example], batch_size: int, seed: int, epoch: int, drop_last: bool
) -> list[list[Example]]:
    """Shuffled (seed + epoch) batches; a query appears at most once per batch (another of its
    positives would otherwise be a false in-batch negative), deferred examples go to later batches.
    ``drop_last`` (several processes) keeps only full batches, which split into equal per-rank slices."""
    order = list(examples)
    random.Random(seed * 1_000_003 + epoch).shuffle(order)
    batches: list[list[Example]] = []
    pending = order
    while pending:
        batch: list[Example] = []
        seen: set[str] = set()
        rest: list[Example] = []
        for ex in pending:
            if len(batch) < batch_size and ex.query_id not in seen:
                batch.append(ex)
                seen.add(ex.query_id)
            else:
                rest.append(ex)
        batches.append(batch)
        pending = rest
    if drop_last:  # several processes: every batch splits into equal slices (no rank short or empty)
        return [b for b in batches if len(b) == batch_size]
    return [b for b in batches if len(b) >= 2]


def batch_texts(
    batch: Sequence[Example],
    data: BeirData,
    negatives: Negatives | None,
    num_negatives: int,
    rng: random.Random,
) -> tuple[list[str], list[str], list[str], list[str]]:
    """Query, positive, and hard-negative texts (``num_negatives`` per query; a query short of mined
    negatives is topped up with random corpus documents), plus all candidate doc ids in column order."""
    queries = [data.queries[ex.query_id] for ex in batch]
    pos_ids = [ex.positive_id for ex in batch]
    neg_ids: list[str] = []
    if negatives is not None and num_negatives > 0:
        all_ids = list(data.corpus)
        positives = data.positives()
        for ex in batch:
            mined = [d for d, _ in negatives.get(ex.query_id, [])][:num_negatives]
            while len(mined) < num_negatives:
                cand = rng.choice(all_ids)
                if cand not in positives.get(ex.query_id, ()) and cand not in mined:
                    mined.append(cand)
            neg_ids.extend(mined)
    texts = [beir.doc_text(data.corpus[d]) for d in pos_ids], [beir.doc_text(data.corpus[d]) for d in neg_ids]
    return queries, texts[0], texts[1], pos_ids + neg_ids


def positive_mask(batch: Sequence[Example], doc_ids: Sequence[str], data: BeirData) -> torch.Tensor:
    """(B, N) True where candidate doc j is a known positive of query i (never a negative for it)."""
    positives = data.positives()
    return torch.tensor(
        [[d in positives.get(ex.query_id, ()) for d in doc_ids] for ex in batch], dtype=torch.bool
    )


def loss_masks(
    batch: Sequence[Example], doc_ids: Sequence[str], data: BeirData, accelerator: Any, gather: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Known positives among the candidates, for :func:`info_nce_loss`'s ``mask`` and ``query_mask``.

    Without gathering the candidates are this process's ``[positives; negatives]``. With gathering they
    are every process's, in the order the loss gathers them (all positives by rank, then all
    negatives), so a document that is another process's positive is not a negative here either.
    """
    b = len(batch)
    if not gather:
        return positive_mask(batch, doc_ids, data).to(accelerator.device), None
    from accelerate.utils import gather_object

    pos_ids, neg_ids = list(doc_ids[:b]), list(doc_ids[b:])
    # one collective per step: every process's (positives, negatives, queries), in rank order
    per_rank = gather_object([(pos_ids, neg_ids, [ex.query_id for ex in batch])])
    all_pos = [d for r in per_rank for d in r[0]]
    all_neg = [d for r in per_rank for d in r[1]]
    all_queries = [q for r in per_rank for q in r[2]]
    positives = data.positives()
    query_mask = torch.tensor(
        [[d in positives.get(q, ()) for q in all_queries] for d in pos_ids], dtype=torch.bool
    )
    return (
        positive_mask(batch, all_pos + all_neg, data).to(accelerator.device),
        query_mask.to(accelerator.device),
    )
