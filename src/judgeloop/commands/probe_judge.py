"""``judgeloop probe-judge``: which reward hacks fool which judge, and do debiasing and calibration help?

The probe is :mod:`judgeloop.studies.judge_probe` and its markdown :mod:`judgeloop.studies.probe_report`; this
shell runs it and writes ``report.json``, ``report.md``, ``pairs.jsonl`` (one row per judge, attack and
article) and the resolved ``config.yaml`` under ``output_dir``.
"""

from __future__ import annotations

from typing import Any

from judgeloop.logging import get_logger
from judgeloop.reports import write_report
from judgeloop.rundir import run_dir
from judgeloop.studies.judge_probe import ProbeConfig, probe
from judgeloop.studies.probe_report import health_warnings, render_markdown

logger = get_logger(__name__)

__all__ = ["ProbeConfig", "run"]


def run(cfg: ProbeConfig) -> dict[str, Any]:
    """Probe the judges of ``cfg`` and write the outputs; returns the report."""
    with run_dir(cfg.output_dir, "probe-judge", cfg):
        result = probe(cfg)
        markdown = render_markdown(result.report)
        write_report(cfg.output_dir, cfg, result.report, markdown, {"pairs.jsonl": result.rows})
    shown = 4 + 2 * len(health_warnings(result.report)) + len(cfg.attacks) + 2  # the warnings, the table
    logger.info("\n%s", "\n".join(markdown.splitlines()[:shown]))
    return result.report
