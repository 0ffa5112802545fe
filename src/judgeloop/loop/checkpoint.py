"""Atomic checkpoints of everything the loop needs to resume exactly.

A checkpoint directory holds ``policy.safetensors`` (trainable parameters: adapters under LoRA, all
weights otherwise), ``optimizer.pt``, ``scheduler.pt``, ``rng.pt`` (python, numpy, torch states),
``calibrator.json`` and ``state.json`` (step, data cursor, KL coefficient, refit history, metric
curves, early-stopping state). It is written to a temporary sibling and moved into place, so a run
killed while saving leaves the previous checkpoint intact.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from judgeloop.io import atomic_dir, atomic_write_json
from judgeloop.loop.policy import load_trainable_state, trainable_state


def rng_state() -> dict[str, Any]:
    """The python, numpy and torch RNG states (saved in a checkpoint)."""
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore the RNG states saved by :func:`rng_state`."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def save_policy(path: str | Path, model: Any) -> None:
    """Trainable parameters only, written atomically (used for the best-so-far policy too)."""
    with atomic_dir(path) as tmp:
        save_file(trainable_state(model), str(tmp / "policy.safetensors"))


def export_policy(path: str | Path, model: Any, tokenizer: Any, calibrator_state: dict[str, Any]) -> None:
    """The trained policy in the ``transformers`` / ``peft`` layout (``from_pretrained`` loads it: the
    LoRA adapters under LoRA, the full model otherwise), its tokenizer, and the final calibrator.
    Written atomically."""
    with atomic_dir(path) as tmp:
        model.save_pretrained(str(tmp), safe_serialization=True)
        tokenizer.save_pretrained(str(tmp))
        atomic_write_json(tmp / "calibrator.json", calibrator_state)


def load_policy_weights(path: str | Path, model: Any) -> None:
    """Load the trainable parameters saved in ``path/policy.safetensors`` into ``model``."""
    load_trainable_state(model, load_file(str(Path(path) / "policy.safetensors")))


def save_checkpoint(
    path: str | Path,
    model: Any,
    optimizer: Any,
    scheduler: Any,
    calibrator_state: dict[str, Any],
    state: dict[str, Any],
    config_yaml: str | None = None,
) -> None:
    """Write one checkpoint directory atomically (call on the main process only), with the config the
    run was made with (``config.yaml``: a resume is checked against it)."""
    with atomic_dir(path) as tmp:
        if config_yaml is not None:
            (tmp / "config.yaml").write_text(config_yaml)
        save_file(trainable_state(model), str(tmp / "policy.safetensors"))
        torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
        torch.save(rng_state(), tmp / "rng.pt")
        atomic_write_json(tmp / "calibrator.json", calibrator_state)
        atomic_write_json(tmp / "state.json", state)


def remove_orphans(out_dir: str | Path) -> list[Path]:
    """Clean up after a checkpoint write that was killed; returns what was removed or restored.

    ``.NAME.*.tmp`` folders are half-written and removed. ``.NAME.old`` is the previous copy of a folder
    being replaced (:func:`judgeloop.io.atomic_dir`): it is removed when ``NAME`` exists, and moved
    back to ``NAME`` when the kill came between the two renames, so no finished checkpoint is lost.
    """
    import os
    import shutil

    out_dir = Path(out_dir)
    found: list[Path] = []
    for folder in (out_dir / "checkpoints", out_dir):
        if not folder.is_dir():
            continue
        for p in sorted(folder.glob(".*.old")):
            if not p.is_dir():
                continue
            target = p.with_name(p.name[1 : -len(".old")])
            if target.exists():
                shutil.rmtree(p, ignore_errors=True)
            else:
                os.replace(p, target)
            found.append(p)
        for p in sorted(folder.glob(".*.tmp")):
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
                found.append(p)
    return found


def checked_resume(
    cfg_yaml: str,
    resume_from: str | Path,
    free_keys: tuple[str, ...],
    defaults: dict[str, Any] | None = None,
) -> int:
    """Check ``resume_from`` before any work: a checkpoint folder, made with a config whose every key that
    can change the run equals the new one's. Returns the checkpoint's step.

    Raises:
        ConfigError: not a checkpoint, or a list of ``key: old -> new`` that the resume would change.
    """
    import yaml

    from judgeloop.config import ConfigError, config_changes

    path = Path(resume_from)
    if not (path / "state.json").is_file():
        raise ConfigError(
            f"resume_from={path} is not a checkpoint directory (no state.json); "
            "pass a directory written under OUTPUT_DIR/checkpoints/"
        )
    step = int(json.loads((path / "state.json").read_text()).get("step", 0))
    if not (path / "config.yaml").is_file():
        return step  # a checkpoint from before configs were stored in it: nothing to compare
    saved = yaml.safe_load((path / "config.yaml").read_text()) or {}
    new = yaml.safe_load(cfg_yaml) or {}
    changes = config_changes(saved, new, free_keys, defaults=defaults)
    if changes:
        raise ConfigError(
            f"resume_from={path} was made with another config; these keys would change the run: "
            + "; ".join(changes)
            + ". Resume with the checkpoint's values (see its config.yaml) or start a new run"
        )
    return step


def load_checkpoint(
    path: str | Path, model: Any, optimizer: Any, scheduler: Any
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Restore policy, optimizer, scheduler and RNG from ``path``; return (calibrator_state, loop_state)."""
    path = Path(path)
    if not (path / "state.json").is_file():
        raise FileNotFoundError(
            f"resume_from={path} is not a checkpoint directory (no state.json); "
            "pass a directory written under OUTPUT_DIR/checkpoints/"
        )
    load_policy_weights(path, model)
    optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=False))
    scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=False))
    set_rng_state(torch.load(path / "rng.pt", weights_only=False))
    return json.loads((path / "calibrator.json").read_text()), json.loads((path / "state.json").read_text())
