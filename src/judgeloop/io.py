"""Atomic file output and strict JSONL input.

Outputs and checkpoints are written to a temporary sibling and moved into place with
``os.replace``, so a killed run leaves either the old file or the new one, never half of one.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any


class DataError(ValueError):
    """Input data is missing or malformed; the message names the file, the line and the fix."""


def _json_default(obj: Any) -> Any:
    try:
        import numpy as np

        if isinstance(obj, np.generic):
            return obj.item()
        if isinstance(obj, np.ndarray):
            return obj.tolist()
    except ImportError:  # pragma: no cover
        pass
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"object of type {type(obj).__name__} is not JSON serializable")


def _clean_floats(obj: Any) -> Any:
    """Replace NaN/inf by None so every JSON we write is strict JSON."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _clean_floats(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean_floats(v) for v in obj]
    return obj


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path in the destination folder; move it onto ``path`` on success."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        os.replace(tmp_path, path)
    finally:
        if tmp_path.exists():
            tmp_path.unlink()


def atomic_write_text(path: str | Path, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def atomic_write_json(path: str | Path, obj: Any, indent: int = 2) -> None:
    text = json.dumps(_clean_floats(obj), indent=indent, default=_json_default, allow_nan=False)
    atomic_write_text(path, text + "\n")


def atomic_write_jsonl(path: str | Path, rows: Iterable[dict[str, Any]]) -> None:
    with atomic_path(path) as tmp, tmp.open("w") as fh:
        for row in rows:
            fh.write(json.dumps(_clean_floats(row), default=_json_default, allow_nan=False) + "\n")


@contextlib.contextmanager
def atomic_dir(path: str | Path) -> Iterator[Path]:
    """Yield a temporary directory; on success it replaces ``path`` (a checkpoint, a saved model)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    try:
        yield tmp
        if path.exists():
            old = path.with_name(f".{path.name}.old")
            if old.exists():
                shutil.rmtree(old)
            os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old)
        else:
            os.replace(tmp, path)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


def read_jsonl(path: str | Path, required: Iterable[str] = ()) -> list[dict[str, Any]]:
    """Read a JSONL file strictly: every non-blank line an object holding the ``required`` fields."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"data file '{path}' does not exist; check the path (data.path=...)")
    required = list(required)
    rows: list[dict[str, Any]] = []
    with path.open() as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(
                    f"{path}:{lineno}: not valid JSON ({err.msg}); each line must be one JSON object"
                ) from err
            if not isinstance(row, dict):
                raise DataError(f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}")
            missing = [k for k in required if k not in row]
            if missing:
                raise DataError(
                    f"{path}:{lineno}: missing field(s) {missing}; present: {sorted(row)}. "
                    "Map your field names in the config (e.g. data.fields.article=text)"
                )
            rows.append(row)
    if not rows:
        raise DataError(f"data file '{path}' holds no rows")
    return rows
