"""``judgeloop answer``: retrieve, read, and answer or refuse with a reason, the refusal threshold chosen on a
risk-coverage curve (:mod:`judgeloop.studies.answer`); writes ``report.json``, ``report.md``,
``risk_coverage.png``, ``answers.jsonl`` (one row per question), ``conformal.json`` (the conformal retriever,
with the fingerprint of the pool it was fitted on), ``abstention.json`` (the fitted confidence and threshold)
and ``config.yaml`` under ``output_dir``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from judgeloop.reports import write_report
from judgeloop.retrieval.conformal import save_conformal_file
from judgeloop.rundir import run_dir
from judgeloop.studies.answer import AnswerConfig, answer_study, plot_risk_coverage, render_markdown

__all__ = ["AnswerConfig", "run"]


def run(cfg: AnswerConfig) -> dict[str, Any]:
    """Run the answer study of ``cfg`` and write its outputs; returns the report."""
    with run_dir(cfg.output_dir, "answer", cfg):
        report, rows, state = answer_study(cfg)
        out = Path(cfg.output_dir)
        save_conformal_file(out / "conformal.json", state["conformal"], state["corpus"], state["scorer"])
        plot_risk_coverage(report, rows, out / "risk_coverage.png")
        extra = {"answers.jsonl": rows, "abstention.json": {k: state[k] for k in ("confidence", "threshold")}}
        write_report(out, cfg, report, render_markdown(report), extra)
    return report
