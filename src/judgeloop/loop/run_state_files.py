"""The run's state on disk: its output folder (opened, cleaned after a killed write, resumed), atomic
checkpoints of everything the loop needs to resume exactly (in the one scheme of
:mod:`judgeloop.checkpointing` that the retriever uses too), and the policy's weight files.

A run opens its folder in three moves, each made once: :func:`open_output` (before any work: the
folder's hold, and a checkpoint named by ``resume_from`` checked against the config,
:func:`checked_resume_step`), :func:`resolve_resume` (after the accelerator exists: the clean-up after a
killed checkpoint write, :func:`remove_orphans`, then ``resume_from: auto`` made concrete) and
:func:`prepare_output` (the log rows past the checkpoint dropped, the config recorded).

A checkpoint directory holds accelerate's state (``model.safetensors``: the trainable parameters,
adapters under LoRA, all weights otherwise; ``optimizer.bin``, ``scheduler.bin``,
``random_states_<rank>.pkl``: python, numpy, torch and CUDA RNG of every process), ``calibrator.json``,
``state.json`` (step, data cursor, KL coefficient, refit history, metric curves, early-stopping state)
and ``config.yaml``. It is written to a temporary sibling and moved into place, so a run killed while
saving leaves the previous checkpoint intact.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
from accelerate import Accelerator
from safetensors.torch import load_file, save_file

from judgeloop.checkpointing import load_training_checkpoint, save_training_checkpoint
from judgeloop.config import ConfigError, default_dict, to_yaml
from judgeloop.distributed import gathered_state_dict, is_fsdp, load_trainable_state, trainable_state
from judgeloop.io import DataError, atomic_dir, atomic_write_json, atomic_write_text, read_json
from judgeloop.logging import get_logger
from judgeloop.loop.config import RESUME_FREE_KEYS, FeedbackLoopConfig
from judgeloop.rundir import run_dir
from judgeloop.tracking import truncate_jsonl_log

logger = get_logger(__name__)


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


def killed_writes(out_dir: str | Path) -> list[tuple[Path, str]]:
    """What a checkpoint write that was killed left behind, and what :func:`remove_orphans` does with each:
    ``(path, "removed" | "restored")``. Reads only.

    ``.NAME.*.tmp`` folders are half-written and removed. ``.NAME.old`` is the previous copy of a folder
    being replaced (:func:`judgeloop.io.atomic_dir`): it is removed when ``NAME`` exists, and moved
    back to ``NAME`` when the kill came between the two renames, so no finished checkpoint is lost.
    """
    out_dir = Path(out_dir)
    found: list[tuple[Path, str]] = []
    for folder in (out_dir / "checkpoints", out_dir):
        if not folder.is_dir():
            continue
        for p in sorted(folder.glob(".*.old")):
            if p.is_dir():
                found.append((p, "removed" if _replaced(p).exists() else "restored"))
        found += [(p, "removed") for p in sorted(folder.glob(".*.tmp")) if p.is_dir()]
    return found


def _replaced(old: Path) -> Path:
    """The folder ``.NAME.old`` is the previous copy of: ``NAME``."""
    return old.with_name(old.name[1 : -len(".old")])


def remove_orphans(out_dir: str | Path) -> list[tuple[Path, str]]:
    """Clean up after a checkpoint write that was killed (:func:`killed_writes` says what is done with
    each left-over folder); returns ``(path, "removed" | "restored")``."""
    import os
    import shutil

    found = killed_writes(out_dir)
    for p, what in found:
        if what == "restored":
            os.replace(p, _replaced(p))
        else:
            shutil.rmtree(p, ignore_errors=True)
    return found


def has_checkpoint(out_dir: str | Path) -> bool:
    """Whether ``out_dir`` holds a complete checkpoint to resume, counting one that :func:`remove_orphans`
    will move back into place (a write killed between its two renames). Reads only."""
    if latest_checkpoint(out_dir) is not None:
        return True
    root = Path(out_dir) / "checkpoints"
    return any(
        what == "restored" and p.parent == root and _is_checkpoint(p, _replaced(p).name)
        for p, what in killed_writes(out_dir)
    )


def _is_checkpoint(path: Path, name: str) -> bool:
    """Whether ``path``, named ``name`` (``step_N``), is a complete checkpoint folder."""
    return (
        path.is_dir() and name.startswith("step_") and name[5:].isdigit() and (path / "state.json").is_file()
    )


def latest_checkpoint(out_dir: str | Path) -> Path | None:
    """The newest complete checkpoint ``out_dir/checkpoints/step_N`` (by N), or None. Each is moved into
    place whole (:func:`judgeloop.io.replace_dir`), so a ``step_N`` with its ``state.json`` is complete;
    half-written ``.step_N.*`` folders are never taken."""
    root = Path(out_dir) / "checkpoints"
    found = [p for p in root.glob("step_*") if _is_checkpoint(p, p.name)]
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


def checked_resume_step(cfg: FeedbackLoopConfig) -> int | None:
    """The step of the checkpoint ``resume_from`` names, checked against ``cfg`` (:func:`checked_resume`);
    None for a fresh start, or for ``auto`` before :func:`resolve_resume` has found its checkpoint."""
    if not cfg.resume_from or cfg.resume_from == "auto":
        return None
    return checked_resume(to_yaml(cfg), cfg.resume_from, RESUME_FREE_KEYS, default_dict(type(cfg)), type(cfg))


def open_output(cfg: FeedbackLoopConfig, out_dir: Path) -> contextlib.AbstractContextManager[Any]:
    """The run's hold on ``output_dir`` (:mod:`judgeloop.rundir`): a folder of this run is kept for a
    resume (``resume_from: auto`` keeps it when it holds a checkpoint, and starts it clean when it holds
    none), refused without ``resume_from``; one of another run is refused."""
    return run_dir(
        out_dir,
        "train",
        cfg,
        on_match="keep" if cfg.resume_from else "refuse",
        can_resume=has_checkpoint if cfg.resume_from == "auto" else None,
        hint="continue it with resume_from=auto",
    )


def resolve_resume(cfg: FeedbackLoopConfig, accelerator: Accelerator, out_dir: Path) -> FeedbackLoopConfig:
    """The main process cleans up after a killed checkpoint write (:func:`remove_orphans`, which may
    restore a checkpoint); then ``resume_from: auto`` is made concrete: the newest complete checkpoint
    under ``output_dir``, or null for a fresh start; the log says which. Any other value is returned as
    it is."""
    if accelerator.is_main_process:
        for orphan, what in remove_orphans(out_dir):
            logger.info("%s %s, left by a killed checkpoint write", what, orphan)
    accelerator.wait_for_everyone()  # the main process has opened and cleaned output_dir
    if cfg.resume_from != "auto":
        return cfg
    found = latest_checkpoint(out_dir)
    if found is None:
        logger.info("resume_from=auto: no checkpoint under %s; starting fresh", out_dir / "checkpoints")
    else:
        logger.info("resume_from=auto: resuming from %s, the newest checkpoint", found)
    return dataclasses.replace(cfg, resume_from=None if found is None else str(found))


def prepare_output(
    cfg: FeedbackLoopConfig, accelerator: Accelerator, out_dir: Path, ckpt_step: int | None
) -> None:
    """Before any work: refuse a resume past ``max_steps`` (``ckpt_step``: the step of the checkpoint it
    continues, :func:`checked_resume_step`), drop the log rows written after that checkpoint by the run
    that was stopped, record the config that runs."""
    if ckpt_step is not None and ckpt_step > cfg.max_steps:  # else the loop runs no step and exits 0
        raise ConfigError(
            f"resume_from={cfg.resume_from} is at step {ckpt_step}, past max_steps={cfg.max_steps}: nothing to "
            f"run; set max_steps above {ckpt_step} to continue it (or resume an earlier checkpoint)"
        )
    if accelerator.is_main_process:
        if ckpt_step is not None:
            dropped = truncate_jsonl_log(out_dir / "metrics.jsonl", ckpt_step)
            if dropped:
                logger.info(
                    "metrics.jsonl: dropped %d rows logged after the checkpoint's step %d", dropped, ckpt_step
                )
        atomic_write_text(out_dir / "config.yaml", to_yaml(cfg))


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
