"""Dense retrieval over a BEIR data set: cached encoding, exact top-K, and the retrieved candidates
that ``judgeloop conformal`` and ``judgeloop gate`` start from.

``encode_cached`` keys its ``.npy`` files by a hash of (model, pooling, length, every text), so a
changed corpus or encoder never reuses stale vectors; the files are written atomically.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

import numpy as np
import torch

from judgeloop.config import check_at_least
from judgeloop.hashing import texts_digest
from judgeloop.io import DataError, atomic_path, read_jsonl
from judgeloop.logging import get_logger
from judgeloop.retrieval.beir import doc_text, load_beir
from judgeloop.retrieval.conformal import quantile_buckets
from judgeloop.retrieval.encoder import BiEncoder
from judgeloop.retrieval.mining import exact_topk

logger = get_logger(__name__)

SCIFACT = "../shared/data/scifact"


@dataclass
class RetrievalDataConfig:
    """A BEIR data set for dense retrieval, with optional query grouping and caps."""

    corpus_path: str = f"{SCIFACT}/corpus.jsonl"
    queries_path: str = f"{SCIFACT}/queries_train.jsonl"
    qrels_path: str = f"{SCIFACT}/qrels_train.tsv"
    # a field of the queries file holding each query's group label ("a/b" has parent "a")
    group_field: str | None = None
    # built-in grouping when group_field is unset: "base_rate" = quantile buckets of the top-1
    # retrieval score (label-free; their calibration base rates are reported), "query_length" =
    # quantile buckets of the query's word count, "none" = one global group
    grouping: Literal["base_rate", "query_length", "none"] = "base_rate"
    num_buckets: int = 3
    max_queries: int | None = None  # first N queries (by id order) for quick runs
    RENAMED: ClassVar[dict[str, str]] = {"max_corpus": "max_corpus_docs"}
    max_corpus_docs: int | None = None  # keep the relevant docs plus the first N others (quick runs)

    def __post_init__(self) -> None:
        check_at_least("data", self, "num_buckets", 1)


@dataclass
class EncoderConfig:
    """A bi-encoder by name, with pooling, length and batch size."""

    name: str = "sentence-transformers/all-MiniLM-L6-v2"
    pooling: Literal["mean", "cls"] = "mean"
    max_length: int = 256
    batch_size: int = 64


def encode_texts(
    model_name: str,
    texts: Sequence[str],
    pooling: Literal["mean", "cls"] = "mean",
    max_length: int = 256,
    batch_size: int = 64,
    is_query: bool = False,
) -> np.ndarray:
    """L2-normalised embeddings ``(N, D)`` of ``texts`` from :class:`judgeloop.retrieval.encoder.BiEncoder`."""

    enc = BiEncoder.from_pretrained(model_name, pooling=pooling, normalize=True, max_length=max_length)
    emb = enc.encode(list(texts), batch_size=batch_size, show_progress=len(texts) > 1000, is_query=is_query)
    return np.asarray(emb.detach().cpu().float().numpy(), dtype=np.float32)


def encode_cached(
    model_name: str,
    texts: Sequence[str],
    cache_dir: str | Path | None,
    pooling: Literal["mean", "cls"] = "mean",
    max_length: int = 256,
    batch_size: int = 64,
    is_query: bool = False,
) -> np.ndarray:
    """:func:`encode_texts` with an on-disk cache (``.npy``, written atomically).

    The key is a hash of (model, pooling, max_length, every text), so a changed corpus or encoder
    never reuses stale vectors. ``cache_dir=None`` disables the cache.
    """
    if cache_dir is None:
        return encode_texts(model_name, texts, pooling, max_length, batch_size, is_query)
    key = hashlib.sha256(f"{model_name}|{pooling}|{max_length}|{texts_digest(texts)}".encode()).hexdigest()[
        :20
    ]
    path = Path(cache_dir) / f"emb-{key}.npy"
    if path.is_file():
        emb = np.load(path)
        if emb.shape[0] == len(texts):
            logger.info("loaded %d cached embeddings from %s", len(texts), path)
            return emb
    logger.info(
        "encoding %d texts with %s (%s pooling); caching to %s", len(texts), model_name, pooling, path
    )
    emb = encode_texts(model_name, texts, pooling, max_length, batch_size, is_query)
    with atomic_path(path) as tmp, tmp.open("wb") as fh:
        np.save(fh, emb)
    return emb


def dense_topk(
    query_emb: np.ndarray, corpus_emb: np.ndarray, k: int, chunk_size: int = 1024
) -> tuple[np.ndarray, np.ndarray]:
    """Exact inner-product top-k (:func:`judgeloop.retrieval.mining.exact_topk`) on numpy arrays:
    ``(scores (Q, k), indices (Q, k))``, best first."""

    scores, idx = exact_topk(torch.from_numpy(query_emb), torch.from_numpy(corpus_emb), k, chunk_size)
    return np.asarray(scores.numpy(), dtype=np.float64), np.asarray(idx.numpy(), dtype=np.int64)


@dataclass
class RetrievedQueries:
    """Top-K retrieval results of Q queries over a corpus of N documents."""

    query_ids: list[str]
    query_texts: list[str]
    doc_ids: list[str]  # corpus order (N,)
    doc_texts: list[str]
    raw_scores: np.ndarray  # (Q, K)
    indices: np.ndarray  # (Q, K) corpus indices
    relevant: np.ndarray  # (Q, K) bool
    num_missing: np.ndarray  # (Q,)
    positives: list[set[str]]
    query_rows: dict[str, dict[str, Any]] = field(default_factory=dict)


def load_retrieval_data(data: RetrievalDataConfig) -> tuple[Any, dict[str, dict[str, Any]]]:
    """The BEIR data (qrels positives only) and the raw query rows (for ``group_field``)."""

    beir = load_beir(data.corpus_path, data.queries_path, data.qrels_path)
    rows = {str(r["_id"]): r for r in read_jsonl(data.queries_path, required=["_id"], kinds={"_id": "id"})}
    positives = beir.positives()
    qids = sorted(q for q in beir.queries if q in positives)
    if data.max_queries is not None:
        qids = qids[: data.max_queries]
    if not qids:
        raise DataError(f"{data.qrels_path}: no query has a relevant document (grade >= 1)")
    corpus = beir.corpus
    if data.max_corpus_docs is not None:
        keep = set().union(*(positives[q] for q in qids))
        others = [d for d in sorted(corpus) if d not in keep][: data.max_corpus_docs]
        corpus = {d: corpus[d] for d in sorted(keep | set(others))}
    beir = beir.subset(qids)
    beir.corpus = corpus
    return beir, rows


def retrieve_dense(beir: Any, encoder: EncoderConfig, top_k: int, cache_dir: str | None) -> RetrievedQueries:
    """Encode corpus and queries (cached) and keep each query's exact top-K candidates."""

    doc_ids = sorted(beir.corpus)
    doc_texts = [doc_text(beir.corpus[d]) for d in doc_ids]
    qids = list(beir.queries)
    qtexts = [beir.queries[q] for q in qids]
    corpus_emb = encode_cached(
        encoder.name, doc_texts, cache_dir, encoder.pooling, encoder.max_length, encoder.batch_size
    )
    query_emb = encode_cached(
        encoder.name,
        qtexts,
        cache_dir,
        encoder.pooling,
        encoder.max_length,
        encoder.batch_size,
        is_query=True,
    )
    scores, idx = dense_topk(query_emb, corpus_emb, top_k)  # (Q, K)
    positives = [{d for d, g in beir.qrels[q].items() if g >= 1} for q in qids]
    relevant = np.zeros(idx.shape, dtype=bool)
    num_missing = np.zeros(len(qids), dtype=np.int64)
    for i, pos in enumerate(positives):
        got = [doc_ids[j] in pos for j in idx[i]]
        relevant[i] = got
        num_missing[i] = len(pos) - int(sum(got))
    return RetrievedQueries(qids, qtexts, doc_ids, doc_texts, scores, idx, relevant, num_missing, positives)


def query_groups(
    rq: RetrievedQueries, data: RetrievalDataConfig, rows: dict[str, dict[str, Any]]
) -> np.ndarray:
    """One group label per query: ``data.group_field`` if set, else the built-in grouping."""

    if data.group_field is not None:
        labels = []
        for q in rq.query_ids:
            row = rows.get(q, {})
            if data.group_field not in row:
                raise DataError(
                    f"{data.queries_path}: query '{q}' has no field '{data.group_field}' "
                    f"(fields: {sorted(row)}); fix data.group_field or unset it for the built-in grouping"
                )
            labels.append(str(row[data.group_field]))
        return np.asarray(labels, dtype=object)
    if data.grouping == "none":
        return np.asarray(["all"] * len(rq.query_ids), dtype=object)
    if data.grouping == "query_length":
        lengths = np.asarray([len(t.split()) for t in rq.query_texts], dtype=float)
        return quantile_buckets(lengths, data.num_buckets, prefix="length")
    return quantile_buckets(rq.raw_scores[:, 0], data.num_buckets, prefix="top1")
