"""Step 5's skeleton, shared by the DPO update (:mod:`judgeloop.loop.dpo`) and the GRPO update
(:mod:`judgeloop.loop.grpo`): the :class:`Learner` and :func:`chunked_update`.

One optimizer step over this process's batch, its articles a chunk at a time (``optim.update_chunk_size``):
per chunk, the reference's token log-probs, the policy's (reusing the rollout's prompt pass when one chunk
covers the batch), the objective's term (the only part that differs), the KL penalty, and the backward
under ``no_sync`` for all but the last chunk (DDP: one gradient all-reduce per step); then the clipped
optimizer step and the stats, averaged over the processes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from judgeloop.distributed import generation_context
from judgeloop.loop.config import LossConfig
from judgeloop.loop.losses import kl_per_sequence
from judgeloop.loop.policy import Policy, reference_logprobs
from judgeloop.loop.rollout import Rollout, token_logprobs

# (policy token log-probs (k n, T) with gradients, the reference's (k n, T), their token mask, lo, hi) ->
# (the objective's term of articles lo:hi, with gradients; its detached extra stats). Row j*n+i is
# sample j of article lo+i (sample-major).
ChunkTerm = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, int, int], tuple[torch.Tensor, list[torch.Tensor]]
]


@dataclass
class Learner:
    """What policy_update updates and how: the policy (its prepared model, its frozen reference, the
    accelerator and the tokenizer, held by the :class:`~judgeloop.loop.policy.Policy` alone, the same
    object the rollout samples from), the optimizer, the schedule and the loss."""

    policy: Policy
    optimizer: Any
    scheduler: Any
    loss: LossConfig
    max_grad_norm: float
    chunk_size: int | None = None  # articles per forward/backward pass (None: the whole batch at once)
    share_prompt_pass: bool = False  # the update reuses the rollout's prompt pass (optim.share_prompt_pass)
    # mode=rounds: one optimizer step per this many of a round's pairs (None: one step on the whole batch)
    minibatch_size: int | None = None
    epochs: int = 1  # mode=rounds: passes over a round's pairs (rounds.dpo_epochs)
    seed: int = 0  # the run's seed: the minibatches' order under mode=rounds

    @property
    def pad_id(self) -> int:
        """The policy tokenizer's pad id, which the update's sequences are padded with."""
        return int(self.policy.tokenizer.pad_token_id)

    def reuses_prompt_pass(self, num_articles: int) -> bool:
        """Whether this step's rollout keeps its prompt pass for the update: one chunk covers the batch."""
        return self.share_prompt_pass and (self.chunk_size is None or self.chunk_size >= num_articles)


def chunked_update(
    learner: Learner,
    roll: Rollout,
    kl_coef: float,
    term: ChunkTerm,
    batch_stats: Callable[[list[torch.Tensor]], torch.Tensor],
    names: Sequence[str],
    sum_one_chunk: bool = True,
) -> dict[str, float]:
    """One optimizer step of ``term + kl_coef * KL(pi || pi_ref)`` on this process's rollout, chunked.

    Args:
        term: the objective's term of a chunk (:data:`ChunkTerm`), already weighted by the chunk's share
            of the batch, so that the chunks' gradients add up to the batch's.
        batch_stats: this process's stats vector from the chunk totals ``[loss, term, kl, k1, *extras]``
            (each summed over the chunks); the vector is then averaged over the processes.
        names: the stats' names, in the order of that vector.
        sum_one_chunk: whether a single chunk's terms also go through the sum over chunks (the GRPO
            update's way; the DPO update takes them as they are). The two differ only in the sign of
            a zero (``-0.0`` sums to ``0.0``); kept so that both updates log what they always logged.

    Returns:
        The stats by name, averaged over the processes, and ``grad_norm``.
    """
    B = len(roll.prompts)
    chunk = learner.chunk_size or B
    parts = [
        _chunk_terms(learner, roll, kl_coef, term, lo, min(lo + chunk, B), B) for lo in range(0, B, chunk)
    ]
    grad_norm = optimizer_step(learner)
    # each chunk's terms are already weighted by its share of the batch: their sums are the batch's
    one = len(parts) == 1 and not sum_one_chunk
    totals = [parts[0][i] if one else torch.stack([p[i] for p in parts]).sum() for i in range(len(parts[0]))]
    stats = learner.policy.accelerator.reduce(batch_stats(totals), reduction="mean")
    out = {n: float(v) for n, v in zip(names, stats.tolist())}
    out["grad_norm"] = grad_norm
    return out


def optimizer_step(learner: Learner) -> float:
    """Clip the gradients (when ``max_grad_norm`` > 0), step the optimizer and the schedule; the norm."""
    acc, model = learner.policy.accelerator, learner.policy.model
    grad_norm = float("nan")
    if learner.max_grad_norm > 0:
        # every parameter, not only the trainable ones: frozen ones have no gradient and add nothing, and
        # accelerate's FSDP clipping (the global norm over all shards) applies only to model.parameters()
        norm = acc.clip_grad_norm_(list(model.parameters()), learner.max_grad_norm)
        grad_norm = float("nan") if norm is None else float(norm)  # DeepSpeed clips inside its step
    learner.optimizer.step()
    learner.scheduler.step()
    learner.optimizer.zero_grad(set_to_none=True)
    return grad_norm


def _chunk_terms(
    learner: Learner, roll: Rollout, kl_coef: float, term: ChunkTerm, lo: int, hi: int, B: int
) -> list[torch.Tensor]:
    """Forward and backward of articles ``lo:hi`` of the batch (all k samples of each); returns their
    (detached) share of the loss, the objective's term, the KL, the k1 KL and the term's extra stats."""
    policy, loss_cfg = learner.policy, learner.loss
    acc, model = policy.accelerator, policy.model
    k, n = roll.num_samples, hi - lo
    prompts = roll.prompts[lo:hi]
    # sample-major: sample j of article i at j*n+i; each prompt run once for its k samples
    comps = [c for ids in roll.sample_ids() for c in ids[lo:hi]]
    with generation_context(model):
        ref_tok, _ = reference_logprobs(policy.unwrapped, policy.ref, prompts, comps, learner.pad_id, k)
    prefix = roll.prefix if n == B else None  # the rollout's prompt pass, when it was kept (one chunk)
    roll.prefix = None
    pol_tok, tok_mask = token_logprobs(model, prompts, comps, learner.pad_id, k, prefix)  # (k n, T)
    objective, extras = term(pol_tok, ref_tok, tok_mask, lo, hi)
    # the KL term is a mean over the batch's samples: one chunk takes the mean as ever, chunks their share
    share = (lambda x: x.mean()) if n == B else (lambda x: x.sum() / (k * B))  # noqa: E731
    kl = share(kl_per_sequence(pol_tok, ref_tok, tok_mask, loss_cfg.kl_estimator))
    loss = objective + kl_coef * kl
    with contextlib.nullcontext() if hi == B else acc.no_sync(model):  # DDP: one gradient all-reduce per step
        acc.backward(loss)
    with torch.no_grad():
        k1 = share(kl_per_sequence(pol_tok.detach(), ref_tok, tok_mask, "k1"))
    return [loss.detach(), objective.detach(), kl.detach(), k1, *extras]
