"""Dense retrieval over a BEIR data set: encoding through the embedding cache
(:mod:`judgeloop.retrieval.embedding_cache`), exact top-K, and the retrieved candidates that
``judgeloop conformal`` and ``judgeloop gate`` start from.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

import numpy as np
import torch

from judgeloop.config import bounded, check_fields
from judgeloop.io import DataError, read_jsonl
from judgeloop.logging import get_logger
from judgeloop.retrieval.beir import doc_text, load_beir
from judgeloop.retrieval.conformal import quantile_buckets
from judgeloop.retrieval.embedding_cache import encode_texts
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
    num_buckets: int = bounded(3, ge=1, shape="section")
    max_queries: int | None = bounded(None, ge=0)
    RENAMED: ClassVar[dict[str, str]] = {"max_corpus": "max_corpus_docs"}
    max_corpus_docs: int | None = bounded(None, ge=0)

    def __post_init__(self) -> None:
        check_fields("data", self)


@dataclass
class EncoderConfig:
    """A bi-encoder by name, with pooling, length and batch size."""

    name: str = "sentence-transformers/all-MiniLM-L6-v2"
    pooling: Literal["mean", "cls"] = "mean"
    max_length: int = bounded(256, ge=0)
    batch_size: int = bounded(64, ge=0)

    def load(self) -> BiEncoder:
        """The bi-encoder this names, L2-normalized (dot product = cosine)."""
        return BiEncoder.from_pretrained(
            self.name, pooling=self.pooling, normalize=True, max_length=self.max_length
        )

    def __post_init__(self) -> None:
        check_fields("encoder", self)


def encode_with(
    encoder: EncoderConfig | BiEncoder,
    texts: Sequence[str],
    cache_dir: str | Path | None,
    batch_size: int,
    is_query: bool = False,
) -> np.ndarray:
    """Embeddings ``(N, D)`` (float32 numpy) of ``texts`` through the embedding cache
    (:func:`judgeloop.retrieval.embedding_cache.encode_texts`; ``cache_dir=None``: no cache). An
    :class:`EncoderConfig` is loaded first."""
    enc = encoder.load() if isinstance(encoder, EncoderConfig) else encoder
    emb = encode_texts(enc, list(texts), batch_size, is_query, cache_dir=cache_dir)
    return np.asarray(emb.numpy(), dtype=np.float32)


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
    kinds = {"_id": "id", **({data.group_field: "id"} if data.group_field else {})}
    rows = {str(r["_id"]): r for r in read_jsonl(data.queries_path, required=["_id"], kinds=kinds)}
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
    enc = encoder.load()
    corpus_emb = encode_with(enc, doc_texts, cache_dir, encoder.batch_size)
    query_emb = encode_with(enc, qtexts, cache_dir, encoder.batch_size, is_query=True)
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
