"""Metric logging through accelerate's trackers, for the loop, the ablation, the retriever and SFT.

``log_with`` names any tracker accelerate supports (``tensorboard``, ``wandb``, ``mlflow``,
``comet_ml``, ``aim``, ``clearml``, ``dvclive``, ``swanlab``, ``trackio``) plus ``jsonl``, judgeloop's
own ``OUTPUT_DIR/metrics.jsonl``, which the loop always writes (its resume truncates it). A tracker
that is named but not installed is a one-line error naming the package, before any work. Each run
carries a name and a group (an ablation: ``ARM-seedSEED`` in the group of its output folder), so a
dashboard lays the arms side by side.
"""

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
        self.path = Path(logging_dir) / "metrics.jsonl"  # made at the first row, not before any work

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
        self.path.parent.mkdir(parents=True, exist_ok=True)
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


# tracker name -> (module that must import, what to pip install)
TRACKERS: dict[str, tuple[str, str]] = {
    "tensorboard": ("tensorboard", "tensorboard"),
    "wandb": ("wandb", "wandb"),
    "mlflow": ("mlflow", "mlflow (or mlflow-skinny)"),
    "comet_ml": ("comet_ml", "comet-ml"),
    "aim": ("aim", "aim"),
    "clearml": ("clearml", "clearml"),
    "dvclive": ("dvclive", "dvclive"),
    "swanlab": ("swanlab", "swanlab"),
    "trackio": ("trackio", "trackio"),
}


def check_trackers(names: list[str], key: str = "log_with") -> None:
    """Refuse an unknown tracker, or one that is not installed (naming the package to install)."""
    import importlib.util

    from judgeloop.config import ConfigError

    unknown = [n for n in names if n != "jsonl" and n not in TRACKERS]
    if unknown:
        raise ConfigError(f"{key} has unknown tracker(s) {unknown}; choose from {['jsonl', *TRACKERS]}")
    for name in names:
        if name != "jsonl" and importlib.util.find_spec(TRACKERS[name][0]) is None:
            raise ConfigError(
                f"{key} names {name!r} but it is not installed; pip install {TRACKERS[name][1]} "
                f"(or drop {name} from {key})"
            )


def use_mlflow_file_store(output_dir: str | Path) -> str | None:
    """With no ``MLFLOW_TRACKING_URI`` set, point MLflow at a file store under the run's output folder
    (``OUTPUT_DIR/mlruns``) and return its URI; ``None`` when a URI is set (it is used as it is).

    MLflow 3's own default is ``sqlite:///mlflow.db`` in the working directory, which ``mlflow-skinny``
    (what ``make install`` brings) cannot open: the run would fail once started and leave ``mlflow.db``
    behind. MLflow 3 keeps the file store behind ``MLFLOW_ALLOW_FILE_STORE``, set here unless set already.
    """
    import os

    if os.environ.get("MLFLOW_TRACKING_URI"):
        return None
    import mlflow

    uri = (Path(output_dir).resolve() / "mlruns").as_uri()
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    mlflow.set_tracking_uri(uri)
    logger.info("mlflow: no MLFLOW_TRACKING_URI set; logging to the file store %s", uri)
    return uri


def make_trackers(names: list[str], output_dir: str | Path) -> list[Any]:
    """The ``log_with`` of an ``Accelerator``: judgeloop's JSONL tracker, and accelerate's by name
    (MLflow without a tracking URI: a file store under ``output_dir``, :func:`use_mlflow_file_store`)."""
    check_trackers(names)
    if "mlflow" in names:
        use_mlflow_file_store(output_dir)
    return [JSONLTracker("judgeloop", output_dir) if n == "jsonl" else n for n in names]


def flat_config(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested config as ``{"a.b": value}`` with scalars only (lists and ``None`` as text): the form
    every tracker's hyperparameter table accepts."""
    out: dict[str, Any] = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(flat_config(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v if isinstance(v, (bool, int, float, str)) else str(v)
    return out


def init_trackers(
    accelerator: Any, project: str, run_name: str, group: str | None, config: dict[str, Any]
) -> None:
    """Start every tracker of ``accelerator`` for one run, with its flattened config (which holds
    ``run_name`` and ``run_group`` for every tracker); W&B gets them as its run name and group, MLflow as
    its run name and tags (the experiment is ``project``); TensorBoard writes under ``OUTPUT_DIR/project``."""
    tags = {"run_name": run_name, **({"group": group} if group else {})}
    init_kwargs = {
        "wandb": {"name": run_name, **({"group": group} if group else {})},
        "mlflow": {"run_name": run_name, "tags": tags},
    }
    names = {str(t) for t in accelerator.log_with}
    accelerator.init_trackers(
        project,
        config=flat_config({**config, "run_name": run_name, "run_group": group}),
        init_kwargs={k: v for k, v in init_kwargs.items() if k in names},
    )
