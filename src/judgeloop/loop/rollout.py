"""Rollout's parts: prompts from articles, batched KV-cached sampling, and per-token log-probs of summaries
(the policy's rollout, :meth:`judgeloop.loop.policy.Policy.sample`, puts them together).

Prompts are left-padded and summaries right-padded, so one forward pass over ``prompt + summary``
scores a whole batch; only the last ``T + 1`` positions' logits are computed (``logits_to_keep``),
and log-probs are taken as ``logit[y] - logsumexp(logits)`` so no (N, T, V) log-softmax is kept.
The two samples of an article share one pass over its prompt (``samples_per_prompt=2``), and the
training rollout can keep the policy's pass over its prompts, with its autograd graph, for the update
(:class:`PromptPrefix`): sampling and the update then run the prompts through the policy once between them.
Where the policy generates is an argument, the run's :class:`GenerationBackend` (the policy's
``backend``): in this process, or on the vLLM engine that serves it.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from judgeloop.loop.config import GenerationConfig, PolicyConfig
from judgeloop.loop.vllm_backend import VllmEngine


class PromptBuilder:
    """Article -> prompt token ids: the article is cut to ``max_article_tokens`` (explicit truncation),
    put in ``prompt_template`` and wrapped in the chat template when the tokenizer has one."""

    def __init__(self, tokenizer: Any, cfg: PolicyConfig):
        self.tokenizer = tokenizer
        self.cfg = cfg
        self._cache: dict[str, list[int]] = {}
        self.truncated: set[str] = set()  # digests of the articles cut to fit (kept across a resume)

    @property
    def num_truncated(self) -> int:
        """Distinct articles cut to ``max_article_tokens``."""
        return len(self.truncated)

    def __call__(self, article: str) -> list[int]:
        key = article
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        tok = self.tokenizer
        art_ids = tok(article, add_special_tokens=False)["input_ids"]
        if len(art_ids) > self.cfg.max_article_tokens:
            self.truncated.add(hashlib.sha256(key.encode()).hexdigest()[:16])
            article = tok.decode(art_ids[: self.cfg.max_article_tokens], skip_special_tokens=True)
        text = self.cfg.prompt_template.format(article=article)
        if self.cfg.use_chat_template and getattr(tok, "chat_template", None):
            text = tok.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
            )
            ids = tok(text, add_special_tokens=False)["input_ids"]
        else:
            ids = tok(text, add_special_tokens=True)["input_ids"]
        self._cache[key] = ids
        return ids


def left_pad(seqs: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, P) ids and attention mask, padded on the left."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        if s:
            ids[i, width - len(s) :] = torch.tensor(s, dtype=torch.long)
            mask[i, width - len(s) :] = 1
    return ids, mask


def right_pad(seqs: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, T) ids and mask, padded on the right (T >= 1 even when every sequence is empty)."""
    width = max(1, max(len(s) for s in seqs))
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        if s:
            ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
            mask[i, : len(s)] = 1
    return ids, mask


@dataclass
class PromptPrefix:
    """The policy's forward pass over its prompts but their last token, run *with* gradients before sampling.

    Sampling prefills each prompt once and decodes from there; the update then needs the same pass
    again, with gradients, to score the summaries. Between the two the policy's weights do not change
    (the optimizer steps after the update), so this pass is kept, its keys/values still attached to the
    autograd graph, and the update runs only the last prompt token and the summaries on top of it. Its
    values and gradients equal a fresh pass up to float rounding, provided the two passes run in the
    same mode: no active dropout and the same precision (:func:`prefix_reusable` and :func:`judgeloop.loop.setup.shares_prompt_pass`).
    The graph holds the prompts' activations from the rollout until the update's backward.
    """

    cache: Any  # the KV cache of prompt[:-1], one row per prompt, its tensors carrying the graph
    ids: torch.Tensor  # (B, P) the left-padded prompts
    mask: torch.Tensor  # (B, P) their attention mask

    def take(self, k: int) -> Any:
        """The cache with each prompt's row repeated ``k`` times (differentiably), for one use only."""
        cache, self.cache = self.cache, None
        if cache is None:
            raise RuntimeError("the rollout's prompt pass was already used by an update")
        cache.batch_repeat_interleave(k)
        return cache


@dataclass
class Rollout:
    """Two sampled summaries per article: ``a[i]`` and ``b[i]`` share ``prompts[i]``; a group rollout
    (``num_samples`` k > 2) has its samples 3..k in ``more_ids`` / ``more_text`` (sample-major)."""

    articles: list[str]
    prompts: list[list[int]]
    a_ids: list[list[int]]
    b_ids: list[list[int]]
    a_text: list[str]
    b_text: list[str]
    prefix: PromptPrefix | None = None  # the policy's prompt pass kept for the update (keep_prefix=True)
    more_ids: list[list[list[int]]] = field(default_factory=list)  # (k - 2) lists of one sample per article
    more_text: list[list[str]] = field(default_factory=list)

    @property
    def num_samples(self) -> int:
        """Samples per article (k)."""
        return 2 + len(self.more_ids)

    def sample_ids(self) -> list[list[list[int]]]:
        """The k lists of samples (``sample_ids()[j][i]``: sample j of article i)."""
        return [self.a_ids, self.b_ids, *self.more_ids]

    def select(self, idx: Sequence[int]) -> Rollout:
        """The rollout of articles ``idx`` (in that order), without a kept prompt pass: a minibatch of a
        round's pairs (``mode: rounds``)."""
        pick = lambda xs: [xs[i] for i in idx]  # noqa: E731
        return Rollout(
            pick(self.articles),
            pick(self.prompts),
            pick(self.a_ids),
            pick(self.b_ids),
            pick(self.a_text),
            pick(self.b_text),
            more_ids=[pick(x) for x in self.more_ids],
            more_text=[pick(x) for x in self.more_text],
        )

    def group_texts(self) -> list[list[str]]:
        """Per article, its k samples' texts (article i's group)."""
        texts = [self.a_text, self.b_text, *self.more_text]
        return [[t[i] for t in texts] for i in range(len(self.articles))]


def prefix_reusable(model: Any) -> bool:
    """Whether the policy computes the same in eval and train mode (no dropout with p > 0, no attention
    dropout), so that the prompt pass of sampling (eval mode) can serve the update (train mode)."""
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout) and m.p > 0:
            return False
        if float(getattr(getattr(m, "config", None), "attention_dropout", 0.0) or 0.0) > 0:
            return False
    return True


def adapters_disabled(model: Any) -> bool:
    """Whether a peft model is inside ``disable_adapter()`` (then it is the reference, not the policy)."""
    if not hasattr(model, "peft_config"):
        return False
    from peft.tuners.tuners_utils import BaseTunerLayer

    return any(m.disable_adapters for m in model.modules() if isinstance(m, BaseTunerLayer))


@dataclass(frozen=True)
class GenerationBackend:
    """Where :func:`generate` runs the policy (``generation.backend``): ``hf`` without an engine (the
    model's own ``generate``, in this process), ``vllm`` with one (the calls on ``policy`` become requests
    to ``engine``, :mod:`judgeloop.loop.vllm_backend`). Any other model (a frozen reference), and the
    policy with its adapters disabled (then it is the reference), generate in this process under either.

    The run makes one in its set-up (:func:`judgeloop.loop.policy.generation_backend`) and its policy
    holds it (``run.policy.backend``) for every generation; the default :data:`IN_PROCESS` is ``hf``.
    """

    engine: VllmEngine | None = None  # the vLLM engine serving the policy; None under hf
    policy: Any = field(default=None, repr=False)  # the model the engine serves: the unwrapped policy

    def engine_serving(self, model: Any) -> VllmEngine | None:
        """The engine that generates for ``model``, or None where ``model`` generates in this process."""
        if self.engine is None or model is not self.policy or adapters_disabled(model):
            return None
        return self.engine


IN_PROCESS = GenerationBackend()  # the hf backend: every model generates in this process


@torch.no_grad()
def generate(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[Sequence[int]],
    gen: GenerationConfig,
    num_samples: int = 1,
    greedy: bool = False,
    seed: int | None = None,
    keep_prefix: list[PromptPrefix] | None = None,
    backend: GenerationBackend = IN_PROCESS,
) -> list[list[int]]:
    """Batched, KV-cached generation; returns ``len(prompts) * num_samples`` completions (sample j of
    prompt i at index ``i * num_samples + j``), each cut after the first EOS (the EOS is kept: its
    probability is part of the summary's likelihood).

    ``keep_prefix``: a list that receives the :class:`PromptPrefix` of this call (sampling with
    ``num_samples > 1`` only): the prompt prefill runs with gradients and is kept for the update.

    ``backend``: where the policy generates (:class:`GenerationBackend`); under ``vllm`` the calls on
    the policy go to its engine instead, while a frozen reference, or the policy with its adapters
    disabled, still generates here.
    """
    engine = backend.engine_serving(model)
    if engine is not None:
        if keep_prefix is not None:
            raise ValueError(
                "keep_prefix needs the training model's own prompt pass; vLLM generates elsewhere"
            )
        return engine.generate(model, tokenizer, prompts, gen, num_samples, greedy, seed)
    ids, mask = left_pad(prompts, tokenizer.pad_token_id)
    if seed is not None:
        torch.manual_seed(seed)
    # Special tokens other than EOS (pad, bos, chat markers) never belong inside a summary.
    suppress = [t for t in tokenizer.all_special_ids if t != tokenizer.eos_token_id]
    kwargs: dict[str, Any] = {
        "max_new_tokens": gen.max_new_tokens,
        "pad_token_id": tokenizer.pad_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "use_cache": True,
        "suppress_tokens": suppress or None,
    }
    if greedy:
        kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
    else:
        kwargs.update(
            do_sample=True,
            temperature=gen.temperature,
            top_p=gen.top_p,
            top_k=gen.top_k or None,
            num_return_sequences=num_samples,
        )
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    with contextlib.ExitStack() as stack:
        if not gen.autocast:  # see GenerationConfig.autocast
            stack.enter_context(torch.autocast(device.type, enabled=False))
            stack.enter_context(_without_prepared_autocast(model))
        new_tokens = _generate(model, ids, mask, kwargs, greedy, num_samples, device, keep_prefix)
    if was_training:
        model.train()
    completions: list[list[int]] = []
    eos = tokenizer.eos_token_id
    for row in new_tokens.tolist():
        cut: list[int] = []
        for t in row:
            cut.append(t)
            if t == eos:
                break
        while cut and cut[-1] == tokenizer.pad_token_id and tokenizer.pad_token_id != eos:
            cut.pop()
        completions.append(cut)
    return completions


@contextlib.contextmanager
def _without_prepared_autocast(model: Any) -> Any:
    """Under mixed precision ``accelerator.prepare`` replaces the model's ``forward`` with one that enters
    autocast itself (keeping the original as ``_original_forward``), so an outer ``autocast(enabled=False)``
    would not reach the forward passes of ``generate``; the original forward is put back meanwhile."""
    original = model.__dict__.get("_original_forward")
    if original is None or "forward" not in model.__dict__:
        yield
        return
    wrapped = model.__dict__["forward"]
    model.forward = original
    try:
        yield
    finally:
        model.forward = wrapped


def _generate(
    model: Any,
    ids: torch.Tensor,
    mask: torch.Tensor,
    kwargs: dict[str, Any],
    greedy: bool,
    num_samples: int,
    device: torch.device,
    keep_prefix: list[PromptPrefix] | None = None,
) -> torch.Tensor:
    """``generate()`` on left-padded prompts; returns the (N * num_samples, T) new tokens."""
    if not greedy and num_samples > 1 and ids.shape[1] > 1:
        # Prefill each prompt once (all but its last token) and repeat its KV cache for its samples, instead
        # of prefilling num_samples copies; generate() then starts from the last prompt token. Same samples.
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        with torch.enable_grad() if keep_prefix is not None else contextlib.nullcontext():
            pre = model(
                input_ids=ids[:, :-1].to(device),
                attention_mask=mask[:, :-1].to(device),
                position_ids=pos[:, :-1].to(device),
                use_cache=True,
                logits_to_keep=1,
            )
        cache = _output_cache(pre)
        if keep_prefix is not None:  # the graph-carrying cache goes to the update, a detached copy decodes
            keep_prefix.append(PromptPrefix(cache, ids, mask))
            cache = _detached_copy(cache)
        cache.batch_repeat_interleave(num_samples)
        kwargs.pop("num_return_sequences")
        kwargs[_cache_kwarg(model)] = cache
        ids, mask = ids.repeat_interleave(num_samples, 0), mask.repeat_interleave(num_samples, 0)
    out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), **kwargs)  # (N*k, P+T)
    return out[:, ids.shape[1] :]


def _detached_copy(cache: Any) -> Any:
    """A copy of a KV cache whose layers hold the same keys/values detached from the graph (decoding
    replaces them as it appends, the kept cache is left as it was)."""
    out = copy.copy(cache)
    out.layers = []
    for layer in cache.layers:
        new = copy.copy(layer)
        new.keys, new.values = layer.keys.detach(), layer.values.detach()
        out.layers.append(new)
    return out


def decode(tokenizer: Any, completions: Sequence[Sequence[int]]) -> list[str]:
    """Completions as text (special tokens dropped, whitespace stripped)."""
    return [tokenizer.decode(c, skip_special_tokens=True).strip() for c in completions]


def token_logprobs(
    model: Any,
    prompts: Sequence[Sequence[int]],
    completions: Sequence[Sequence[int]],
    pad_id: int,
    samples_per_prompt: int = 1,
    prefix: PromptPrefix | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """log pi(y_t | x, y_<t) for every summary token.

    With ``samples_per_prompt = k > 1`` there are ``k * len(prompts)`` completions in blocks
    (completion ``j * len(prompts) + i`` answers prompt ``i``, as the loop's ``a_ids + b_ids``), and
    each prompt is run once: its keys/values are computed for the batch of prompts, repeated k times,
    and the summaries attend to them. Gradients flow through the cached keys/values, so values and
    gradients equal the plain ``k * (P + T)`` pass up to float rounding, at ``P + k * T`` tokens of
    work and activation memory per article. With ``prefix`` (the rollout's own pass over these prompts,
    :class:`PromptPrefix`) the prompts are not run again: only their last token and the summaries are.

    Returns:
        (N, T) token log-probs (0 on padding) and the (N, T) float mask of summary tokens.
    """
    if samples_per_prompt > 1:
        return _shared_prompt_logprobs(model, prompts, completions, pad_id, samples_per_prompt, prefix)
    p_ids, p_mask = left_pad(prompts, pad_id)  # (N, P)
    c_ids, c_mask = right_pad(completions, pad_id)  # (N, T)
    ids = torch.cat([p_ids, c_ids], dim=1)  # (N, P + T)
    attn = torch.cat([p_mask, c_mask], dim=1)
    # Positions count real tokens only, as generate() does with left padding.
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    device = next(model.parameters()).device
    T = c_ids.shape[1]
    out = model(
        input_ids=ids.to(device),
        attention_mask=attn.to(device),
        position_ids=pos.to(device),
        logits_to_keep=T + 1,
        use_cache=False,
    )
    logits = out.logits[:, :-1, :].float()  # (N, T, V): position P-1+t predicts summary token t
    return _picked_logprobs(logits, c_ids.to(device), c_mask.to(device))


def _picked_logprobs(
    logits: torch.Tensor, target: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    picked = torch.gather(logits, -1, target.unsqueeze(-1)).squeeze(-1)  # (N, T)
    logp = picked - torch.logsumexp(logits, dim=-1)  # (N, T), no (N, T, V) log-softmax kept
    m = mask.to(dtype=logp.dtype)
    return logp * m, m


def _cache_kwarg(model: Any) -> str:
    """``cache`` on recent transformers, ``past_key_values`` before it was renamed."""
    import inspect

    base = model.module if hasattr(model, "module") else model  # DDP
    base = base.get_base_model() if hasattr(base, "get_base_model") else base  # peft
    return "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"


def _output_cache(out: Any) -> Any:
    """The KV cache a forward returned (``cache`` on recent transformers, ``past_key_values`` before)."""
    return out["cache"] if "cache" in out else out["past_key_values"]


def _shared_prompt_logprobs(
    model: Any,
    prompts: Sequence[Sequence[int]],
    completions: Sequence[Sequence[int]],
    pad_id: int,
    k: int,
    prefix: PromptPrefix | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    B, N = len(prompts), len(completions)
    if k * B != N:
        raise ValueError(f"{N} completions for {B} prompts and samples_per_prompt={k}; expected {k * B}")
    device = next(model.parameters()).device
    # interleave so that prompt i's k samples are adjacent (the cache is repeated row by row)
    order = torch.tensor([j * B + i for i in range(B) for j in range(k)])
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(N)
    p_ids, p_mask = left_pad(prompts, pad_id)  # (B, P)
    if prefix is not None:
        if not (torch.equal(prefix.ids, p_ids) and torch.equal(prefix.mask, p_mask)):
            raise ValueError("the kept prompt pass is of other prompts than the update's")
        return _logprobs_on_prefix(
            model, prefix.take(k), p_ids, p_mask, completions, order, inverse, pad_id, k
        )
    p_pos = (p_mask.cumsum(-1) - 1).clamp(min=0)
    first = model(
        input_ids=p_ids.to(device),
        attention_mask=p_mask.to(device),
        position_ids=p_pos.to(device),
        use_cache=True,
        logits_to_keep=1,
    )
    cache = _output_cache(first)
    cache.batch_repeat_interleave(k)  # (B, ...) -> (k * B, ...), differentiable
    c_ids, c_mask = right_pad([completions[int(o)] for o in order], pad_id)  # (N, T), interleaved
    T = c_ids.shape[1]
    attn = torch.cat([p_mask.repeat_interleave(k, 0), c_mask], dim=1)  # (N, P + T)
    c_pos = p_mask.sum(-1).repeat_interleave(k)[:, None] + torch.arange(T)[None, :]
    rest = _forward_on_cache(model, c_ids, attn, c_pos, cache)
    # the prompt's last position predicts summary token 0; summary position t predicts token t + 1
    logits = torch.cat(
        [first.logits[:, -1:, :].float().repeat_interleave(k, 0), rest.logits[:, :-1, :].float()], dim=1
    )  # (N, T, V)
    logp, m = _picked_logprobs(logits, c_ids.to(device), c_mask.to(device))
    inverse = inverse.to(device)
    return logp[inverse], m[inverse]


def _logprobs_on_prefix(
    model: Any,
    cache: Any,
    p_ids: torch.Tensor,
    p_mask: torch.Tensor,
    completions: Sequence[Sequence[int]],
    order: torch.Tensor,
    inverse: torch.Tensor,
    pad_id: int,
    k: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summary log-probs from the kept cache of prompt[:-1] (rows repeated k times): one pass over each
    sample's last prompt token and its summary but the last token (whose logit predicts nothing)."""
    device = next(model.parameters()).device
    c_ids, c_mask = right_pad([completions[int(o)] for o in order], pad_id)  # (N, T), interleaved
    T = c_ids.shape[1]
    last = p_ids[:, -1:].repeat_interleave(k, 0)  # (N, 1): always a real token (left padding)
    inp = torch.cat([last, c_ids[:, :-1]], dim=1)  # (N, T): position t predicts summary token t
    attn = torch.cat([p_mask.repeat_interleave(k, 0), c_mask[:, :-1]], dim=1)  # (N, P + T - 1)
    pos = (p_mask.sum(-1) - 1).repeat_interleave(k)[:, None] + torch.arange(T)[None, :]
    out = _forward_on_cache(model, inp, attn, pos, cache)
    logp, m = _picked_logprobs(out.logits.float(), c_ids.to(device), c_mask.to(device))
    inverse = inverse.to(device)
    return logp[inverse], m[inverse]


def _forward_on_cache(
    model: Any, ids: torch.Tensor, attn: torch.Tensor, pos: torch.Tensor, cache: Any
) -> Any:
    """The model over ``ids`` (N, T) attending to ``cache`` and to themselves; logits of all T positions."""
    device = next(model.parameters()).device
    return model(
        input_ids=ids.to(device),
        attention_mask=attn.to(device),
        position_ids=pos.to(device),
        use_cache=True,
        logits_to_keep=ids.shape[1],
        **{_cache_kwarg(model): cache},
    )
