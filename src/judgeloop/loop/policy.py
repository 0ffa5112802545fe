"""The policy and its reference: full fine-tuning with a frozen copy, or LoRA with the adapters disabled.

With LoRA (peft) the reference is the same base weights with the adapters switched off, so no second
copy of the model is held. Only trainable parameters (the adapters, or everything) are checkpointed.

:class:`Policy` is the policy as the loop uses it, one object: the model, its reference, how an article
becomes a prompt, the tokenizer and where it generates. It samples (step 1 and the calibration pairs),
decodes greedily (itself, or the reference) and measures KL(pi || pi_ref) on its own samples; the loop's
functions take it instead of its parts. :func:`load_policy` loads the model and its reference (after the
SFT warm start), :func:`generation_backend` starts where it generates.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator

from judgeloop.data import SummExample
from judgeloop.distributed import generation_context
from judgeloop.io import atomic_path
from judgeloop.logging import get_logger
from judgeloop.loop.config import FeedbackLoopConfig, GenerationConfig, PolicyConfig
from judgeloop.loop.losses import kl_per_sequence
from judgeloop.loop.rollout import (
    IN_PROCESS,
    GenerationBackend,
    PromptBuilder,
    PromptPrefix,
    Rollout,
    decode,
    generate,
    token_logprobs,
)
from judgeloop.loop.vllm_backend import policy_engine
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


@dataclass
class Policy:
    """The policy the loop trains, as one object: its model and reference, the tokenizer, the prompt
    builder and where it generates (the run's :class:`~judgeloop.loop.rollout.GenerationBackend`).

    It samples (:meth:`sample`: step 1's rollout, the calibration pairs), decodes greedily (:meth:`greedy`,
    with its adapters; :meth:`reference_greedy`, the reference: the frozen copy, or the policy with its
    LoRA adapters disabled) and measures KL(pi || pi_ref) on one sample per article (:meth:`sampled_kl`).
    Only the policy's own calls reach a vLLM engine: the reference always runs in this process.
    """

    accelerator: Accelerator
    model: Any  # the prepared policy (wrapped under DDP / FSDP / ZeRO-3): the weights the optimizer steps
    ref: Any | None  # the frozen reference copy; None under LoRA (the policy with its adapters disabled)
    tokenizer: Any
    build_prompt: PromptBuilder  # article -> prompt token ids
    backend: GenerationBackend = IN_PROCESS  # where the policy generates: hf (here) or its vLLM engine

    @property
    def unwrapped(self) -> Any:
        """The model itself, out of its DDP / FSDP wrapper: the one that generates and is served."""
        return self.accelerator.unwrap_model(self.model)

    def generating(self) -> contextlib.AbstractContextManager[None]:
        """Around generation and scoring outside the update (:func:`judgeloop.distributed.generation_context`):
        the parameters gathered once under ZeRO-3 / FSDP."""
        return generation_context(self.model)

    @contextlib.contextmanager
    def as_reference(self) -> Iterator[Any]:
        """The reference model for the block: the frozen copy, or the policy with its adapters disabled."""
        if self.ref is not None:
            yield self.ref
            return
        unwrapped = self.unwrapped
        with unwrapped.disable_adapter():
            yield unwrapped

    def sample(
        self,
        articles: Sequence[str],
        gen: GenerationConfig,
        seed: int,
        num_pairs: int = 1,
        keep_prefix: bool = False,
        num_samples: int = 2,
    ) -> Rollout:
        """The rollout: two samples per article (``2 * num_pairs`` for calibration data, giving
        ``num_pairs`` pairs per article, each article repeated in the output), or a group of
        ``num_samples`` (GRPO; one draw, so the first two are the samples a k = 2 rollout gives), drawn
        where :attr:`backend` says. ``keep_prefix``: keep the policy's prompt pass for the update
        (:class:`~judgeloop.loop.rollout.PromptPrefix`)."""
        if num_samples != 2 and num_pairs != 1:
            raise ValueError(
                f"num_samples={num_samples} with num_pairs={num_pairs}: a group rollout has one group"
            )
        tokenizer = self.tokenizer
        prompts = [self.build_prompt(a) for a in articles]
        kept: list[PromptPrefix] | None = [] if keep_prefix and num_pairs == 1 else None
        k = num_samples * num_pairs
        comps = generate(
            self.unwrapped,
            tokenizer,
            prompts,
            gen,
            num_samples=k,
            seed=seed,
            keep_prefix=kept,
            backend=self.backend,
        )
        samples = [comps[j::num_samples] for j in range(num_samples)]  # sample j of each article (or pair)
        a_ids, b_ids = samples[0], samples[1]
        return Rollout(
            [a for a in articles for _ in range(num_pairs)],
            [p for p in prompts for _ in range(num_pairs)],
            a_ids,
            b_ids,
            decode(tokenizer, a_ids),
            decode(tokenizer, b_ids),
            kept[0] if kept else None,
            samples[2:],
            [decode(tokenizer, c) for c in samples[2:]],
        )

    def greedy(self, examples: Sequence[SummExample], gen: GenerationConfig, batch_size: int) -> list[str]:
        """The policy's greedy summaries of ``examples`` (eval mode, in batches), generated where
        :attr:`backend` says."""
        with eval_mode(self.unwrapped) as model:
            return self._greedy(model, examples, gen, batch_size, self.backend)

    def reference_greedy(
        self, examples: Sequence[SummExample], gen: GenerationConfig, batch_size: int
    ) -> list[str]:
        """The reference's greedy summaries of ``examples``, in this process under either backend (the frozen
        copy, or the policy with its adapters disabled, is not the engine's model)."""
        with self.as_reference() as ref:
            return self._greedy(ref, examples, gen, batch_size, IN_PROCESS)

    def _greedy(
        self,
        model: Any,
        examples: Sequence[SummExample],
        gen: GenerationConfig,
        batch_size: int,
        backend: GenerationBackend,
    ) -> list[str]:
        out: list[str] = []
        for i in range(0, len(examples), batch_size):
            prompts = [self.build_prompt(e.article) for e in examples[i : i + batch_size]]
            out += decode(
                self.tokenizer, generate(model, self.tokenizer, prompts, gen, greedy=True, backend=backend)
            )
        return out

    @torch.no_grad()
    def sampled_kl(
        self, examples: Sequence[SummExample], gen: GenerationConfig, batch_size: int, seed: int
    ) -> tuple[list[float], list[str]]:
        """k1 estimate of KL(pi || pi_ref) per article from one sample of pi each (eval mode; drawn where
        :attr:`backend` says, the log-probs are the training model's); also returns the samples."""
        kls: list[float] = []
        texts: list[str] = []
        pad_id = self.tokenizer.pad_token_id
        with eval_mode(self.unwrapped) as model:
            for i in range(0, len(examples), batch_size):
                prompts = [self.build_prompt(e.article) for e in examples[i : i + batch_size]]
                comps = generate(
                    model, self.tokenizer, prompts, gen, num_samples=1, seed=seed + i, backend=self.backend
                )
                pol, mask = token_logprobs(model, prompts, comps, pad_id)
                refl, _ = reference_logprobs(model, self.ref, prompts, comps, pad_id)
                kls += kl_per_sequence(pol, refl, mask, "k1").tolist()
                texts += decode(self.tokenizer, comps)
        return kls, texts


@contextlib.contextmanager
def generation_backend(
    cfg: FeedbackLoopConfig, policy: Policy, out_dir: Path, optimizer: Any
) -> Iterator[GenerationBackend]:
    """The run's generation backend for the block (``generation.backend``): ``hf``, the policy generates
    in this process; ``vllm``, an engine serves the policy (its unwrapped model, the one that generates),
    synced after every step of ``optimizer``, started here and ended on leaving
    (:func:`judgeloop.loop.vllm_backend.policy_engine`)."""
    if cfg.generation.backend != "vllm":
        yield IN_PROCESS
        return
    unwrapped = policy.unwrapped
    with policy_engine(cfg, unwrapped, policy.tokenizer, out_dir, optimizer) as engine:
        yield GenerationBackend(engine, unwrapped)
