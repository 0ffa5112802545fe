"""Where a run computes: ``device: auto | cpu | cuda``, one setting for the loop, the retriever, SFT and
the judges.

``auto`` (the default) is a GPU when torch sees one and the CPU otherwise, so a GPU launch file
(DDP, FSDP, DeepSpeed) is honoured without a second switch; ``cpu`` keeps a run on the CPU even on a GPU
machine (accelerate then runs several processes over gloo); ``cuda`` asks for a GPU and is an error
before any work when there is none.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Literal

import torch

from judgeloop.config import ConfigError

Device = Literal["auto", "cpu", "cuda"]
DEVICES = ("auto", "cpu", "cuda")


def resolve_device(device: str, key: str = "device") -> torch.device:
    """The ``torch.device`` a setting names: ``auto`` is the GPU when torch sees one, else the CPU; any
    other value (``cpu``, ``cuda``, ``cuda:N``, ``mps``) is kept, and a CUDA or MPS device that is not
    here is a :class:`ConfigError` naming ``key`` and the fix, before any work."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            f"{key}={device} but torch sees no CUDA GPU (torch.cuda.is_available() is False); "
            f"use {key}=auto or {key}=cpu"
        )
    if dev.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(f"{key}={device} but torch sees no MPS device; use {key}=auto or {key}=cpu")
    return dev


def check_device(device: str, key: str = "device") -> None:
    """Refuse (:class:`ConfigError`) a device that is not one of :data:`DEVICES`, or one that is not here
    (:func:`resolve_device`)."""
    if device not in DEVICES:
        raise ConfigError(f"{key}={device!r}; use auto (a GPU when there is one), cpu or cuda")
    resolve_device(device, key)


def on_cpu(device: str) -> bool:
    """Whether ``device`` resolves to the CPU here (the ``cpu=`` argument of ``Accelerator``)."""
    return device == "cpu" or (device == "auto" and not torch.cuda.is_available())


def process_device(device: str, accelerator: Any) -> str:
    """A component's device inside an accelerate run: ``auto`` is the run's device, and on a GPU run
    ``cuda`` (or any ``cuda:N`` under several processes) is this process's own GPU, never every process on
    ``cuda:0``; anything else (``cpu``, ``cuda:N`` in a one-process run) is kept as it is."""
    run = accelerator.device
    if run.type == "cuda" and (
        device == "cuda" or (device.startswith("cuda:") and accelerator.num_processes > 1)
    ):
        return str(run)
    if device == "auto":
        return str(run) if run.type == "cuda" else run.type  # a CPU run's device can read "cpu:0"
    return device


def cpu_flags() -> list[str]:
    """The CPU's feature flags from ``/proc/cpuinfo`` (empty where there is none: not Linux)."""
    try:
        with open("/proc/cpuinfo") as fh:
            return next((line.split(":", 1)[1].split() for line in fh if line.startswith("flags")), [])
    except OSError:
        return []


def native_bf16(device: str = "cpu") -> bool:
    """Whether bf16 arithmetic is native here: a GPU that supports it, or a CPU whose flags (read from
    ``/proc/cpuinfo`` at run time) include ``avx512_bf16`` or ``amx_bf16``. Elsewhere bf16 is emulated
    and slower than float32."""
    if device.startswith("cuda"):
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    flags = cpu_flags()
    return "avx512_bf16" in flags or "amx_bf16" in flags


# The flags that choose which kernels (and so which float rounding) a CPU run gets.
KERNEL_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")


def numerics(device_type: str, precision: str) -> dict[str, Any]:
    """What decides a run's float rounding besides its config: the intra-op thread count (a reduction
    split over more threads sums in another order), the kernels torch dispatches to here (its CPU
    capability and the CPU's kernel flags, or the GPU's name) and the precision path (``fp32`` or
    ``bf16``). Two runs of one config agree bit for bit only where these agree; checkpoints and
    reports record them."""
    out: dict[str, Any] = {
        "threads": torch.get_num_threads(),
        "device": device_type,
        "precision": precision,
    }
    if device_type == "cuda" and torch.cuda.is_available():
        out["kernels"] = torch.cuda.get_device_name()
    else:
        flags = set(cpu_flags())
        out["kernels"] = " ".join(
            [torch.backends.cpu.get_cpu_capability(), *(f for f in KERNEL_FLAGS if f in flags)]
        )
    return out


def numerics_differences(saved: dict[str, Any] | None, now: dict[str, Any]) -> list[str]:
    """``key: saved -> now`` for each numerics entry that differs (none when ``saved`` is missing)."""
    if not saved:
        return []
    return [f"{k}: {saved.get(k)} -> {now.get(k)}" for k in now if saved.get(k) != now.get(k)]


@contextmanager
def intra_op_threads(threads: int | None) -> Iterator[None]:
    """torch's intra-op thread count set to ``threads`` inside the block and restored after (``None``:
    left as the process has it)."""
    if threads is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def resolve_precision(precision: str, device: str = "cpu") -> str:
    """``auto`` -> ``bf16`` where :func:`native_bf16`, else ``no`` (float32); other values unchanged."""
    if precision != "auto":
        return precision
    return "bf16" if native_bf16(device) else "no"
