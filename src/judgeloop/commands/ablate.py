"""``judgeloop ablate --config CONFIG [k=v ...]``: the loop per calibration arm and seed, plus the summary table."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from judgeloop.loop.ablation import run_ablation
from judgeloop.loop.config import FeedbackLoopConfig

__all__ = ["FeedbackLoopConfig", "run"]


def run(cfg: FeedbackLoopConfig) -> dict[str, Any]:
    results = run_ablation(cfg)
    sys.stdout.write((Path(cfg.output_dir) / "results.md").read_text())
    return results
