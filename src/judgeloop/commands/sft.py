"""``judgeloop sft --config configs/raft/sft_pubmedqa.yaml``: LoRA SFT on a RAFT set (TRL ``SFTTrainer``).

The training job itself is the readable script ``recipes/sft_raft.py``; its schema and data preparation
are :mod:`judgeloop.raft.sft`. ``run`` launches the recipe under ``accelerate launch`` (or, with
``launch=inline``, in this process - for tests and debugging).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

from judgeloop.devices import check_device
from judgeloop.logging import get_logger
from judgeloop.raft.sft import SftConfig
from judgeloop.recipes import recipe_path
from judgeloop.rundir import lent_to_child, run_dir
from judgeloop.tracking import check_trackers

logger = get_logger(__name__)

__all__ = ["SftConfig", "run"]


def run(cfg: SftConfig) -> dict[str, Any]:
    """Launch ``recipes/sft_raft.py`` with this config; returns the recipe's ``train_report.json``."""
    check_device(cfg.device)  # before anything is written or launched
    check_trackers([t for t in cfg.log_with if t != "jsonl"])
    with run_dir(cfg.output_dir, "sft", cfg):
        return _launch(cfg)


def _launch(cfg: SftConfig) -> dict[str, Any]:
    import json

    from judgeloop.config import to_yaml
    from judgeloop.io import atomic_write_text

    out = Path(cfg.output_dir)
    cfg_path = out / "sft_config.yaml"
    atomic_write_text(cfg_path, to_yaml(cfg))
    recipe = recipe_path("sft_raft.py")
    with lent_to_child(out) as env:  # the recipe writes into the folder this run holds
        if cfg.launch == "inline":
            _inline(recipe, cfg_path)
        else:
            _accelerate_launch(cfg, recipe, cfg_path, env)
    return json.loads((out / "train_report.json").read_text())


def _inline(recipe: Path, cfg_path: Path) -> None:
    import runpy

    status = runpy.run_path(str(recipe), run_name="sft_raft")["main"](["--config", str(cfg_path)])
    if status:  # the recipe has said why in one line
        raise SystemExit(status)


def _accelerate_launch(cfg: SftConfig, recipe: Path, cfg_path: Path, env: dict[str, str]) -> None:
    cmd = [sys.executable, "-m", "accelerate.commands.launch"]
    if cfg.accelerate_config:
        cmd += ["--config_file", cfg.accelerate_config]
    else:
        cmd += [
            "--num_processes",
            "1",
            "--num_machines",
            "1",
            "--mixed_precision",
            "no",
            "--dynamo_backend",
            "no",
        ]
    cmd += [str(recipe), "--config", str(cfg_path)]
    logger.info("launching: %s", " ".join(cmd))
    status = subprocess.run(cmd, env=env).returncode
    if status:  # the recipe has said why (one line for a refused setting, else its traceback)
        raise SystemExit(status)
