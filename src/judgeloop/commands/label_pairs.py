"""``judgeloop label-pairs --config CONFIG judge_path=DIR data.path=FILE output_dir=DIR``: label a
preference dataset with a saved calibrated judge (:mod:`judgeloop.preference_labels`).

Writes ``labeled.jsonl`` and ``dataset/`` (a TRL-ready dataset: ``prompt``, ``chosen``, ``rejected``,
``p_chosen`` ...), ``report.json``, ``report.md`` and the resolved ``config.yaml`` under ``output_dir``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from judgeloop.judges.calibrated import check_judge_path
from judgeloop.logging import get_logger
from judgeloop.preference_labels import (
    LabelPairsConfig,
    label,
    render_label_report,
    write_dataset,
)
from judgeloop.reports import write_report
from judgeloop.rundir import run_dir

logger = get_logger(__name__)

__all__ = ["LabelPairsConfig", "run"]


def run(cfg: LabelPairsConfig) -> dict[str, Any]:
    """Label the pairs and write the dataset and the report; returns the report."""
    check_judge_path(cfg.judge_path)
    with run_dir(cfg.output_dir, "label-pairs", cfg):
        rows, report = label(cfg)
        out = Path(cfg.output_dir)
        write_dataset(out, rows)
        write_report(out, cfg, report, render_label_report(report))
    logger.info("\n%s", render_label_report(report).split("\n\n")[1])
    return report
