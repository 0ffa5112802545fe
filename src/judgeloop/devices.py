"""Where a run computes: ``device: auto | cpu | cuda``, one setting for the loop, the retriever, SFT and
the judges.

``auto`` (the default) is a GPU when torch sees one and the CPU otherwise, so a GPU launch file
(DDP, FSDP, DeepSpeed) is honoured without a second switch; ``cpu`` keeps a run on the CPU even on a GPU
machine (accelerate then runs several processes over gloo); ``cuda`` asks for a GPU and is an error
before any work when there is none.
"""

from __future__ import annotations

from typing import Any, Literal

import torch

from judgeloop.config import ConfigError

Device = Literal["auto", "cpu", "cuda"]
DEVICES = ("auto", "cpu", "cuda")


def check_device(device: str, key: str = "device") -> None:
    """Refuse (:class:`ConfigError`) a device that is not one of :data:`DEVICES`, or ``cuda`` where torch
    sees no GPU."""
    if device not in DEVICES:
        raise ConfigError(f"{key}={device!r}; use auto (a GPU when there is one), cpu or cuda")
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            f"{key}=cuda but torch sees no CUDA GPU (torch.cuda.is_available() is False); "
            f"use {key}=auto or {key}=cpu"
        )


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


def native_bf16(device: str = "cpu") -> bool:
    """Whether bf16 arithmetic is native here: a GPU that supports it, or a CPU whose flags (read from
    ``/proc/cpuinfo`` at run time) include ``avx512_bf16`` or ``amx_bf16``. Elsewhere bf16 is emulated
    and slower than float32."""
    if device.startswith("cuda"):
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    try:
        with open("/proc/cpuinfo") as fh:
            flags = next((line.split(":", 1)[1].split() for line in fh if line.startswith("flags")), [])
    except OSError:  # not Linux: no cheap way to tell, so assume not
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_precision(precision: str, device: str = "cpu") -> str:
    """``auto`` -> ``bf16`` where :func:`native_bf16`, else ``no`` (float32); other values unchanged."""
    if precision != "auto":
        return precision
    return "bf16" if native_bf16(device) else "no"
