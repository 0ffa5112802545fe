"""``judgeloop conformal``: conformal retrieval sets on a BEIR data set, checked over random splits.

The command encodes the corpus once (cached under ``cache_dir``, keyed by model, pooling, length and
a hash of the corpus), retrieves the top-K candidates of every query, and then, for each of
``num_trials`` random calibration/test splits of the queries, fits the (Mondrian) conformal
threshold on calibration queries and measures coverage and set size on test queries.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from judgeloop.io import atomic_path
from judgeloop.logging import get_logger

logger = get_logger(__name__)


# ----------------------------------------------------------------------------------------------
# Dense retrieval glue shared with ``judgeloop gate``: encode with a cache, exact top-K.
# ----------------------------------------------------------------------------------------------


def encode_texts(
    model_name: str, texts: Sequence[str], pooling: str = "mean", max_length: int = 256, batch_size: int = 64
) -> np.ndarray:
    """L2-normalised embeddings ``(N, D)`` of ``texts``.

    Uses :class:`judgeloop.retrieval.encoder.BiEncoder` when it is installed; otherwise a
    sentence-transformers model built from the same local weights with the requested pooling.
    """
    try:
        from judgeloop.retrieval.encoder import BiEncoder
    except ImportError:
        BiEncoder = None  # type: ignore[assignment,misc]
    if BiEncoder is not None:
        enc = BiEncoder.from_pretrained(model_name, pooling=pooling, normalize=True, max_length=max_length)
        emb = enc.encode(list(texts), batch_size=batch_size, show_progress=len(texts) > 1000)
        return np.asarray(emb.detach().cpu().float().numpy(), dtype=np.float32)
    from sentence_transformers import SentenceTransformer, models

    from judgeloop.models import resolve_model_path

    word = models.Transformer(resolve_model_path(model_name), max_seq_length=max_length)
    pool = models.Pooling(word.get_word_embedding_dimension(), pooling_mode=pooling)
    st = SentenceTransformer(modules=[word, pool, models.Normalize()], device="cpu")
    emb = st.encode(
        list(texts), batch_size=batch_size, convert_to_numpy=True, show_progress_bar=len(texts) > 1000
    )
    return np.asarray(emb, dtype=np.float32)


def texts_hash(texts: Sequence[str]) -> str:
    h = hashlib.sha256()
    for t in texts:
        h.update(t.encode())
        h.update(b"\x00")
    return h.hexdigest()


def encode_cached(
    model_name: str,
    texts: Sequence[str],
    cache_dir: str | Path | None,
    pooling: str = "mean",
    max_length: int = 256,
    batch_size: int = 64,
) -> np.ndarray:
    """:func:`encode_texts` with an on-disk cache (``.npy``, written atomically).

    The key is a hash of (model, pooling, max_length, every text), so a changed corpus or encoder
    never reuses stale vectors. ``cache_dir=None`` disables the cache.
    """
    if cache_dir is None:
        return encode_texts(model_name, texts, pooling, max_length, batch_size)
    key = hashlib.sha256(f"{model_name}|{pooling}|{max_length}|{texts_hash(texts)}".encode()).hexdigest()[:20]
    path = Path(cache_dir) / f"emb-{key}.npy"
    if path.is_file():
        emb = np.load(path)
        if emb.shape[0] == len(texts):
            logger.info("loaded %d cached embeddings from %s", len(texts), path)
            return emb
    logger.info("encoding %d texts with %s (%s pooling); caching to %s", len(texts), model_name, pooling, path)
    emb = encode_texts(model_name, texts, pooling, max_length, batch_size)
    with atomic_path(path) as tmp, tmp.open("wb") as fh:
        np.save(fh, emb)
    return emb


def dense_topk(query_emb: np.ndarray, corpus_emb: np.ndarray, k: int, chunk_size: int = 1024) -> tuple[
    np.ndarray, np.ndarray
]:
    """Exact inner-product top-k: ``(scores (Q, k), indices (Q, k))``, best first."""
    try:
        from judgeloop.retrieval.mining import exact_topk
    except ImportError:
        exact_topk = None  # type: ignore[assignment]
    k = min(k, corpus_emb.shape[0])
    if exact_topk is not None:
        import torch

        scores, idx = exact_topk(torch.from_numpy(query_emb), torch.from_numpy(corpus_emb), k, chunk_size)
        return np.asarray(scores.numpy(), dtype=np.float64), np.asarray(idx.numpy(), dtype=np.int64)
    sims = query_emb @ corpus_emb.T  # (Q, N)
    idx = np.argsort(-sims, axis=1, kind="stable")[:, :k]
    return np.take_along_axis(sims, idx, axis=1).astype(np.float64), idx.astype(np.int64)
