"""Library logging: one ``judgeloop`` logger; messages from the main process only under accelerate."""

from __future__ import annotations

import logging
import os
import sys


def get_logger(name: str) -> logging.Logger:
    """The library logger for a module (under the one ``judgeloop`` logger)."""
    logger = logging.getLogger(name if name.startswith("judgeloop") else f"judgeloop.{name}")
    return logger


def setup_logging(level: int = logging.INFO, prefix: str = "") -> None:
    """Configure the ``judgeloop`` logger for command-line use (idempotent), and quiet third-party
    deprecation notices (:func:`quiet_third_party`). ``prefix``: put before every line (an ablation
    worker names its job, so the lines of two jobs running at once stay apart)."""
    quiet_third_party()
    root = logging.getLogger("judgeloop")
    fmt = "%(asctime)s %(levelname)s " + (f"[{prefix}] " if prefix else "") + "%(name)s: %(message)s"
    if root.handlers:  # set up already: only the prefix changes (a worker's next job)
        for h in root.handlers:
            h.setFormatter(logging.Formatter(fmt, "%H:%M:%S"))
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(fmt, "%H:%M:%S"))
    root.addHandler(handler)
    # Non-main ranks stay quiet unless asked (accelerate sets RANK / LOCAL_RANK).
    rank = int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")) or 0)
    root.setLevel(level if rank == 0 else logging.WARNING)
    root.propagate = False


def quiet_third_party(progress_bars: bool = True) -> None:
    """No ``FutureWarning`` / ``DeprecationWarning`` from transformers, TRL, peft or accelerate in the
    command line's output: they speak to the developers of code that calls those libraries (ours), not to
    its users, and would bury the lines that matter. ``progress_bars=False`` also turns off the progress
    bars of those libraries (and ``TQDM_DISABLE`` for tqdm bars made after the call): a worker that shares the terminal with
    others, whose bars would overwrite each other."""
    import warnings

    for category in (FutureWarning, DeprecationWarning):
        warnings.filterwarnings(
            "ignore", category=category, module=r"(transformers|trl|peft|accelerate)(\.|$)"
        )
    if not progress_bars:
        os.environ["TQDM_DISABLE"] = "1"
        os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
