"""``judgeloop train-retriever``: evaluate a bi-encoder zero-shot, train it with InfoNCE on in-batch and
mined hard negatives, evaluate again (:mod:`judgeloop.retrieval.trainer` is the trainer).

Outputs under ``output_dir``: ``report.json`` / ``report.md``, ``model/`` (sentence-transformers
layout), ``negatives/epoch_<e>.jsonl``, ``checkpoints/step_<n>/``. ``recipes/train_retriever.py``
launches it under ``accelerate launch``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from judgeloop.distributed import gathered_state_dict
from judgeloop.io import atomic_write_json, atomic_write_text
from judgeloop.logging import get_logger
from judgeloop.retrieval.trainer import latest_checkpoint, render_markdown, train_retriever
from judgeloop.retrieval.trainer_config import TrainRetrieverConfig
from judgeloop.rundir import run_dir

logger = get_logger(__name__)

__all__ = ["TrainRetrieverConfig", "run"]


def run(cfg: TrainRetrieverConfig) -> dict[str, Any]:
    """Train and evaluate; the main process writes ``model/``, ``report.json`` and ``report.md``.

    ``output_dir`` is held for the run (:mod:`judgeloop.rundir`): a folder of this run is continued from
    its newest checkpoint (``train.resume``, started clean when it has none); one of another run is refused.
    """
    with run_dir(
        cfg.output_dir,
        "train-retriever",
        cfg,
        on_match="keep" if cfg.train.resume else "refuse",
        can_resume=lambda folder: latest_checkpoint(folder) is not None,
        hint="continue it with train.resume=true",
    ):
        return _run(cfg)


def _run(cfg: TrainRetrieverConfig) -> dict[str, Any]:
    report, encoder, accelerator = train_retriever(cfg)
    out = Path(cfg.output_dir)
    weights = gathered_state_dict(encoder.model)  # every process: under FSDP / ZeRO-3 each holds a shard
    if accelerator.is_main_process:
        encoder.save(out / "model", weights)
        atomic_write_json(out / "report.json", report)
        atomic_write_text(out / "report.md", render_markdown(report))
        logger.info("wrote %s", out / "report.json")
    accelerator.wait_for_everyone()
    accelerator.end_training()  # the trackers flush and close
    return report
