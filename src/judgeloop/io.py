"""Atomic file output and strict text / JSONL input.

Outputs and checkpoints are written to a temporary sibling and moved into place with
``os.replace``, so a killed run leaves either the old file or the new one, never half of one. They get
the permissions a plain ``open(path, "w")`` would give (0666 / 0777 less the umask), not the 0600 of a
temporary file.

Input is read strictly: every reader goes through :func:`read_lines`, which names the file, the line
and the byte offset of bytes that are not UTF-8, and :func:`read_jsonl`, which checks that each row is
an object with the required fields of the required kinds (a ``text`` field that holds a number or null
is an error naming the line, not a ``str()`` of it). :func:`check_row` is that check for one row, for
rows of other sources (a saved Hugging Face dataset) and for objects nested in a row.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from judgeloop.errors import UserError
from judgeloop.logging import get_logger

logger = get_logger(__name__)
T = TypeVar("T")


class DataError(UserError):
    """Input data is missing or malformed; the message names the file, the line and the fix."""


def cache_dir() -> Path:
    """Where judgeloop keeps what it builds once and reuses (models unpacked from wheels, F32 GGUFs,
    embedding caches): ``$JUDGELOOP_CACHE`` or ``~/.cache/judgeloop``."""
    root = os.environ.get("JUDGELOOP_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "judgeloop")
    return Path(root)


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


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


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
        os.chmod(tmp_path, 0o666 & ~_umask())
        os.replace(tmp_path, path)
    finally:
        if tmp_path.exists():
            tmp_path.unlink()


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically (a temporary sibling moved into place)."""
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def json_text(obj: Any, indent: int | None = 2) -> str:
    """``obj`` as strict JSON text: NaN/inf become null, numpy values and paths become plain values."""
    return json.dumps(_clean_floats(obj), indent=indent, default=_json_default, allow_nan=False)


def atomic_write_json(path: str | Path, obj: Any, indent: int = 2) -> None:
    """Write ``obj`` as strict JSON (NaN/inf become null) to ``path`` atomically."""
    atomic_write_text(path, json_text(obj, indent) + "\n")


def atomic_write_jsonl(path: str | Path, rows: Iterable[dict[str, Any]]) -> None:
    """Write one strict-JSON line per row to ``path`` atomically."""
    with atomic_path(path) as tmp, tmp.open("w") as fh:
        for row in rows:
            fh.write(json.dumps(_clean_floats(row), default=_json_default, allow_nan=False) + "\n")


def _exchange(a: Path, b: Path) -> bool:
    """Swap two existing paths in one atomic step (Linux ``renameat2(RENAME_EXCHANGE)``); False where the
    call is not available (other systems, old kernels, some file systems)."""
    import ctypes
    import ctypes.util
    import sys

    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    rc = renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange)
    return rc == 0


def replace_dir(tmp: Path, path: Path) -> None:
    """Move the finished folder ``tmp`` onto ``path`` (a sibling).

    When ``path`` exists the two are swapped in one atomic step where the system allows it, so ``path``
    is never absent; elsewhere the old copy is first moved to ``.NAME.old`` (a kill between the two
    renames leaves it there, and :func:`judgeloop.loop.run_state_files.remove_orphans` moves it back).
    """
    os.chmod(tmp, 0o777 & ~_umask())
    if not path.exists():
        os.replace(tmp, path)
    elif _exchange(tmp, path):
        shutil.rmtree(tmp)  # now holds the old copy
    else:
        old = path.with_name(f".{path.name}.old")
        if old.exists():
            shutil.rmtree(old)
        os.replace(path, old)
        os.replace(tmp, path)
        shutil.rmtree(old)


@contextlib.contextmanager
def atomic_dir(path: str | Path) -> Iterator[Path]:
    """Yield a temporary directory; on success it replaces ``path`` (a checkpoint, a saved model) through
    :func:`replace_dir`; on failure it is removed and ``path`` is untouched."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    try:
        yield tmp
        replace_dir(tmp, path)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


def read_lines(path: str | Path) -> Iterator[tuple[int, str]]:
    """``(line number, text)`` for each line of a UTF-8 file (a leading BOM is dropped).

    Bytes that are not UTF-8 raise :class:`DataError` naming the file, the line and the byte offset in
    the file, so a latin-1 export is found in one step instead of as a ``UnicodeDecodeError`` traceback.
    """
    path = Path(path)
    offset = 0
    with path.open("rb") as fh:
        for lineno, raw in enumerate(fh, start=1):
            try:
                text = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
            except UnicodeDecodeError as err:
                bad = raw[err.start]
                raise DataError(
                    f"{path}:{lineno}: byte 0x{bad:02x} at offset {offset + err.start} is not UTF-8; "
                    "re-encode the file as UTF-8 (e.g. iconv -f latin1 -t utf-8 IN > OUT)"
                ) from None
            offset += len(raw)
            yield lineno, text


def read_json(path: str | Path, what: str = "JSON file", fix: str = "write it again") -> dict[str, Any]:
    """Read a JSON file strictly: it must exist, be UTF-8 strict JSON (no NaN/Infinity) and hold an object.

    Anything else (missing, truncated, invalid, another top-level shape) is a :class:`DataError` in one
    line naming the file, ``what`` it should be and the ``fix``.
    """
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{what} {path} does not exist; {fix}")

    def no_constant(name: str) -> Any:
        raise ValueError(f"{name} is not strict JSON")

    try:
        obj = json.loads(path.read_bytes().decode("utf-8-sig"), parse_constant=no_constant)
    except UnicodeDecodeError as err:
        raise DataError(f"{what} {path}: byte at offset {err.start} is not UTF-8 (damaged?); {fix}") from None
    except json.JSONDecodeError as err:
        raise DataError(
            f"{what} {path}: not valid JSON ({err.msg}: line {err.lineno} column {err.colno}; truncated or "
            f"damaged?); {fix}"
        ) from None
    except ValueError as err:
        raise DataError(f"{what} {path}: {err}; {fix}") from None
    if not isinstance(obj, dict):
        raise DataError(f"{what} {path}: expected a JSON object, got {type(obj).__name__}; {fix}")
    return obj


# what each field kind of read_jsonl accepts, and how its error names it
_KINDS: dict[str, tuple[str, Any]] = {
    "text": ("a string", lambda v: isinstance(v, str)),
    "texts": (
        "a string or a list of strings",
        lambda v: isinstance(v, str) or (isinstance(v, list) and all(isinstance(x, str) for x in v)),
    ),
    "id": (
        "a string or an integer",
        lambda v: isinstance(v, str) or (isinstance(v, int) and not isinstance(v, bool)),
    ),
    "number": (
        "a number",
        lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    ),
    "strings": (
        "a list of strings",
        lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
    ),
    "spans": (
        "a list of strings or of {'text': string} objects",
        lambda v: (
            isinstance(v, list)
            and all(isinstance(x, str) or (isinstance(x, dict) and isinstance(x.get("text"), str)) for x in v)
        ),
    ),
    "chat": (
        "a string or a list of {'role', 'content'} messages with string content",
        lambda v: (
            isinstance(v, str)
            or (
                isinstance(v, list)
                and all(
                    isinstance(m, dict)
                    and isinstance(m.get("content"), str)
                    and isinstance(m.get("role", ""), str)
                    for m in v
                )
            )
        ),
    ),
    "bool": ("true or false", lambda v: isinstance(v, bool)),
    "list": ("a list", lambda v: isinstance(v, list)),
    "mapping": ("an object", lambda v: isinstance(v, dict)),
}


def check_kind(value: Any, kind: str, where: str, name: str) -> Any:
    """``value`` if it is of ``kind`` (a key of the table above); else a DataError naming ``where``/``name``."""
    desc, ok = _KINDS[kind]
    if not ok(value):
        raise DataError(
            f"{where}: field '{name}' must be {desc}, got {_shown(value)}; "
            "fix the row or map another field (data.fields.*)"
        )
    return value


def _shown(value: Any) -> str:
    """A value as its JSON kind and a short JSON text: ``null``, ``number 3``, ``string 'abc'``."""
    if value is None:
        return "null"
    kind = {bool: "boolean", int: "number", float: "number", str: "string", list: "list", dict: "object"}
    shown = repr(value)
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    return f"{kind.get(type(value), type(value).__name__)} {shown}"


def check_row(
    row: dict[str, Any], where: str, required: Iterable[str] = (), kinds: dict[str, str] | None = None
) -> dict[str, Any]:
    """Check one input row (from any file format): the ``required`` fields present, each field of
    ``kinds`` of its kind; returns the row without the optional fields of ``kinds`` that hold null, so a
    null optional field reads as absent (never as the text ``"None"``). A required field that holds null
    is an error. Every reader of user data goes through here: :func:`read_jsonl` for JSONL, the readers
    of Hugging Face datasets (``label-pairs``' saved ones, ``data.format=hf``) row by row, and the readers
    of objects nested in a row (SummEval's summaries, mined negatives) with ``where`` naming them.

    Raises:
        DataError: naming ``where`` (file and line), the field, what it holds and what it must hold.
    """
    required = list(required)
    missing = [k for k in required if k not in row]
    if missing:
        raise DataError(
            f"{where}: missing field(s) {missing}; present: {sorted(row)}. "
            "Map your field names in the config (e.g. data.fields.article=text)"
        )
    kinds = kinds or {}
    unknown = set(kinds.values()) - set(_KINDS)
    if unknown:  # a programming error, not a data error
        raise ValueError(f"unknown field kind(s) {sorted(unknown)}; valid: {sorted(_KINDS)}")
    nulls = [name for name in kinds if name in row and row[name] is None and name not in required]
    for name, kind in kinds.items():
        if name in row and name not in nulls:
            check_kind(row[name], kind, where, name)
    return {k: v for k, v in row.items() if k not in nulls} if nulls else row


def read_jsonl(
    path: str | Path,
    required: Iterable[str] = (),
    kinds: dict[str, str] | None = None,
) -> list[dict[str, Any]]:
    """Read a JSONL file strictly: every non-blank line an object holding the ``required`` fields.

    ``kinds`` maps a field to what it must hold when present: ``text`` (a string), ``texts`` (a string or
    a list of strings), ``strings`` (a list of strings; a bare string is refused, not read letter by
    letter), ``spans`` (a list of strings or of ``{"text": ...}`` objects), ``chat`` (a string or a list
    of ``{"role", "content"}`` messages), ``id`` (a string or an integer), ``number``, ``bool``, ``list``
    or ``mapping``; an optional field that holds null is dropped from the row (:func:`check_row`). A
    mismatch, bytes that are not UTF-8, or a line that is not a JSON object is a :class:`DataError`
    naming the file and line.
    """
    path = Path(path)
    if not path.is_file():
        raise DataError(f"data file '{path}' does not exist; check the path (data.path=...)")
    required = list(required)
    kinds = dict(kinds or {})
    check_row({}, str(path), (), kinds)  # an unknown kind fails before the file is read
    rows: list[dict[str, Any]] = []
    for lineno, line in read_lines(path):
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
        rows.append(check_row(row, f"{path}:{lineno}", required, kinds))
    if not rows:
        raise DataError(f"data file '{path}' holds no rows")
    return rows


def first_of_each_id(
    items: Iterable[T],
    id_of: Callable[[T], str],
    text_of: Callable[[T], Any],
    what: str,
    on_conflict: str = "first",
) -> list[T]:
    """The first item of each id, in order.

    Exact repeats are dropped and counted. An id that comes back with *other* text is a data problem the
    user must see: with ``on_conflict="error"`` a :class:`DataError` names it; with ``"first"`` a warning
    names up to three such ids and the first occurrence is kept.
    """
    kept: dict[str, T] = {}
    conflicts: list[str] = []
    repeats = 0
    for item in items:
        key = id_of(item)
        if key in kept:
            repeats += 1
            if text_of(kept[key]) != text_of(item) and key not in conflicts:
                conflicts.append(key)
            continue
        kept[key] = item
    if conflicts and on_conflict == "error":
        raise DataError(
            f"{what}: id '{conflicts[0]}' appears again with different text ({len(conflicts)} such id(s)); "
            "give each its own id, or set data.duplicate_ids=first to keep the first of each"
        )
    if conflicts:
        shown = ", ".join(f"'{c}'" for c in conflicts[:3])
        logger.warning(
            "%s: %d id(s) appear again with different text (%s%s); kept the first of each",
            what,
            len(conflicts),
            shown,
            ", ..." if len(conflicts) > 3 else "",
        )
    if repeats:
        logger.info("%s: dropped %d rows with a repeated id (kept the first of each)", what, repeats)
    return list(kept.values())


def finite_or_none(values: dict[str, Any]) -> dict[str, Any]:
    """NaN/inf -> None, so metrics compare equal after a JSON round trip (checkpoint resume)."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in values.items()}
