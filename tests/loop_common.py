"""What the loop's tests share: the repository, the tiny config and its fast settings, a row comparison."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "feedback_loop" / "tiny.yaml"


FAST = [
    "judge.model=judgeloop-tiny/encoder",
    "judge.cache_size=0",
    "policy.sft_steps=60",
    "max_steps=4",
    "eval_every_n_steps=2",
    "calibration.recalibrate_every_n_steps=2",
    "calibration.num_articles=40",
    "calibration.min_points=4",
    "num_eval_articles=4",
    "num_validation_articles=4",
    "progress_bar=false",
    "log_with=[jsonl]",
    "data.embedded_size=120",
    "generation.max_new_tokens=8",
]


def same_row(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], float) and isinstance(b[k], float):
            assert a[k] == pytest.approx(b[k], rel=1e-6, abs=1e-9), k
        else:
            assert a[k] == b[k], k
