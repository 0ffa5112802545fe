"""Writing a command's outputs: the resolved config, any extra files, ``report.json`` and ``report.md``.

Every file is written atomically (:mod:`judgeloop.io`), the config first, the report last, so a
``report.json`` on disk always belongs to a finished run.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from judgeloop.config import to_yaml
from judgeloop.io import atomic_write_json, atomic_write_jsonl, atomic_write_text
from judgeloop.logging import get_logger

logger = get_logger(__name__)


def write_report(
    out_dir: str | Path,
    cfg: Any,
    report: Mapping[str, Any],
    markdown: str,
    extra: Mapping[str, Any] | None = None,
) -> Path:
    """Write ``config.yaml``, then each ``extra`` file (a list of rows to ``.jsonl``, anything else to
    ``.json``), then ``report.json`` and ``report.md`` under ``out_dir``; returns the markdown path."""
    out = Path(out_dir)
    atomic_write_text(out / "config.yaml", to_yaml(cfg))
    for name, obj in (extra or {}).items():
        if name.endswith(".jsonl"):
            atomic_write_jsonl(out / name, obj)
        elif name.endswith(".json"):
            atomic_write_json(out / name, obj)
        else:
            raise ValueError(f"write_report: extra file {name!r} must end in .json or .jsonl")
    atomic_write_json(out / "report.json", report)
    atomic_write_text(out / "report.md", markdown)
    logger.info("wrote %s", out / "report.md")
    return out / "report.md"
