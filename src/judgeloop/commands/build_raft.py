"""``judgeloop build-raft --config configs/raft/pubmedqa.yaml``: build a RAFT data set and its stats.

Writes ``train.jsonl`` / ``eval.jsonl`` (chat ``messages`` + ``meta``), ``dataset/`` (a
``datasets.DatasetDict`` for ``load_from_disk``), ``stats.json`` and the resolved ``config.yaml``
under ``output_dir``. The schema is :class:`judgeloop.raft.builder.BuildRaftConfig`.
"""

from __future__ import annotations

from typing import Any

from judgeloop.logging import get_logger
from judgeloop.raft.builder import BuildRaftConfig, build_raft, save_raft
from judgeloop.rundir import run_dir

logger = get_logger(__name__)

__all__ = ["BuildRaftConfig", "run"]


def run(cfg: BuildRaftConfig) -> dict[str, Any]:
    """Build, save, and return ``stats``."""
    with run_dir(cfg.output_dir, "build-raft", cfg):
        build = build_raft(cfg)
        out = save_raft(build, cfg.output_dir, cfg)
    st = build.stats
    logger.info(
        "RAFT set: %d train / %d eval examples, oracle rate %.3f (p_oracle %.2f), sources %s -> %s",
        st["num_train"],
        st["num_eval"],
        st["oracle_rate"],
        st["p_oracle"],
        st["distractor_sources_realized"],
        out,
    )
    return st
