"""Library logging: one ``judgeloop`` logger; messages from the main process only under accelerate."""

from __future__ import annotations

import logging
import os
import sys


def get_logger(name: str) -> logging.Logger:
    """The library logger for a module (under the one ``judgeloop`` logger)."""
    logger = logging.getLogger(name if name.startswith("judgeloop") else f"judgeloop.{name}")
    return logger


def setup_logging(level: int = logging.INFO) -> None:
    """Configure the ``judgeloop`` logger for command-line use (idempotent)."""
    root = logging.getLogger("judgeloop")
    if root.handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
    root.addHandler(handler)
    # Non-main ranks stay quiet unless asked (accelerate sets RANK / LOCAL_RANK).
    rank = int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")) or 0)
    root.setLevel(level if rank == 0 else logging.WARNING)
    root.propagate = False
