"""``judgeloop train --config CONFIG [k=v ...]``: one run of the calibrated feedback loop, the job
``recipes/feedback_loop.py`` spells out (this command runs that recipe, in this process)."""

from __future__ import annotations

from typing import Any

from judgeloop.loop.config import FeedbackLoopConfig
from judgeloop.recipes import train

__all__ = ["FeedbackLoopConfig", "run"]


def run(cfg: FeedbackLoopConfig) -> dict[str, Any]:
    """Run the command on ``cfg`` (the CLI calls this after loading and checking the config)."""
    return train(cfg)
