"""The sharded paths (FSDP, DeepSpeed) in one place: full weights out of a sharded model and back in,
generation over FSDP1's root unit, and the DeepSpeed settings accelerate cannot infer without a
DataLoader.

Sharded models are recognised by their modules and parameters, not by accelerate's distributed type,
so the same code serves a model ``accelerator.prepare`` wrapped and one sharded with ``fully_shard``
directly (how the 2-process FSDP2 tests run on CPU, where accelerate cannot enable FSDP).

FSDP2 (``fully_shard``, ``fsdp_version: 2`` in the launch file) is the supported FSDP: its modules
stay the model's own classes, so ``unwrap_model`` gives the sharded model itself and every forward
gathers what it needs, ``generate`` included (transformers syncs ranks that stop early). Under FSDP1
``unwrap_model`` strips the root unit and leaves its parameters (embeddings, ``lm_head``) sharded;
:func:`generation_context` gathers them for the duration, as TRL does. FSDP1 needs a GPU, so that
path is not exercised on this project's CPU test machines.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch

from judgeloop.config import ConfigError

if TYPE_CHECKING:
    from accelerate import Accelerator

_WRAPPER_PARTS = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")


def _fsdp1_class() -> Any:
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # pragma: no cover - torch without distributed
        return None
    return FullyShardedDataParallel


def _fsdp2_class() -> Any:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch before FSDP2
        return None
    return FSDPModule


def is_fsdp(model: Any) -> bool:
    """Whether any module of ``model`` is an FSDP unit (FSDP1 wrapper or FSDP2 ``fully_shard``)."""
    kinds = tuple(c for c in (_fsdp1_class(), _fsdp2_class()) if c is not None)
    return bool(kinds) and any(isinstance(m, kinds) for m in model.modules())


def is_zero3(model: Any) -> bool:
    """Whether ``model``'s parameters are partitioned by DeepSpeed ZeRO-3 (they carry a ``ds_id``)."""
    return any(hasattr(p, "ds_id") for p in model.parameters())


def _zero3_engine(model: Any) -> bool:
    """Whether ``model`` is partitioned by ZeRO-3, read from its first parameter (ZeRO-3 partitions all)."""
    first = next(iter(model.parameters()), None) if hasattr(model, "parameters") else None
    return first is not None and hasattr(first, "ds_id")


def clean_name(name: str) -> str:
    """A parameter name without the wrappers' prefixes (FSDP1, activation checkpointing, compile)."""
    for part in _WRAPPER_PARTS:
        name = name.replace(part, "")
    return name.removeprefix("module.")


def full_state_dict(model: Any, names: set[str] | None = None) -> dict[str, torch.Tensor]:
    """Full (unsharded) CPU copies of ``model``'s tensors, restricted to ``names`` when given.

    Collective under FSDP and ZeRO-3: every process must call it. Under FSDP the tensors come back on
    the main process only (the others get ``{}``); elsewhere every process gets them.
    """
    state: dict[str, Any]
    if is_fsdp(model):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state = dict(get_model_state_dict(model, options=opts))
    elif is_zero3(model):  # pragma: no cover - needs DeepSpeed on GPUs
        import deepspeed

        params = {n: p for n, p in model.named_parameters() if names is None or clean_name(n) in names}
        with deepspeed.zero.GatheredParameters(list(params.values()), modifier_rank=None):
            state = {n: p.detach().cpu().clone() for n, p in params.items()}
    else:  # only what is asked for is copied (a LoRA policy's adapters, not its frozen base)
        state = {
            n: t.detach().cpu().clone()
            for n, t in model.state_dict().items()
            if names is None or clean_name(n) in names
        }
    clean: dict[str, torch.Tensor] = {clean_name(n): t for n, t in state.items()}
    return clean if names is None else {n: t for n, t in clean.items() if n in names}


def gathered_state_dict(model: Any) -> dict[str, torch.Tensor] | None:
    """The full weights for ``save_pretrained(state_dict=...)`` when ``model`` is sharded (collective:
    every process calls it); ``None`` when it is not, and ``save_pretrained`` reads the model itself."""
    return full_state_dict(model) if is_fsdp(model) or is_zero3(model) else None


def trainable_names(model: Any) -> set[str]:
    """The clean names of ``model``'s trainable parameters (LoRA adapters, or every weight)."""
    return {clean_name(n) for n, p in model.named_parameters() if p.requires_grad}


def trainable_state(model: Any) -> dict[str, torch.Tensor]:
    """Full copies of the trainable parameters (what a policy checkpoint holds); see :func:`full_state_dict`."""
    return full_state_dict(model, trainable_names(model))


def load_trainable_state(model: Any, state: dict[str, torch.Tensor]) -> None:
    """Put a :func:`trainable_state` back into ``model``: every trainable parameter must be there, and
    nothing else (a ValueError names the first mismatches)."""
    missing = sorted(trainable_names(model) - set(state))
    if missing:
        raise ValueError(
            f"checkpoint does not match the policy: missing {missing[:3]}; "
            "resume with the same policy.model and policy.lora settings"
        )
    load_full_state_dict(model, state)


def load_full_state_dict(model: Any, state: dict[str, torch.Tensor]) -> None:
    """Copy full tensors (a subset of the model's, e.g. its trainable ones) into ``model``, sharded or
    not; call it on every process with the same ``state``. Unknown names are an error."""
    params = {clean_name(n): p for n, p in model.named_parameters()}
    unknown = sorted(set(state) - set(params) - {clean_name(n) for n, _ in model.named_buffers()})
    if unknown:
        raise ValueError(f"weights do not match the model: unexpected {unknown[:3]}")
    if is_fsdp(model):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        options = StateDictOptions(full_state_dict=True, strict=False)
        set_model_state_dict(model, dict(state), options=options)  # type: ignore[arg-type]
        return
    if is_zero3(model):  # pragma: no cover - needs DeepSpeed on GPUs
        import deepspeed

        wanted = [params[n] for n in state]
        with deepspeed.zero.GatheredParameters(wanted, modifier_rank=0), torch.no_grad():
            for n, t in state.items():
                params[n].copy_(t)
        return
    with torch.no_grad():
        for n, t in state.items():
            params[n].copy_(t)


@contextlib.contextmanager
def generation_context(model: Any) -> Iterator[None]:
    """Around ``generate`` / scoring on the unwrapped model: under ZeRO-3, every parameter gathered once
    for the block (not per layer at every token); under FSDP1, the root unit's parameters
    (embeddings, ``lm_head``, final norm) gathered without write-back, the nested units gathering their
    own at each forward (TRL's pattern). Under FSDP2 the root unit is gathered first (a PEFT model's
    ``generate`` bypasses its hooks; the nested units gather at their own forwards) and every unit is
    resharded afterwards (:func:`reshard`)."""
    if _zero3_engine(model):  # pragma: no cover - DeepSpeed needs a GPU
        import deepspeed

        # every partition gathered once for the whole rollout, not per layer at every token (TRL's pattern)
        with deepspeed.zero.GatheredParameters(list(model.parameters())):
            yield
        return
    fsdp1 = _fsdp1_class()
    if fsdp1 is not None and isinstance(model, fsdp1):  # pragma: no cover - FSDP1 needs a GPU
        with fsdp1.summon_full_params(model, recurse=False, writeback=False):
            yield
        return
    fsdp2 = _fsdp2_class()
    if fsdp2 is not None and isinstance(model, fsdp2):
        root: Any = model
        # the root unit gathered up front: a PEFT model's generate() calls the inner model's forward,
        # which skips the root's hooks and would meet its sharded embeddings. FSDP2 initialises its units
        # at the root's first forward; before one, a nested unit's forward refuses to run, so the root's
        # lazy initialisation runs here (private API, torch 2.4+; a no-op once done)
        state = getattr(root, "_get_fsdp_state", None)
        if state is not None:
            state()._lazy_init()
        root.unshard()
        try:
            yield
        finally:
            reshard(model)
        return
    yield


def reshard(model: Any) -> None:
    """Free the gathered weights FSDP2 keeps after a forward outside training (the root unit, and any
    unit with ``reshard_after_forward=False``). Left gathered after ``generate``, they are reused by the
    next training forward without reaching the sharded parameters' gradients: the update then
    differs from the unsharded one (measured on the tiny policy: embedding off by 0.17 after two steps)."""
    fsdp2 = _fsdp2_class()
    if fsdp2 is None:  # pragma: no cover
        return
    for module in model.modules():
        if isinstance(module, fsdp2):
            unit: Any = module
            unit.reshard()


def launched_with_deepspeed() -> bool:
    """Whether ``accelerate launch`` (``--use_deepspeed`` or a DeepSpeed launch file) asked for DeepSpeed;
    read from the variable accelerate itself reads, before any ``Accelerator`` exists."""
    return os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"


def accelerator_kwargs(cpu: bool) -> dict[str, Any]:
    """The ``cpu=`` and process-group arguments of a run's ``Accelerator``.

    Under DeepSpeed on a CPU, ``Accelerator(cpu=True)`` skips DeepSpeed's process-group set-up, and
    ``cpu=False`` without a GPU leaves the backend unset: accelerate then counts one process per rank
    while DeepSpeed counts them all (its batch-size check fails). ``cpu=False`` with the gloo backend
    gives both the same world (DeepSpeed's CPU accelerator, ``DS_ACCELERATOR=cpu`` or detected).
    """
    if cpu and launched_with_deepspeed():
        from accelerate.utils import InitProcessGroupKwargs

        return {"cpu": False, "kwargs_handlers": [InitProcessGroupKwargs(backend="gloo")]}
    return {"cpu": cpu, "kwargs_handlers": []}


def new_accelerator(**kwargs: Any) -> Any:
    """A run's ``Accelerator`` with this run's own settings.

    accelerate keeps one process-wide ``AcceleratorState``: a run after another one in the same process
    (``train-retriever`` then ``train`` in a notebook, a test session, an ablation's lanes) would inherit
    the first run's mixed precision where it passes none (a launch file's setting applies then). The
    state is reset first; the process group (``PartialState``) is kept.
    """
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state()
    GradientState._reset_state()
    accelerator = Accelerator(**kwargs)
    release_process_group_at_exit()
    return accelerator


_RELEASE_REGISTERED = False


def _release_process_group() -> None:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def release_process_group_at_exit() -> None:
    """Destroy the process group at interpreter exit, while Python is still whole (once per process).

    A process that exits with its gloo group alive can abort in the interpreter's finalization
    ("terminate called without an active exception", SIGABRT): gloo's worker threads still hold work
    whose tensors need the GIL. It happened to one rank of a 2-process DeepSpeed run after its report
    was written. accelerate never destroys the group, so every judgeloop run that makes an accelerator
    (and the TRL recipes, whose trainers make theirs) registers this; a run in one process is unchanged.
    """
    global _RELEASE_REGISTERED
    if not _RELEASE_REGISTERED:
        import atexit

        atexit.register(_release_process_group)
        _RELEASE_REGISTERED = True


@contextlib.contextmanager
def whole_models(accelerator: Any) -> Iterator[None]:
    """Models loaded inside come whole on every process, also under ZeRO-3 with ``zero3_init_flag``
    (where transformers would load them partitioned, their parameters empty until a DeepSpeed engine
    gathers them). For a model that runs before ``prepare`` (the retriever's zero-shot evaluation and
    mining, the policy's SFT warm-up and its reference copy): ``prepare`` partitions it afterwards. The
    cost is one full copy per process while loading."""
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if plugin is None or not plugin.zero3_init_flag:
        yield
        return
    # transformers loads partitioned while its module-level DeepSpeed config reference is set; accelerate's
    # zero3_init_context_manager(enable=False) sets it again at once (accelerate 1.15), so it is unset here
    # for the block and put back after
    from transformers.integrations import deepspeed as hf_deepspeed

    saved = hf_deepspeed._hf_deepspeed_config_weak_ref
    hf_deepspeed.unset_hf_deepspeed_config()
    try:
        yield
    finally:
        hf_deepspeed._hf_deepspeed_config_weak_ref = saved


def check_launch(batch_size: int, batch_key: str, max_grad_norm: float, key: str) -> None:
    """What ``accelerate launch`` asked for (its flags, its launch file, a DeepSpeed config file), checked
    before any work against what makes a run (the loop's, the retriever's) equal one process: a
    :class:`ConfigError` names the setting and what to launch with instead. Read from the variables the
    launcher sets and with accelerate's own ``DeepSpeedPlugin``, before any ``Accelerator`` exists.

    Refused: ``fp16`` (both train in ``no`` or ``bf16``: a loss scaler skips steps one process takes),
    a gradient accumulation other than 1 (judgeloop steps its optimizer once per batch, and accelerate /
    DeepSpeed divide every gradient by the accumulation steps: 2 halved it, measured), and under
    DeepSpeed a ``gradient_clipping`` other than ``max_grad_norm`` (``key``) and ZeRO offload (its
    updates equal one process but its checkpoint resumed 1.7e-3 off, measured on 2 CPU processes), and
    a DeepSpeed config file's batch sizes other than ``batch_size`` (``batch_key``, per process) and
    ``batch_size`` x the processes (DeepSpeed would derive an accumulation from them, or stop)."""
    if os.environ.get("ACCELERATE_MIXED_PRECISION", "no").lower() == "fp16":
        raise ConfigError(
            "the launch asks for --mixed_precision fp16, which judgeloop does not train in (its loss scaler "
            "skips steps one process takes); launch with --mixed_precision no or bf16"
        )
    if not launched_with_deepspeed():
        accum = os.environ.get("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "1")
        if accum != "1":
            raise ConfigError(
                f"the launch asks for --gradient_accumulation_steps {accum}; judgeloop steps its optimizer "
                "once per batch (accelerate would divide each gradient by it): launch with "
                "--gradient_accumulation_steps 1 or leave it out"
            )
        return
    from accelerate.utils import DeepSpeedPlugin

    plugin = DeepSpeedPlugin()  # accelerate's reading of the launch (flags, launch file, DeepSpeed file)
    ds = plugin.deepspeed_config
    file = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE", "none")
    where = f" (in the DeepSpeed config file {file})" if file != "none" else ""
    accum = ds.get("gradient_accumulation_steps", 1)
    if accum != "auto" and int(accum) != 1:
        fix = (
            "set gradient_accumulation_steps: 1 there"
            if where
            else "launch with --gradient_accumulation_steps 1"
        )
        raise ConfigError(
            f"the launch asks for gradient_accumulation_steps={accum}{where}; judgeloop steps its optimizer "
            f"once per batch (DeepSpeed would divide each gradient by it): {fix} (or leave it out)"
        )
    micro = ds.get("train_micro_batch_size_per_gpu", "auto")
    if micro != "auto" and int(micro) != batch_size:
        raise ConfigError(
            f"the launch's train_micro_batch_size_per_gpu={micro}{where} differs from {batch_key}={batch_size} "
            f"(the batch of each process); set it to auto there, or set {batch_key}={micro}"
        )
    total, world = ds.get("train_batch_size", "auto"), int(os.environ.get("WORLD_SIZE", "1"))
    if total != "auto" and int(total) != batch_size * world:
        raise ConfigError(
            f"the launch's train_batch_size={total}{where} is not {batch_key}={batch_size} x {world} "
            f"process(es) = {batch_size * world}; set it to auto there"
        )
    zero = ds.get("zero_optimization", {})
    for part in ("offload_optimizer", "offload_param"):
        device = (zero.get(part) or {}).get("device", "none")
        if device not in (None, "none"):
            fix = (
                f"set zero_optimization.{part}.device: none there"
                if where
                else f"launch without --{part}_device"
            )
            raise ConfigError(
                f"the launch asks for ZeRO {part.replace('_', ' ')} to {device}{where}, which judgeloop does "
                f"not support (a checkpoint resumed under it does not continue the run exactly): {fix}"
            )
    clip = ds.get("gradient_clipping", plugin.gradient_clipping)
    if clip is not None and clip != "auto" and float(clip) != float(max_grad_norm):
        fix = (
            "set gradient_clipping: auto there"
            if where
            else f"launch with --gradient_clipping {max_grad_norm}"
        )
        raise ConfigError(
            f"the launch's gradient_clipping={clip}{where} differs from {key}={max_grad_norm}; DeepSpeed "
            f"clips with its own value: {fix} (or leave it out), or set {key}={clip}"
        )


def configure_deepspeed(accelerator: Any, micro_batch_size: int, max_grad_norm: float, key: str) -> None:
    """Fill what accelerate would take from a DataLoader (the loop prepares none) before ``prepare``.

    ``train_micro_batch_size_per_gpu`` and ``train_batch_size`` set to ``"auto"`` are filled from the
    per-process batch; DeepSpeed clips gradients itself with its ``gradient_clipping`` (1.0 when its
    config has none), so an ``"auto"`` or missing one is set to ``max_grad_norm`` (0: off, written out)
    and a different explicit one, a launch's ``--gradient_clipping`` included, is an error naming both
    (``key`` is the config key of ``max_grad_norm``). Does nothing outside DeepSpeed.

    The launch's own values are kept on the plugin at the first call and filled from at every call: a
    second run in the same process (the test workers run several) shares accelerate's plugin, and the
    first run's fill would otherwise read as explicit values (a second ``max_grad_norm`` was refused as
    differing from the first's).
    """
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if plugin is None:
        return
    ds = plugin.deepspeed_config
    if not hasattr(plugin, "_judgeloop_launch"):
        # accelerate leaves a launch's `--gradient_clipping 0` out of some configs (DeepSpeed would then
        # clip at its default 1.0); the plugin still holds it
        plugin._judgeloop_launch = {
            "train_micro_batch_size_per_gpu": ds.get("train_micro_batch_size_per_gpu", "auto"),
            "train_batch_size": ds.get("train_batch_size", "auto"),
            "gradient_clipping": ds.get("gradient_clipping", plugin.gradient_clipping),
        }
    launch = plugin._judgeloop_launch
    accum = ds.get("gradient_accumulation_steps", 1)
    accum = 1 if accum == "auto" else int(accum)
    micro = launch["train_micro_batch_size_per_gpu"]
    ds["train_micro_batch_size_per_gpu"] = micro_batch_size if micro == "auto" else micro
    total = launch["train_batch_size"]
    ds["train_batch_size"] = (
        int(ds["train_micro_batch_size_per_gpu"]) * accum * accelerator.num_processes
        if total == "auto"
        else total
    )
    clip = launch["gradient_clipping"]
    if clip is None or clip == "auto":
        clip = max_grad_norm
    elif float(clip) != float(max_grad_norm):
        raise ConfigError(
            f"the DeepSpeed config's gradient_clipping={clip} differs from {key}={max_grad_norm}; DeepSpeed "
            f"clips with its own value, so set {key}={clip} or gradient_clipping: {max_grad_norm} (or auto)"
        )
    ds["gradient_clipping"] = float(clip)  # written out, 0 too: without it DeepSpeed clips at 1.0


def refuse_gradcache_under_deepspeed(accelerator: Any, chunk_size: int) -> None:
    """GradCache runs one backward per sub-batch; a DeepSpeed engine steps its optimizer at each one
    (it owns accumulation), which would apply a partial gradient several times per batch."""
    if chunk_size and getattr(accelerator.state, "deepspeed_plugin", None) is not None:
        raise ConfigError(
            f"train.gradcache_chunk_size={chunk_size} cannot run under DeepSpeed (its engine steps at every "
            "sub-batch backward); set train.gradcache_chunk_size=0 or launch with DDP / FSDP"
        )


def inference_ds_config(train_config: dict[str, Any], hidden_size: int | None) -> dict[str, Any]:
    """The DeepSpeed config of a model that only runs forward passes (the judge, a frozen reference)
    under ZeRO-3: the training config's ZeRO-3 section, no optimizer or scheduler, a micro batch of 1
    where it was ``auto``, and the bucket sizes TRL derives from the hidden size."""
    cfg = {k: v for k, v in train_config.items() if k not in ("optimizer", "scheduler")}
    cfg["zero_optimization"] = dict(train_config.get("zero_optimization", {}))
    if cfg.get("train_micro_batch_size_per_gpu", "auto") == "auto":
        cfg["train_micro_batch_size_per_gpu"] = 1
    # a flags-only launch leaves accumulation "auto" (DeepSpeed would multiply the string into its batch)
    if cfg.get("gradient_accumulation_steps", "auto") == "auto":
        cfg["gradient_accumulation_steps"] = 1
    cfg.pop("train_batch_size", None)
    if cfg.get("gradient_clipping") == "auto":
        cfg.pop("gradient_clipping")
    if hidden_size:
        cfg["zero_optimization"].update(
            reduce_bucket_size=hidden_size * hidden_size,
            stage3_param_persistence_threshold=10 * hidden_size,
            stage3_prefetch_bucket_size=int(0.9 * hidden_size * hidden_size),
        )
    return cfg


def prepare_for_inference(model: Any, accelerator: Any) -> Any:
    """A model that runs forward passes only, made usable under ZeRO-3: there transformers loads every
    model created after ``Accelerator()`` already partitioned, and only a DeepSpeed engine gathers its
    weights at each forward (TRL prepares its reference and reward models the same way). Elsewhere the
    model is returned as it is."""
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if plugin is None or plugin.zero_stage != 3:
        return model
    import deepspeed  # pragma: no cover - needs DeepSpeed on GPUs

    hidden = getattr(getattr(model, "config", None), "hidden_size", None)  # pragma: no cover
    engine, *_ = deepspeed.initialize(  # pragma: no cover
        model=model, config=inference_ds_config(plugin.deepspeed_config, hidden)
    )
    engine.eval()  # pragma: no cover
    return engine.module  # pragma: no cover - forwards gather through the engine's hooks


def shard(items: Sequence[Any], accelerator: Accelerator) -> list[Any]:
    """This process's share of ``items`` (every ``num_processes``-th item, from its index), padded so that
    every process gets the same number: the last item repeats where a process would have one fewer.

    Under FSDP and ZeRO-3 each forward pass is a collective (every rank gathers the weights), so a rank
    with one batch fewer would leave the others waiting forever. Results for the padding are dropped
    with :func:`real_part` before they are gathered.
    """
    n, size = len(items), accelerator.num_processes
    padded = list(items) + [items[-1]] * (-n % size) if n else []
    return padded[accelerator.process_index :: size]


def real_part(results: Sequence[Any], num_items: int, accelerator: Accelerator) -> list[Any]:
    """The results of this process's real items of a :func:`shard` of ``num_items`` (the padding dropped)."""
    return list(results[: len(range(accelerator.process_index, num_items, accelerator.num_processes))])
