"""``judgeloop route``: confidence routing for QA, retrieving only when the closed-book probe is unsure,
against four baselines (:mod:`judgeloop.studies.routing`); writes ``report.json``, ``report.md``,
``predictions.jsonl`` and ``config.yaml`` under ``output_dir``."""

from __future__ import annotations

from typing import Any

from judgeloop.reports import write_report
from judgeloop.rundir import run_dir
from judgeloop.studies.routing import RouteConfig, render_markdown, route_study

__all__ = ["RouteConfig", "run"]


def run(cfg: RouteConfig) -> dict[str, Any]:
    """Run the routing study of ``cfg`` and write its outputs; returns the report."""
    with run_dir(cfg.output_dir, "route", cfg):
        report, rows = route_study(cfg)
        write_report(cfg.output_dir, cfg, report, render_markdown(report), {"predictions.jsonl": rows})
    return report
