"""One checkpoint scheme for every trainer in judgeloop (the feedback loop and the retriever).

A checkpoint is ``accelerator.save_state`` (model, optimizer, scheduler, the RNG state of every
process, and the FSDP / DeepSpeed shards where those apply) plus the trainer's own state as
readable files (JSON, YAML). Every process writes into one temporary sibling of the target; the
main process adds the files and moves the folder into place in one step
(:func:`judgeloop.io.replace_dir`), so a run killed while saving leaves the previous checkpoint
intact and a ``.NAME.tmp`` folder that the next start removes.

:func:`save_only_trainable` makes a model's checkpoint hold just the parameters that train (the
LoRA adapters of a policy, megabytes) instead of the frozen base as well, through accelerate's
save / load pre-hooks; it leaves FSDP and DeepSpeed models to accelerate.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from judgeloop.io import json_text, replace_dir

# accelerate's file name of the first model's weights (safetensors)
MODEL_FILE = "model.safetensors"


def save_training_checkpoint(accelerator: Any, target: str | Path, files: Mapping[str, Any]) -> Path:
    """Write one checkpoint to ``target``; call it on every process.

    ``files`` maps a file name to its content: a ``str`` is written as it is, anything else as JSON.
    """
    target = Path(target)
    tmp = target.with_name(f".{target.name}.tmp")  # one name every process agrees on
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp), safe_serialization=True)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        for name, content in files.items():
            (tmp / name).write_text(content if isinstance(content, str) else json_text(content) + "\n")
        replace_dir(tmp, target)
    accelerator.wait_for_everyone()
    return target


def prune_checkpoints(folder: str | Path, keep: int | None, pattern: str = "step_*") -> list[Path]:
    """Remove all but the newest ``keep`` checkpoints ``folder/step_N`` (by N); ``None`` keeps every one.
    Returns what was removed. Call it on the main process after a save."""
    if keep is None:
        return []
    steps = sorted(Path(folder).glob(pattern), key=lambda p: int(p.name.rsplit("_", 1)[1]))
    removed = steps[:-keep] if keep > 0 else steps
    for old in removed:
        shutil.rmtree(old, ignore_errors=True)
    return removed


def load_training_checkpoint(accelerator: Any, path: str | Path) -> None:
    """Restore model, optimizer, scheduler and every process's RNG from a checkpoint of
    :func:`save_training_checkpoint` (call it on every process, after ``prepare``)."""
    accelerator.load_state(str(path))


def save_only_trainable(
    accelerator: Any,
    state_of: Callable[[Any], dict[str, torch.Tensor]],
    load_into: Callable[[Any, dict[str, torch.Tensor]], None],
) -> None:
    """Checkpoint only what trains of the accelerator's (first) model.

    ``state_of(model)`` gives the trainable tensors of the unwrapped model, ``load_into(model, state)``
    puts them back. Registered once per accelerator; FSDP and DeepSpeed models keep accelerate's own
    (sharded) saving, since they never reach these hooks.
    """

    def save_hook(models: list[Any], weights: list[Any], output_dir: str) -> None:
        for i, model in enumerate(models[: len(weights)]):
            weights[i] = state_of(accelerator.unwrap_model(model))

    def load_hook(models: list[Any], input_dir: str) -> None:
        if not models:
            return
        for i, model in enumerate(models):
            name = MODEL_FILE if i == 0 else MODEL_FILE.replace(".safetensors", f"_{i}.safetensors")
            load_into(accelerator.unwrap_model(model), load_file(str(Path(input_dir) / name)))
        models.clear()  # loaded here: accelerate skips them

    accelerator.register_save_state_pre_hook(save_hook)
    accelerator.register_load_state_pre_hook(load_hook)
