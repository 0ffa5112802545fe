"""``judgeloop conformal``: conformal retrieval sets on a BEIR data set, checked over random splits.

The study (schema, trials, online comparison, report) is :mod:`judgeloop.retrieval.conformal_study`;
this shell runs it and writes ``config.yaml``, ``report.json`` and ``report.md`` under ``output_dir``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from judgeloop.config import to_yaml
from judgeloop.io import atomic_write_json, atomic_write_text
from judgeloop.logging import get_logger
from judgeloop.retrieval.conformal_study import ConformalConfig, conformal_study, render_markdown

logger = get_logger(__name__)

__all__ = ["ConformalConfig", "run"]


def run(cfg: ConformalConfig) -> dict[str, Any]:
    """Run the study of ``cfg`` and write its report; returns the report."""
    report = conformal_study(cfg)
    out_dir = Path(cfg.output_dir)
    atomic_write_text(out_dir / "config.yaml", to_yaml(cfg))
    atomic_write_json(out_dir / "report.json", report)
    atomic_write_text(out_dir / "report.md", render_markdown(report))
    logger.info("wrote %s", out_dir / "report.md")
    return report
