"""The policy and its reference: full fine-tuning with a frozen copy, or LoRA with the adapters disabled.

With LoRA (peft) the reference is the same base weights with the adapters switched off, so no second
copy of the model is held. Only trainable parameters (the adapters, or everything) are checkpointed.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from judgeloop.io import atomic_path
from judgeloop.logging import get_logger
from judgeloop.loop.config import PolicyConfig
from judgeloop.loop.rollout import token_logprobs
from judgeloop.models import load_causal_lm, load_tokenizer
from judgeloop.models.lean import lean_cpu_forward

logger = get_logger(__name__)


@contextlib.contextmanager
def eval_mode(model: Any) -> Iterator[Any]:
    """``model`` in eval mode for the block, then back to the mode it was in."""
    was_training = model.training
    model.eval()
    try:
        yield model
    finally:
        if was_training:
            model.train()


_SFT_CACHE: dict[tuple, dict[str, torch.Tensor]] = {}


def sft_warmup(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[Sequence[int]],
    targets: Sequence[str],
    cfg: PolicyConfig,
    seed: int,
) -> list[float]:
    """Supervised warm-up before preference tuning (SFT, then DPO): maximize log pi(reference | prompt)
    on *training* articles for ``cfg.sft_steps`` steps. The reference policy is the warmed-up model.
    Deterministic given ``seed``, so a resumed run rebuilds the same reference. Returns the losses."""
    g = torch.Generator().manual_seed(seed)
    comps = [
        tokenizer(t, add_special_tokens=False)["input_ids"][: cfg.sft_max_tokens] + [tokenizer.eos_token_id]
        for t in targets
    ]
    from judgeloop.optim import adamw

    opt = adamw([p for p in model.parameters() if p.requires_grad], lr=cfg.sft_learning_rate)
    model.train()
    losses = []
    for _ in range(cfg.sft_steps):
        idx = torch.randint(len(prompts), (cfg.sft_batch_size,), generator=g).tolist()
        logp, mask = token_logprobs(
            model, [prompts[i] for i in idx], [comps[i] for i in idx], tokenizer.pad_token_id
        )
        loss = -(logp.sum() / mask.sum())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses


def load_policy(
    cfg: PolicyConfig,
    seed: int,
    sft_data: tuple[list[list[int]], list[str]] | None = None,
    frozen_fp32: bool = False,
    sft_file: Path | None = None,
    lean_cpu: bool = False,
) -> tuple[Any, Any, Any | None]:
    """Return ``(policy, tokenizer, frozen_reference_or_None)``; the reference is None under LoRA.

    ``sft_data`` = (prompt ids, reference summaries) of training articles for the optional SFT warm-up.

    Trained weights are always float32 (the master copy the optimizer updates; bf16 compute comes from
    autocast): AdamW on bf16 weights loses most small updates. ``policy.dtype=bfloat16`` stores the
    *frozen* weights in bf16: the LoRA base, or the reference copy under full fine-tuning.
    ``frozen_fp32`` keeps those in float32 too (FSDP, which refuses mixed dtypes in one unit and casts
    for compute itself). ``sft_file``: where the warm start is shared between processes: the first
    process to get here (the main one, under ``main_process_first``) trains and writes it, the others
    read it instead of repeating the same warm-up (a file made for other settings is ignored).
    ``lean_cpu`` (a CPU run): the memory-lean forward paths of :mod:`judgeloop.models.lean` (grouped
    key/value heads without repeated copies, a SwiGLU saving two tensors), for the policy, its warm-up
    and its reference.
    """
    torch.manual_seed(seed)
    tokenizer = load_tokenizer(cfg.model)
    model = load_causal_lm(cfg.model, dtype="float32")
    if lean_cpu:
        lean_cpu_forward(model)
    frozen_dtype = torch.bfloat16 if cfg.dtype == "bfloat16" and not frozen_fp32 else torch.float32
    if cfg.sft_steps and sft_data is not None:
        key = (
            cfg.model,
            cfg.dtype,
            cfg.sft_steps,
            cfg.sft_learning_rate,
            cfg.sft_batch_size,
            cfg.sft_max_tokens,
            cfg.sft_seed,
            len(sft_data[0]),
            sum(map(len, sft_data[0])),
        )
        # in this process, a warm start is reused only at the numerics it was made with: the same weights
        # warmed up at another thread count (or autocast, or forward path) differ by float rounding, so a
        # run after another in one process (a test session, a notebook) would start where a fresh process
        # at its own settings does not (issue 54)
        local = (key, *warmup_numerics(lean_cpu))
        shared = _read_warm_start(sft_file, key) if sft_file is not None else None
        if shared is not None:
            _SFT_CACHE.clear()
            _SFT_CACHE[local] = shared
        if local not in _SFT_CACHE:  # the ablation runs many arms and seeds from the same warm start
            losses = sft_warmup(model, tokenizer, sft_data[0], sft_data[1], cfg, cfg.sft_seed)
            logger.info("SFT warm-up: %d steps, loss %.3f -> %.3f", cfg.sft_steps, losses[0], losses[-1])
            _SFT_CACHE.clear()
            _SFT_CACHE[local] = {k: v.detach().clone() for k, v in model.state_dict().items()}
            if sft_file is not None:
                with atomic_path(sft_file) as tmp:
                    torch.save({"key": repr(key), "state": _SFT_CACHE[local]}, tmp)
        model.load_state_dict(_SFT_CACHE[local])
    if cfg.lora:
        from peft import LoraConfig, get_peft_model

        model = model.to(frozen_dtype)  # the frozen base; PEFT makes the adapters in float32
        lora = LoraConfig(
            r=cfg.lora_r,
            lora_alpha=cfg.lora_alpha,
            lora_dropout=cfg.lora_dropout,
            target_modules=list(cfg.lora_target_modules),
            task_type="CAUSAL_LM",
        )
        model = get_peft_model(model, lora)
        ref = None
    else:
        ref = copy.deepcopy(model).to(frozen_dtype).eval()
        for p in ref.parameters():
            p.requires_grad_(False)
    model.train()
    return model, tokenizer, ref


def warmup_numerics(lean_cpu: bool) -> tuple:
    """What, besides its settings and data, decides the warm start's float rounding in this process: the
    intra-op thread count (a reduction split over more threads sums in another order), the autocast in
    force (device and dtype) and the forward path (``lean_cpu``)."""
    autocast = tuple(
        (dev, str(torch.get_autocast_dtype(dev))) for dev in ("cpu", "cuda") if torch.is_autocast_enabled(dev)
    )
    return torch.get_num_threads(), autocast, lean_cpu


def _read_warm_start(path: Path, key: tuple) -> dict[str, torch.Tensor] | None:
    """The warm start another process wrote to ``path`` for these settings, or None."""
    if not path.is_file():
        return None
    saved = torch.load(path, map_location="cpu", weights_only=True)
    return saved["state"] if saved.get("key") == repr(key) else None


@torch.no_grad()
def reference_logprobs(
    policy: Any,
    ref: Any | None,
    prompts: Sequence[Sequence[int]],
    completions: Sequence[Sequence[int]],
    pad_id: int,
    samples_per_prompt: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, T) token log-probs under pi_ref: the frozen copy, or the policy with its LoRA adapters disabled."""
    if ref is not None:
        return token_logprobs(ref, prompts, completions, pad_id, samples_per_prompt)
    was_training = policy.training
    policy.eval()
    with policy.disable_adapter():
        out = token_logprobs(policy, prompts, completions, pad_id, samples_per_prompt)
    if was_training:
        policy.train()
    return out
