"""The run's state on disk: atomic checkpoints of everything the loop needs to resume exactly (in the one
scheme of :mod:`judgeloop.checkpointing` that the retriever uses too), and the policy's weight files.

A checkpoint directory holds accelerate's state (``model.safetensors``: the trainable parameters,
adapters under LoRA, all weights otherwise; ``optimizer.bin``, ``scheduler.bin``,
``random_states_<rank>.pkl``: python, numpy, torch and CUDA RNG of every process), ``calibrator.json``,
``state.json`` (step, data cursor, KL coefficient, refit history, metric curves, early-stopping state)
and ``config.yaml``. It is written to a temporary sibling and moved into place, so a run killed while
saving leaves the previous checkpoint intact.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from judgeloop.checkpointing import load_training_checkpoint, save_training_checkpoint
from judgeloop.distributed import gathered_state_dict, is_fsdp, load_trainable_state, trainable_state
from judgeloop.io import DataError, atomic_dir, atomic_write_json, read_json


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore python, numpy and torch RNG states saved by an earlier-layout checkpoint (``rng.pt``)."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def _policy_module(accelerator: Any, model: Any) -> Any:
    """The module whose weights are saved: the FSDP1 root unit itself (its full state needs it), the
    unwrapped model otherwise (FSDP2 and ZeRO-3 modules are the model's own)."""
    return model if is_fsdp(model) else accelerator.unwrap_model(model)


def save_policy(path: str | Path, accelerator: Any, model: Any) -> None:
    """Trainable parameters only (full tensors, gathered under FSDP / ZeRO-3), written atomically by the
    main process; call it on every process (used for the best-so-far policy)."""
    state = trainable_state(_policy_module(accelerator, model))
    if accelerator.is_main_process:
        with atomic_dir(path) as tmp:
            save_file({n: t.contiguous() for n, t in state.items()}, str(tmp / "policy.safetensors"))
    accelerator.wait_for_everyone()


def export_policy(
    path: str | Path,
    accelerator: Any,
    model: Any,
    tokenizer: Any,
    calibrator_state: dict[str, Any],
    base_model: str | None = None,
    card: str | None = None,
    config_yaml: str | None = None,
) -> None:
    """The trained policy in the ``transformers`` / ``peft`` layout (``from_pretrained`` loads it: the
    LoRA adapters under LoRA, the full model otherwise, its tied embedding stored once as
    ``model.embed_tokens.weight`` as ``save_pretrained`` does), its tokenizer, and the final calibrator.
    Call it on every process: the full weights are gathered first (every shard, under FSDP / ZeRO-3),
    then the main process writes them atomically.

    ``base_model``: the configured model id (``policy.model``), written as the adapters'
    ``base_model_name_or_path`` instead of the local folder the weights were read from, so the adapters
    load on another machine and on the Hub. ``card``: the folder's ``README.md`` (the model card of
    :mod:`judgeloop.loop.model_card`), replacing peft's empty template. ``config_yaml``: the run's config,
    written as ``training_config.yaml`` (the card's command reruns it).
    """
    from judgeloop.models.saving import tied_state_dict

    module = _policy_module(accelerator, model)
    state = gathered_state_dict(module)
    if accelerator.is_main_process:
        unwrapped = accelerator.unwrap_model(model)
        lora = hasattr(unwrapped, "peft_config")
        if (
            state is not None and not lora
        ):  # gathered copies share no storage: name the tie as transformers does
            state = tied_state_dict(unwrapped, state)
        with atomic_dir(path) as tmp:
            unwrapped.save_pretrained(str(tmp), state_dict=state, safe_serialization=True)
            if lora and base_model is not None:  # after saving: peft reads the base's config from its path
                for adapter_file in tmp.glob("**/adapter_config.json"):
                    adapter = json.loads(adapter_file.read_text())
                    adapter["base_model_name_or_path"] = base_model
                    adapter_file.write_text(json.dumps(adapter, indent=2, sort_keys=True))
            tokenizer.save_pretrained(str(tmp))
            atomic_write_json(tmp / "calibrator.json", calibrator_state)
            if config_yaml is not None:
                (tmp / "training_config.yaml").write_text(config_yaml)
            if card is not None:
                (tmp / "README.md").write_text(card)
    accelerator.wait_for_everyone()


def load_policy_weights(path: str | Path, accelerator: Any, model: Any) -> None:
    """Load the trainable parameters saved in ``path/policy.safetensors`` into ``model`` (into its shards
    under FSDP / ZeRO-3); call it on every process."""
    load_trainable_state(
        _policy_module(accelerator, model), load_file(str(Path(path) / "policy.safetensors"))
    )


def save_checkpoint(
    accelerator: Any,
    path: str | Path,
    calibrator_state: dict[str, Any],
    state: dict[str, Any],
    config_yaml: str | None = None,
) -> None:
    """Write one checkpoint of the loop (call on every process): accelerate's state (the policy's
    trainable parameters, optimizer, scheduler, every process's RNG) plus ``calibrator.json``,
    ``state.json`` and the config the run was made with (``config.yaml``: a resume is checked against it)."""
    files: dict[str, Any] = {"calibrator.json": calibrator_state, "state.json": state}
    if config_yaml is not None:
        files["config.yaml"] = config_yaml
    save_training_checkpoint(accelerator, path, files)


def remove_orphans(out_dir: str | Path) -> list[tuple[Path, str]]:
    """Clean up after a checkpoint write that was killed; returns ``(path, "removed" | "restored")``.

    ``.NAME.*.tmp`` folders are half-written and removed. ``.NAME.old`` is the previous copy of a folder
    being replaced (:func:`judgeloop.io.atomic_dir`): it is removed when ``NAME`` exists, and moved
    back to ``NAME`` when the kill came between the two renames, so no finished checkpoint is lost.
    """
    import os
    import shutil

    out_dir = Path(out_dir)
    found: list[tuple[Path, str]] = []
    for folder in (out_dir / "checkpoints", out_dir):
        if not folder.is_dir():
            continue
        for p in sorted(folder.glob(".*.old")):
            if not p.is_dir():
                continue
            target = p.with_name(p.name[1 : -len(".old")])
            if target.exists():
                shutil.rmtree(p, ignore_errors=True)
                found.append((p, "removed"))
            else:
                os.replace(p, target)
                found.append((p, "restored"))
        for p in sorted(folder.glob(".*.tmp")):
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
                found.append((p, "removed"))
    return found


def latest_checkpoint(out_dir: str | Path) -> Path | None:
    """The newest complete checkpoint ``out_dir/checkpoints/step_N`` (by N), or None. Each is moved into
    place whole (:func:`judgeloop.io.replace_dir`), so a ``step_N`` with its ``state.json`` is complete;
    half-written ``.step_N.*`` folders are never taken."""
    root = Path(out_dir) / "checkpoints"
    found = [
        p for p in root.glob("step_*") if p.is_dir() and p.name[5:].isdigit() and (p / "state.json").is_file()
    ]
    return max(found, key=lambda p: int(p.name[5:]), default=None)


def checked_resume(
    cfg_yaml: str,
    resume_from: str | Path,
    free_keys: tuple[str, ...],
    defaults: dict[str, Any] | None = None,
    schema: type | None = None,
) -> int:
    """Check ``resume_from`` before any work: a checkpoint folder, made with a config whose every key that
    can change the run equals the new one's. Returns the checkpoint's step.

    Raises:
        ConfigError: not a checkpoint, or a list of ``key: old -> new`` that the resume would change.
    """
    import yaml

    from judgeloop.config import ConfigError, config_changes, migrate

    path = Path(resume_from)
    if not (path / "state.json").is_file():
        raise ConfigError(
            f"resume_from={path} is not a checkpoint directory (no state.json); "
            "pass a directory written under OUTPUT_DIR/checkpoints/"
        )
    step = _read_state(path)[1].get("step", 0)
    if not (path / "config.yaml").is_file():
        return step  # a checkpoint from before configs were stored in it: nothing to compare
    saved = yaml.safe_load((path / "config.yaml").read_text()) or {}
    if schema is not None:  # keys renamed since the checkpoint was made compare under their new names
        saved = migrate(schema, saved)
    new = yaml.safe_load(cfg_yaml) or {}
    changes = config_changes(saved, new, free_keys, defaults=defaults)
    if changes:
        raise ConfigError(
            f"resume_from={path} was made with another config; these keys would change the run: "
            + "; ".join(changes)
            + ". Resume with the checkpoint's values (see its config.yaml) or start a new run"
        )
    return step


def load_checkpoint(accelerator: Any, path: str | Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """Restore policy, optimizer, scheduler and RNG from ``path`` (on every process); return
    (calibrator_state, loop_state).

    A checkpoint written before the loop used accelerate's state (``optimizer.pt`` beside
    ``policy.safetensors``) is read the way it was written.
    """
    path = Path(path)
    if not (path / "state.json").is_file():
        raise FileNotFoundError(
            f"resume_from={path} is not a checkpoint directory (no state.json); "
            "pass a directory written under OUTPUT_DIR/checkpoints/"
        )
    calibrator, state = _read_state(path)  # a damaged file fails here, before any weights are loaded
    if (path / "optimizer.pt").is_file():  # the earlier layout
        load_policy_weights(path, accelerator, accelerator._models[0])

        def load(name: str) -> Any:  # never every rank's state on cuda:0
            return torch.load(path / name, weights_only=False, map_location="cpu")

        accelerator._optimizers[0].load_state_dict(load("optimizer.pt"))
        accelerator._schedulers[0].load_state_dict(load("scheduler.pt"))
        set_rng_state(load("rng.pt"))
    else:
        load_training_checkpoint(accelerator, path)
    return calibrator, state


def _read_state(path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """A checkpoint's ``calibrator.json`` and ``state.json``, read strictly: a missing, truncated or
    damaged file, or a step that is not a whole number, is a :class:`DataError` in one line naming it."""
    fix = "resume from another checkpoint under OUTPUT_DIR/checkpoints/, or start a new run"
    state = read_json(path / "state.json", "checkpoint state", fix)
    step = state.get("step", 0)
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise DataError(f"checkpoint state {path / 'state.json'}: step={step!r} is not a step number; {fix}")
    calibrator = read_json(path / "calibrator.json", "checkpoint calibrator", fix)
    return calibrator, state
