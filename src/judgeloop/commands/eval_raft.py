"""``judgeloop eval-raft``: answer accuracy of a base and a RAFT-tuned model in three document settings
(:mod:`judgeloop.raft.evaluation`); writes ``eval_report.json`` and ``eval_report.md`` under ``output_dir``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from judgeloop.io import atomic_write_json, atomic_write_text
from judgeloop.raft.evaluation import EvalRaftConfig, evaluate_raft, render_markdown
from judgeloop.rundir import run_dir

__all__ = ["EvalRaftConfig", "run"]


def run(cfg: EvalRaftConfig) -> dict[str, Any]:
    """Evaluate base (and tuned) model; write ``eval_report.json`` / ``.md``; return the report."""
    with run_dir(cfg.output_dir, "eval-raft", cfg):
        report = evaluate_raft(cfg)
        out = Path(cfg.output_dir)
        atomic_write_json(out / "eval_report.json", report)
        atomic_write_text(out / "eval_report.md", render_markdown(report))
    return report
