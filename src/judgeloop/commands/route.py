"""``judgeloop route``: confidence routing for QA, retrieving only when the closed-book probe is unsure,
against four baselines (:mod:`judgeloop.routing.study`); writes ``report.json``, ``report.md``,
``predictions.jsonl`` and ``config.yaml`` under ``output_dir``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from judgeloop.config import to_yaml
from judgeloop.io import atomic_write_json, atomic_write_jsonl, atomic_write_text
from judgeloop.logging import get_logger
from judgeloop.routing.study import RouteConfig, render_markdown, route_study

logger = get_logger(__name__)

__all__ = ["RouteConfig", "run"]


def run(cfg: RouteConfig) -> dict[str, Any]:
    """Run the routing study of ``cfg`` and write its outputs; returns the report."""
    report, rows = route_study(cfg)
    out_dir = Path(cfg.output_dir)
    atomic_write_text(out_dir / "config.yaml", to_yaml(cfg))
    atomic_write_jsonl(out_dir / "predictions.jsonl", rows)
    atomic_write_json(out_dir / "report.json", report)
    atomic_write_text(out_dir / "report.md", render_markdown(report))
    logger.info("wrote %s", out_dir / "report.md")
    return report
