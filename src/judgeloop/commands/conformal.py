"""``judgeloop conformal``: conformal retrieval sets on a BEIR data set, checked over random splits.

The study (schema, trials, online comparison, report) is :mod:`judgeloop.studies.conformal`;
this shell runs it and writes ``config.yaml``, ``report.json`` and ``report.md`` under ``output_dir``.
"""

from __future__ import annotations

from typing import Any

from judgeloop.reports import write_report
from judgeloop.rundir import run_dir
from judgeloop.studies.conformal import ConformalConfig, conformal_study, render_markdown

__all__ = ["ConformalConfig", "run"]


def run(cfg: ConformalConfig) -> dict[str, Any]:
    """Run the study of ``cfg`` and write its report; returns the report."""
    with run_dir(cfg.output_dir, "conformal", cfg):
        report = conformal_study(cfg)
        write_report(cfg.output_dir, cfg, report, render_markdown(report))
    return report
