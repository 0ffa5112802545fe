"""Metric logging through accelerate trackers: a JSONL file always, TensorBoard when it is installed."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from accelerate.tracking import GeneralTracker

from judgeloop.logging import get_logger

logger = get_logger(__name__)


class JSONLTracker(GeneralTracker):
    """Appends one JSON object per ``log`` call to ``OUTPUT_DIR/metrics.jsonl`` (main process only)."""

    name = "jsonl"
    requires_logging_directory = True
    main_process_only = True

    def __init__(self, run_name: str, logging_dir: str | Path):
        super().__init__()
        self.path = Path(logging_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)

    @property
    def tracker(self) -> Path:
        return self.path

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        pass  # the resolved config is written next to the outputs as config.yaml

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        row = {
            "step": step,
            **{k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in values.items()},
        }
        with self.path.open("a") as fh:
            fh.write(json.dumps(row) + "\n")


def truncate_jsonl_log(path: str | Path, last_step: int) -> int:
    """Drop the rows of ``metrics.jsonl`` past ``last_step`` (a killed run's rows after its checkpoint),
    atomically; returns how many were dropped."""
    from judgeloop.io import atomic_write_text

    path = Path(path)
    if not path.is_file():
        return 0
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    keep = [line for line in lines if (json.loads(line).get("step") or 0) <= last_step]
    if len(keep) != len(lines):
        atomic_write_text(path, "".join(f"{line}\n" for line in keep))
    return len(lines) - len(keep)


def make_trackers(names: list[str], output_dir: str | Path) -> list[Any]:
    """The accelerate trackers ``log_with`` names (``jsonl`` is judgeloop's own)."""
    trackers: list[Any] = []
    for name in names:
        if name == "jsonl":
            trackers.append(JSONLTracker("feedback_loop", output_dir))
        elif name == "tensorboard":
            try:
                import tensorboard  # noqa: F401
            except ImportError:
                logger.debug("tensorboard is not installed; logging to metrics.jsonl only")
                continue
            trackers.append("tensorboard")
    return trackers
