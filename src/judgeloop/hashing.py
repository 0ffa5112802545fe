"""Stable digests: cache keys and fingerprints that are the same on every machine and Python run
(never ``hash()``, which is salted per process)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from typing import Any


def texts_digest(parts: Iterable[str]) -> str:
    """SHA-256 hex digest of a sequence of strings, each NUL-terminated (so ``["ab"]`` != ``["a", "b"]``)."""
    h = hashlib.sha256()
    for part in parts:
        h.update(part.encode())
        h.update(b"\x00")
    return h.hexdigest()


def json_digest(obj: Any, length: int = 24) -> str:
    """Short SHA-256 hex digest of a JSON-serializable key (dict keys sorted, so order does not matter)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:length]


def derive_seed(*parts: object) -> int:
    """A stable 31-bit seed from any parts (run seed, step, phase, rank): sampling is reproducible per step,
    so a resumed run draws the same samples as an uninterrupted one."""
    digest = hashlib.sha256("\x00".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF
