"""Embeddings of texts, cached on disk: the one cache of every bi-encoder run (the retriever's trainer, the
conformal, gate and routing studies).

A cache file ``<model>-<texts>.pt`` holds ``{"hashes", "emb"}``: each text's SHA-256 prefix and its
``(N, D)`` embedding. ``<model>`` fingerprints the encoder's weights and the settings that change an
embedding (pooling, normalization, the length that applies to queries or documents, encoding precision),
so a changed encoder, corpus or setting never reuses stale vectors, and runs from the same weights share
the files. A text is looked up by its hash in every file of the same model: a corpus with a few new or
edited documents encodes those only. Files are written atomically, by the main process. ``cache_dir: auto``
is ``embeddings/`` under the judgeloop cache (``$JUDGELOOP_CACHE``, else ``~/.cache/judgeloop``), never a
folder of the working directory.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from judgeloop.io import atomic_path
from judgeloop.logging import get_logger
from judgeloop.retrieval.encoder import BiEncoder

logger = get_logger(__name__)


def resolve_cache_dir(cache_dir: str | Path | None, kind: str = "embeddings") -> Path | None:
    """The folder a ``cache_dir`` setting names: ``auto`` is ``kind/`` under the judgeloop cache (shared by
    every run, whatever its working directory); None or empty: no cache; any other value: that folder.

    Args:
        cache_dir: the setting (``auto``, a folder, or None / empty).
        kind: the subfolder ``auto`` resolves to (``embeddings``; ``answers`` for the reader's answers).
    """
    if not cache_dir:
        return None
    if str(cache_dir) == "auto":
        from judgeloop.io import cache_dir as judgeloop_cache

        return judgeloop_cache() / kind
    return Path(cache_dir)


def _model_fingerprint(encoder: BiEncoder, is_query: bool) -> str:
    h = hashlib.sha256()
    for name, t in encoder.model.state_dict().items():
        h.update(name.encode())
        h.update(t.detach().float().cpu().numpy().tobytes())
    max_len = (encoder.query_max_length or encoder.max_length) if is_query else encoder.max_length
    h.update(f"{encoder.pooling}|{encoder.normalize}|{max_len}|{encoder.encode_precision}".encode())
    return h.hexdigest()[:16]


def _text_hashes(texts: Sequence[str]) -> list[str]:
    return [hashlib.sha256(t.encode()).hexdigest()[:20] for t in texts]


def _cached_rows(cache_dir: Path, model_fp: str, hashes: list[str]) -> tuple[torch.Tensor | None, list[int]]:
    """The rows of ``hashes`` that any cache file of this model holds, and the indices it holds nowhere:
    a corpus that gained or changed a few documents re-encodes those only."""
    emb: torch.Tensor | None = None
    missing = set(range(len(hashes)))
    for path in sorted(cache_dir.glob(f"{model_fp}-*.pt")):
        try:
            blob = torch.load(path)
        except Exception:  # a damaged cache file is only a miss
            logger.warning("ignoring unreadable embedding cache %s", path)
            continue
        if not isinstance(blob, dict) or "hashes" not in blob:
            continue
        row_of = {h: i for i, h in enumerate(blob["hashes"])}
        found = [i for i in sorted(missing) if hashes[i] in row_of]
        if not found:
            continue
        if emb is None:
            emb = torch.empty(len(hashes), blob["emb"].shape[1])
        emb[found] = blob["emb"][[row_of[hashes[i]] for i in found]]
        missing.difference_update(found)
        logger.info("reusing %d cached embeddings from %s", len(found), path)
        if not missing:
            break
    return emb, sorted(missing)


def encode_texts(
    encoder: BiEncoder,
    texts: Sequence[str],
    batch_size: int,
    is_query: bool,
    accelerator: Any = None,
    cache_dir: str | Path | None = None,
    desc: str | None = None,
) -> torch.Tensor:
    """(N, D) float32 CPU embeddings of ``texts``; sharded over processes under accelerate.

    With ``cache_dir`` (None: no cache), only the texts no cache file of this encoder holds are encoded,
    and the result is written back (module docstring); runs from the same weights share the files (the
    zero-shot corpus encoding of every retriever run from one base model, a study's corpus)."""
    cache_file, hashes = None, []
    emb: torch.Tensor | None = None
    todo = list(range(len(texts)))
    cache_dir = resolve_cache_dir(cache_dir)
    if cache_dir:
        model_fp, hashes = _model_fingerprint(encoder, is_query), _text_hashes(texts)
        texts_fp = hashlib.sha256("".join(hashes).encode()).hexdigest()[:16]
        cache_file = Path(cache_dir) / f"{model_fp}-{texts_fp}.pt"
        if Path(cache_dir).is_dir():
            emb, todo = _cached_rows(Path(cache_dir), model_fp, hashes)
            if emb is not None and not todo:
                return emb
            if emb is not None:
                logger.info("encoding the %d of %d texts no cache holds", len(todo), len(texts))
    fresh = _encode_fresh(encoder, [texts[i] for i in todo], batch_size, is_query, accelerator, desc)
    if emb is None:
        emb = fresh
    else:
        emb[todo] = fresh
    main = accelerator is None or accelerator.is_main_process
    if cache_file is not None and main:
        with atomic_path(cache_file) as tmp:
            torch.save({"hashes": hashes, "emb": emb}, tmp)
    return emb


def _encode_fresh(
    encoder: BiEncoder,
    texts: Sequence[str],
    batch_size: int,
    is_query: bool,
    accelerator: Any,
    desc: str | None,
) -> torch.Tensor:
    """(N, D) embeddings of ``texts``, sharded over the processes when there are several."""
    main = accelerator is None or accelerator.is_main_process
    if accelerator is None or accelerator.num_processes == 1:
        return encoder.encode(texts, batch_size=batch_size, show_progress=main, is_query=is_query, desc=desc)
    from accelerate.utils import gather_object

    # padded (the last index repeats) so every rank runs as many forward passes: under FSDP / ZeRO-3
    # each one is a collective; the repeated row is written twice with the same embedding
    with accelerator.split_between_processes(list(range(len(texts))), apply_padding=True) as idx:
        part = encoder.encode(
            [texts[i] for i in idx], batch_size, show_progress=main, is_query=is_query, desc=desc
        )
    pieces = gather_object([(idx, part)])
    emb = torch.empty(len(texts), part.shape[1])
    for piece_idx, piece in pieces:
        emb[piece_idx] = piece
    return emb
