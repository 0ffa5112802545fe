"""``judgeloop gate``: fit the weak-retrieval gate on a calibration split of a BEIR data set and report on
test (:mod:`judgeloop.studies.gate`); writes ``report.json``, ``report.md``, ``gate.json`` (the
fitted gate) and ``config.yaml`` under ``output_dir``."""

from __future__ import annotations

from typing import Any

from judgeloop.reports import write_report
from judgeloop.rundir import run_dir
from judgeloop.studies.gate import GateConfig, gate_study, render_markdown

__all__ = ["GateConfig", "run"]


def run(cfg: GateConfig) -> dict[str, Any]:
    """Run the gate study of ``cfg`` and write its outputs; returns the report."""
    with run_dir(cfg.output_dir, "gate", cfg):
        report, gate = gate_study(cfg)
        write_report(cfg.output_dir, cfg, report, render_markdown(report), {"gate.json": gate.state_dict()})
    return report
