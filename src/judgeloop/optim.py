"""The optimizer every trainer here uses: torch's AdamW, fused where the device allows it."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

_FUSED_DEVICES = ("cpu", "cuda")


def adamw(params: Iterable[Any], lr: float, weight_decay: float = 0.01) -> torch.optim.AdamW:
    """``torch.optim.AdamW`` over ``params`` (tensors or param-group dicts), fused into one kernel per step
    when every parameter is a floating-point tensor on one CPU or CUDA device.

    Without ``fused`` torch updates CPU parameters one tensor at a time: measured on 2 CPU cores, an
    all-MiniLM-L6-v2 step took 108 ms that way and 19 ms fused. The update is the same AdamW; only
    the kernels differ (float rounding). Optimizer state dicts load either way.
    """
    groups = list(params)
    tensors = [p for g in groups for p in (g["params"] if isinstance(g, dict) else [g])]
    fused = (
        bool(tensors)
        and len({p.device for p in tensors}) == 1
        and tensors[0].device.type in _FUSED_DEVICES
        and all(p.dtype.is_floating_point for p in tensors)
    )
    return torch.optim.AdamW(groups, lr=lr, weight_decay=weight_decay, fused=True if fused else None)
