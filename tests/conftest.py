"""Shared test fixtures: paths to the repository and to the shared data sets."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(os.environ.get("JUDGELOOP_SHARED_DATA", REPO.parent / "shared" / "data"))

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture
def repo() -> Path:
    return REPO


@pytest.fixture
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.skip(f"shared data not found at {SHARED_DATA}")
    return SHARED_DATA


@pytest.fixture(scope="session")
def tiny_calibration(tmp_path_factory) -> Path:
    """A real ``judgeloop calibrate`` run with the tiny encoder on the embedded corpus (seconds): its
    output folder, with ``calibrated_judge/<method>/`` for raw, platt, isotonic, temperature and
    feature_platt."""
    from judgeloop.cli import main

    out = tmp_path_factory.mktemp("tiny_calibration") / "run"
    rc = main(
        [
            "calibrate",
            "--config",
            str(REPO / "configs/calibrate/embedded_embedding.yaml"),
            "judge.model=judgeloop-tiny/encoder",
            "data.embedded_size=120",
            "max_pairs_per_article=6",
            f"output_dir={out}",
        ]
    )
    assert rc == 0
    return out
