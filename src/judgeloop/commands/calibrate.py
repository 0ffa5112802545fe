"""``judgeloop calibrate``: how trustworthy is a judge's preference, before and after calibration?

The lab is :mod:`judgeloop.studies.calibration_lab`; this shell runs it and writes ``report.json``,
``report.md``, ``reliability.png``, ``predictions.jsonl``, ``calibrators/<method>.json``, one calibrated
judge per method (``calibrated_judge/<method>/``, raw included: ``CalibratedJudge.from_pretrained`` loads
it) and the resolved ``config.yaml`` under ``output_dir``. A run where every pair of a split failed judging
(a server that never answered) stops in one line giving the judge's status counts, and writes them to
``judge_status.json`` there.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from judgeloop.calibration import IdentityCalibrator
from judgeloop.calibration.reliability import reliability_diagram
from judgeloop.io import DataError, atomic_write_json
from judgeloop.judges.calibrated import CalibratedJudge
from judgeloop.logging import get_logger
from judgeloop.reports import write_report
from judgeloop.rundir import run_dir
from judgeloop.studies.calibration_lab import (
    CalibrateConfig,
    NothingJudged,
    calibration_lab,
    judge_card,
    render_markdown,
    render_table,
)

logger = get_logger(__name__)

JUDGE_STATUS_FILE = "judge_status.json"  # a run where every pair of a split failed judging: its counts

__all__ = ["CalibrateConfig", "run"]


def run(cfg: CalibrateConfig) -> dict[str, Any]:
    """Run the lab of ``cfg`` and write its outputs; returns the report."""
    with run_dir(cfg.output_dir, "calibrate", cfg):
        return _run(cfg)


def _run(cfg: CalibrateConfig) -> dict[str, Any]:
    out_dir = Path(cfg.output_dir)
    try:
        lab = calibration_lab(cfg)
    except NothingJudged as err:  # the counts the message points to, written where it says
        path = out_dir / JUDGE_STATUS_FILE
        atomic_write_json(path, {"judge": err.counts})
        raise DataError(f"{err}; the counts are in {path}") from None
    for method, cal in lab.calibrators.items():
        cal.save(out_dir / "calibrators" / f"{method}.json")
    # one calibrated judge per method (and raw: p = sigmoid(logit)), loadable by CalibratedJudge.from_pretrained
    for method, cal in {"raw": IdentityCalibrator().fit([], []), **lab.calibrators}.items():
        judge = CalibratedJudge(cfg.judge, cal, judge_card(cfg, lab.report, method), judge=lab.judge)
        judge.save_pretrained(out_dir / "calibrated_judge" / method)
    title = f"{cfg.judge.type} judge, {cfg.labels.type} labels, {cfg.data.format}"
    reliability_diagram(lab.probs, lab.labels, out_dir / "reliability.png", cfg.num_bins, title=title)
    write_report(
        out_dir, cfg, lab.report, render_markdown(lab.report), {"predictions.jsonl": lab.predictions}
    )
    logger.info("\n%s", render_table(lab.report))
    return lab.report
