"""Memory-lean forward paths for a causal LM trained on the CPU: the same values, less saved for backward.

:func:`lean_cpu_forward` applies both of these where the model has them.

**Grouped-query attention without the repeated keys and values.**

Transformers' ``sdpa`` attention repeats each key/value head for every query head it serves before
calling ``scaled_dot_product_attention`` whenever there is an attention mask (the loop always has one:
prompts are left-padded), because CUDA's fused kernels take grouped heads only without a mask. On CPU,
torch's kernel takes them with a mask (``enable_gqa=True``), so the repeated copies are not needed. Under
autograd those copies are saved for the backward pass: on the quickstart's SmolLM2-135M (9 query heads,
3 key/value heads) they were 88 of the 191 MB its attention saved (peak RSS 2,193-2,194 -> 2,081-2,132 MB
over five steps, 2 CPU cores). Logits are bit-identical; gradients agree to float rounding (tested).

**SwiGLU saving two tensors, not three.** A Llama-style MLP computes ``down(silu(gate(x)) * up(x))``;
autograd keeps ``gate(x)`` for the SiLU and both ``silu(gate(x))`` and ``up(x)`` for the product, three
(tokens x intermediate) tensors a layer. :class:`_SwiGLU` keeps ``gate(x)`` and ``up(x)`` and recomputes
the sigmoid in backward (an elementwise pass). On the quickstart that is 100 of the 300 MB the MLPs
saved. Forward values are bit-identical; gradients use torch's own SiLU derivative, to float rounding.
"""

from __future__ import annotations

from typing import Any

import torch

NAME = "judgeloop_sdpa_gqa"
_registered = False
# MLP classes whose forward is exactly down_proj(act_fn(gate_proj(x)) * up_proj(x)) (checked by name: a
# class with the same attributes but another forward is left alone)
SWIGLU_MLPS = ("LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP", "SmolLM3MLP", "OlmoMLP", "Olmo2MLP")


def lean_cpu_forward(model: Any) -> list[str]:
    """Apply :func:`use_grouped_attention` and :func:`use_lean_swiglu` to a model that will train on the
    CPU; returns the names of those that applied."""
    applied = []
    if use_grouped_attention(model):
        applied.append("grouped_attention")
    if use_lean_swiglu(model):
        applied.append("lean_swiglu")
    return applied


class _SwiGLU(torch.autograd.Function):
    """``silu(g) * u`` saving ``g`` and ``u`` only."""

    @staticmethod
    def forward(ctx: Any, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(g, u)
        return torch.nn.functional.silu(g) * u

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        g, u = ctx.saved_tensors
        d_g = d_u = None
        if ctx.needs_input_grad[1]:
            d_u = grad * torch.nn.functional.silu(g)
        if ctx.needs_input_grad[0]:
            d_g = torch.ops.aten.silu_backward(grad * u, g)  # torch's own derivative of SiLU
        return d_g, d_u


def _lean_mlp_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    return self.down_proj(_SwiGLU.apply(self.gate_proj(x), self.up_proj(x)))


def use_lean_swiglu(model: Any) -> bool:
    """Give every SiLU-gated MLP of a known class (:data:`SWIGLU_MLPS`) the forward of :class:`_SwiGLU`;
    returns whether any was changed."""
    from transformers.activations import SiLUActivation

    changed = False
    for module in model.modules():
        if type(module).__name__ in SWIGLU_MLPS and isinstance(
            getattr(module, "act_fn", None), (SiLUActivation, torch.nn.SiLU)
        ):
            module.forward = _lean_mlp_forward.__get__(module)
            changed = True
    return changed


def _gqa_sdpa(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """``sdpa`` attention, grouped heads passed as they are when a mask is given and there are several
    query positions; every other case (decoding, no mask, softcap, position bias) is transformers' own."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    grouped = getattr(module, "num_key_value_groups", 1) > 1
    plain = kwargs.get("softcap") is None and kwargs.get("position_bias") is None
    if not (grouped and plain and attention_mask is not None and query.shape[2] > 1):
        return sdpa_attention_forward(
            module,
            query,
            key,
            value,
            attention_mask,
            dropout=dropout,
            scaling=scaling,
            is_causal=is_causal,
            **kwargs,
        )
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, enable_gqa=True
    )  # (B, H, T, D); the mask carries causality
    return out.transpose(1, 2).contiguous(), None


def use_grouped_attention(model: Any) -> bool:
    """Switch a model that uses ``sdpa`` and grouped key/value heads to :func:`_gqa_sdpa`; returns whether
    it did (models with other attention or without grouped heads are left as they are). For models that
    run on the CPU: CUDA's fused kernels refuse grouped heads with a mask and would fall back to the
    unfused one, so the caller switches only CPU runs."""
    global _registered
    config = getattr(model, "config", None)
    if config is None or getattr(config, "_attn_implementation", None) != "sdpa":
        return False
    heads, kv_heads = (
        getattr(config, "num_attention_heads", None),
        getattr(config, "num_key_value_heads", None),
    )
    if not heads or not kv_heads or kv_heads >= heads:
        return False
    if not _registered:
        from transformers import AttentionInterface, AttentionMaskInterface
        from transformers.masking_utils import sdpa_mask

        AttentionInterface.register(NAME, _gqa_sdpa)
        AttentionMaskInterface.register(NAME, sdpa_mask)  # the same masks as sdpa
        _registered = True
    model.set_attn_implementation(NAME)
    return True
