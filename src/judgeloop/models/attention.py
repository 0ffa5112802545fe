"""Grouped-query attention without the repeated keys and values, on CPU.

Transformers' ``sdpa`` attention repeats each key/value head for every query head it serves before
calling ``scaled_dot_product_attention`` whenever there is an attention mask (the loop always has one:
prompts are left-padded), because CUDA's fused kernels take grouped heads only without a mask. On CPU,
torch's kernel takes them with a mask (``enable_gqa=True``), so the repeated copies are not needed. Under
autograd those copies are saved for the backward pass: on the quickstart's SmolLM2-135M (9 query heads,
3 key/value heads) they were about 140 MB of the update's peak RSS (2,179 -> 2,041 MB over four steps,
2 CPU cores). Logits are bit-identical; gradients agree to float rounding (tested).
"""

from __future__ import annotations

from typing import Any

import torch

NAME = "judgeloop_sdpa_gqa"
_registered = False


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
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal,
            **kwargs,
        )  # fmt: skip
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
