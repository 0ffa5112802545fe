"""``judgeloop agent``: the retrieval agent's loop on one data set: explore, fit on the calibration split
(judge calibrator, gate, conformal set, answer confidence, two learned controllers), run every policy on the
test split (:mod:`judgeloop.studies.agent`); writes ``traces.jsonl`` (one row per test question, every
policy's trace), ``report.json``, ``report.md``, ``config.yaml`` and ``lm_cache.jsonl`` (the LM outputs: a
killed run restarted on the same folder continues from them) under ``output_dir``."""

from __future__ import annotations

from typing import Any

from judgeloop.reports import write_report
from judgeloop.rundir import run_dir
from judgeloop.studies.agent import AgentConfig, agent_study
from judgeloop.studies.agent_report import render_markdown

__all__ = ["AgentConfig", "run"]


def run(cfg: AgentConfig) -> dict[str, Any]:
    """Run the agent study of ``cfg`` and write its outputs; returns the report."""
    with run_dir(cfg.output_dir, "agent", cfg, on_match="keep"):
        report, traces = agent_study(cfg, cfg.output_dir)
        write_report(cfg.output_dir, cfg, report, render_markdown(report), {"traces.jsonl": traces})
    return report
