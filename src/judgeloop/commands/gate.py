"""``judgeloop gate``: fit the weak-retrieval gate on a calibration split of a BEIR data set and report on
test (:mod:`judgeloop.retrieval.gate_study`); writes ``report.json``, ``report.md``, ``gate.json`` (the
fitted gate) and ``config.yaml`` under ``output_dir``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from judgeloop.config import to_yaml
from judgeloop.io import atomic_write_json, atomic_write_text
from judgeloop.logging import get_logger
from judgeloop.retrieval.gate_study import GateConfig, gate_study, render_markdown

logger = get_logger(__name__)

__all__ = ["GateConfig", "run"]


def run(cfg: GateConfig) -> dict[str, Any]:
    """Run the gate study of ``cfg`` and write its outputs; returns the report."""
    report, gate = gate_study(cfg)
    out_dir = Path(cfg.output_dir)
    atomic_write_text(out_dir / "config.yaml", to_yaml(cfg))
    atomic_write_json(out_dir / "gate.json", gate.state_dict())
    atomic_write_json(out_dir / "report.json", report)
    atomic_write_text(out_dir / "report.md", render_markdown(report))
    logger.info("wrote %s", out_dir / "report.md")
    return report
