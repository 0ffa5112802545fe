"""LoRA SFT on a RAFT set: the config schema (:class:`SftConfig`) and the data preparation that
``recipes/sft_raft.py`` (TRL ``SFTTrainer``) uses; ``judgeloop sft`` launches that recipe."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

from judgeloop.config import bounded, check_fields
from judgeloop.devices import Device
from judgeloop.io import DataError


@dataclass
class LoraSettings:
    """LoRA (Hu et al. 2021, arXiv:2106.09685): W + (alpha / r) * B A on ``target_modules``."""

    r: int = bounded(8, ge=1, hint=" (e.g. 8)", shape="section")
    alpha: int = bounded(16, gt=0, hint=" (the LoRA scaling numerator)")
    dropout: float = bounded(0.05, ge=0.0, lt=1.0, shape="section")
    target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )

    def __post_init__(self) -> None:
        check_fields("lora", self)
        if not self.target_modules:
            raise ValueError(
                "lora.target_modules is empty; name the linear layers to adapt, e.g. [q_proj, v_proj]"
            )


@dataclass
class TrainSettings:
    """The SFT trainer's settings (``train.*``)."""

    num_epochs: float = bounded(1.0, ge=0)
    max_steps: int | None = bounded(None, ge=1, hint=" or null (no cap)", shape="section")
    batch_size: int = bounded(4, ge=1, shape="section")
    grad_accum_steps: int = bounded(2, ge=1, shape="section")
    learning_rate: float = bounded(2e-4, gt=0, message="{key}={value} must be positive (LoRA: ~1e-4 to 3e-4)")
    lr_scheduler: str = "cosine"
    warmup_steps: int = bounded(2, ge=0)
    weight_decay: float = bounded(0.0, ge=0)
    RENAMED: ClassVar[dict[str, str]] = {"logging_every_n_steps": "log_every_n_steps"}
    log_every_n_steps: int = bounded(5, ge=0, hint=" (0 = off)")
    bf16: bool = False
    gradient_checkpointing: bool = False

    def __post_init__(self) -> None:
        check_fields("train", self)
        if self.num_epochs <= 0 and self.max_steps is None:
            raise ValueError(
                "train.num_epochs <= 0 and train.max_steps is null: nothing to train; set one of them"
            )


@dataclass
class SftConfig:
    """LoRA SFT on the ``train`` split of a RAFT set built by ``judgeloop build-raft``.

    ``data_dir`` is the builder's ``output_dir``; the first ``max_train_examples`` training rows are used
    (all when null). ``completion_only``: loss on the assistant turn only (rows are converted to TRL's
    conversational prompt/completion form); false trains on the whole ``messages`` sequence.
    ``device``: auto (a GPU when there is one), cpu or cuda (an error before any work where there is none).
    ``log_with``: ``jsonl`` (``OUTPUT_DIR/metrics.jsonl``) and any tracker transformers' Trainer reports
    to (its ``report_to``), the run named ``run_name`` (default ``sft``) in ``project_name``.
    """

    model: str = "HuggingFaceTB/SmolLM2-135M-Instruct"
    device: Device = "auto"
    data_dir: str = "runs/raft/pubmedqa"
    output_dir: str = "runs/sft/pubmedqa"
    overwrite: bool = False  # true: clear an output_dir that holds another run (judgeloop.rundir)
    max_train_examples: int | None = bounded(240, ge=1, hint=" or null", shape="section")
    max_length: int = bounded(768, ge=32, hint=" tokens", shape="section")
    completion_only: bool = True
    seed: int = bounded(0, ge=0, le=2**32 - 1)
    lora: LoraSettings = field(default_factory=LoraSettings)
    train: TrainSettings = field(default_factory=TrainSettings)
    launch: Literal["accelerate", "inline"] = "accelerate"
    accelerate_config: str | None = None
    log_with: list[str] = field(default_factory=lambda: ["jsonl"])
    project_name: str = "judgeloop"
    run_name: str | None = None

    def __post_init__(self) -> None:
        check_fields("", self)
        unknown = [t for t in self.log_with if t != "jsonl" and t not in SFT_TRACKERS]
        if unknown:
            raise ValueError(
                f"log_with has tracker(s) {unknown} that transformers' Trainer cannot report to; "
                f"choose from {['jsonl', *SFT_TRACKERS]}"
            )


# trackers transformers' Trainer can report to that judgeloop's other trainers know too (report_to names)
SFT_TRACKERS = ("tensorboard", "wandb", "mlflow", "comet_ml", "clearml", "dvclive", "swanlab", "trackio")


def report_to(cfg: SftConfig) -> list[str] | str:
    """The Trainer's ``report_to`` for ``cfg.log_with`` (``jsonl`` is :func:`jsonl_callback`'s)."""
    names = [t for t in cfg.log_with if t != "jsonl"]
    return names or "none"


def jsonl_callback(path: str | Path) -> Any:
    """A Trainer callback appending every logged row (with its step) to ``path``, main process only."""
    import json

    from transformers import TrainerCallback

    class JsonlLog(TrainerCallback):
        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
            if state.is_world_process_zero and logs:
                with Path(path).open("a") as fh:
                    fh.write(json.dumps({"step": state.global_step, **logs}) + "\n")

    return JsonlLog()


def to_prompt_completion(row: dict[str, Any]) -> dict[str, Any]:
    """A ``messages`` row as TRL's conversational prompt/completion pair (loss on the completion only)."""
    msgs = row["messages"]
    if not msgs or msgs[-1]["role"] != "assistant":
        raise DataError(
            "a RAFT row must end with the assistant turn; rebuild the data with judgeloop build-raft"
        )
    return {"prompt": msgs[:-1], "completion": msgs[-1:]}


def load_sft_dataset(cfg: SftConfig) -> Any:
    """The training split as a ``datasets.Dataset`` in the form the trainer takes."""
    from datasets import load_from_disk

    path = Path(cfg.data_dir) / "dataset"
    if not path.is_dir():
        raise DataError(
            f"data_dir={cfg.data_dir} has no dataset/ folder; build it first with "
            "`judgeloop build-raft --config configs/raft/pubmedqa.yaml output_dir=...`"
        )
    ds = load_from_disk(str(path))["train"]
    if cfg.max_train_examples is not None:
        ds = ds.select(range(min(cfg.max_train_examples, len(ds))))
    if cfg.completion_only:
        ds = ds.map(to_prompt_completion, remove_columns=[c for c in ds.column_names if c != "meta"])
    return ds.remove_columns(["meta"])
