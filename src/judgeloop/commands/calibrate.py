"""``judgeloop calibrate``: how trustworthy is a judge's preference, before and after calibration?

The lab is :mod:`judgeloop.calibration.lab`; this shell runs it and writes ``report.json``,
``report.md``, ``reliability.png``, ``predictions.jsonl``, ``calibrators/<method>.json`` and the
resolved ``config.yaml`` under ``output_dir``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from judgeloop.calibration.lab import CalibrateConfig, calibration_lab, render_markdown, render_table
from judgeloop.calibration.reliability import reliability_diagram
from judgeloop.config import to_yaml
from judgeloop.io import atomic_write_json, atomic_write_jsonl, atomic_write_text
from judgeloop.logging import get_logger

logger = get_logger(__name__)

__all__ = ["CalibrateConfig", "run"]


def run(cfg: CalibrateConfig) -> dict[str, Any]:
    """Run the lab of ``cfg`` and write its outputs; returns the report."""
    lab = calibration_lab(cfg)
    out_dir = Path(cfg.output_dir)
    atomic_write_jsonl(out_dir / "predictions.jsonl", lab.predictions)
    for method, cal in lab.calibrators.items():
        cal.save(out_dir / "calibrators" / f"{method}.json")
    title = f"{cfg.judge.type} judge, {cfg.labels.type} labels, {cfg.data.format}"
    reliability_diagram(lab.probs, lab.labels, out_dir / "reliability.png", cfg.num_bins, title=title)
    atomic_write_text(out_dir / "config.yaml", to_yaml(cfg))
    atomic_write_text(out_dir / "report.md", render_markdown(lab.report))
    atomic_write_json(out_dir / "report.json", lab.report)
    logger.info("wrote %s", out_dir / "report.json")
    logger.info("\n%s", render_table(lab.report))
    return lab.report
