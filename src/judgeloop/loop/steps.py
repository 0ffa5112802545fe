"""The loop's steps, in order: the module to read first.

One training step is these named functions over one :class:`PairBatch`, in this order; the numbers are
the loop's step numbers everywhere (the code and the docs name the steps, they do not renumber them):

    1. rollout_step       the policy samples two summaries per training article (and, with
                          optim.share_prompt_pass, keeps its pass over the prompts, with gradients, for 5)
    2. judge_step         the judge (or a panel of judges) gives a raw preference logit per pair
    3. calibrate_step     the arm's calibrator maps it to p = P(a better than b)
    4. make_pairs         p becomes each pair's soft DPO target (and the mask / weights of pairs that count)
    5. policy_update      soft-target DPO on the targets, plus kl_coef * KL(pi || pi_ref); the run's
                          record_update (:mod:`judgeloop.loop.run`) logs it and adapts
                          the KL coefficient
    6. maybe_recalibrate  monitor ECE and refit the calibrator (and a panel's members) on fresh
                          calibration-split samples, when due (in :mod:`judgeloop.loop.recalibration`)
    7. watch_divergence   when due, the judge's agreement with objective signals; alarms act on it
                          (in :mod:`judgeloop.loop.alarms`)

Under ``loss.type: grpo`` (:mod:`judgeloop.loop.grpo`) step 1 samples a group of k per article, steps
2-3 are one call, :func:`judge_groups_step` (the comparisons inside each group judged and calibrated,
aggregated into one reward per sample), step 4 is :func:`make_advantages` (group-relative advantages)
and step 5's :func:`policy_update` runs :func:`grpo_update`; 6 and 7 are the same.

``recipes/feedback_loop.py`` calls them in this order, between the set-up (:mod:`judgeloop.loop.setup`:
the run, step 0, a resume) and the evaluation, checkpoint and report around each step
(:mod:`judgeloop.loop.run`, over :mod:`judgeloop.loop.evaluation`); ``judgeloop train`` runs that recipe.
The steps take the run's parts (the model, the judge, the calibrator, a :class:`Learner`), not the run.
Under ``accelerate launch`` each process runs every step on its share of the batch.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from accelerate import Accelerator

from judgeloop.calibration import Calibrator
from judgeloop.data import SummExample
from judgeloop.distributed import (
    generation_context,
)
from judgeloop.hashing import derive_seed
from judgeloop.judges import Judge, references_for
from judgeloop.logging import get_logger
from judgeloop.loop.config import FeedbackLoopConfig, LossConfig
from judgeloop.loop.grpo import grpo_chunk_terms, judge_groups, num_completion_tokens, reward_matrix
from judgeloop.loop.losses import (
    dpo_margin,
    group_advantages,
    kl_per_sequence,
    soft_dpo_loss,
    targets_from_probs,
)
from judgeloop.loop.pairs import calibrate
from judgeloop.loop.policy import reference_logprobs
from judgeloop.loop.rollout import (
    PromptBuilder,
    Rollout,
    rollout,
    token_logprobs,
)

logger = get_logger(__name__)


@dataclass
class PairBatch:
    """One training step's pairs, filled in as they flow through the loop:
    ``rollout -> judge -> calibrate -> make_pairs -> update``."""

    step: int
    examples: list[SummExample]  # this process's training articles
    rollout: Rollout | None = None  # prompts, the two (grpo: k) samples' token ids and texts
    judged: Any = None  # the judge's output: raw logit and status per pair (grpo: the GroupScores)
    p: np.ndarray | None = None  # calibrated P(a better than b) per pair
    targets: torch.Tensor | None = None  # soft DPO targets (B,)
    mask: torch.Tensor | None = None  # pairs that enter the loss (B,); grpo: samples with a reward (B, k)
    weights: torch.Tensor | None = None  # per-pair weight of the DPO term (B,); None: all 1
    rewards: torch.Tensor | None = None  # grpo: each sample's groupwise reward (B, k)
    advantages: torch.Tensor | None = None  # grpo: group-relative advantages (B, k)
    stats: dict[str, float] = field(default_factory=dict)  # what the update measured


@dataclass
class Learner:
    """What policy_update updates and how: the prepared policy, the frozen reference, optimizer, schedule, loss."""

    accelerator: Accelerator
    model: Any
    ref: Any | None
    optimizer: Any
    scheduler: Any
    loss: LossConfig
    max_grad_norm: float
    pad_id: int
    chunk_size: int | None = None  # articles per forward/backward pass (None: the whole batch at once)
    share_prompt_pass: bool = False  # the update reuses the rollout's prompt pass (optim.share_prompt_pass)

    def reuses_prompt_pass(self, num_articles: int) -> bool:
        """Whether this step's rollout keeps its prompt pass for the update: one chunk covers the batch."""
        return self.share_prompt_pass and (self.chunk_size is None or self.chunk_size >= num_articles)


def rollout_step(model: Any, tokenizer: Any, build_prompt: PromptBuilder, batch: PairBatch, cfg: FeedbackLoopConfig,
                 process_index: int, keep_prefix: bool = False) -> Rollout:  # fmt: skip
    """The policy samples two summaries per article, or ``generation.num_samples_per_article``
    under grpo (``keep_prefix``: and keeps its prompt pass, with gradients, for the update)."""
    batch.rollout = rollout(
        model,
        tokenizer,
        build_prompt,
        [e.article for e in batch.examples],
        cfg.generation,
        seed=derive_seed(cfg.seed, "rollout", batch.step, process_index),
        keep_prefix=keep_prefix,
        num_samples=cfg.generation.num_samples_per_article if cfg.loss.type == "grpo" else 2,
    )
    return batch.rollout


def judge_step(judge: Judge, batch: PairBatch) -> Any:
    """Raw preference logits for each (a, b) pair (both orders when the judge debiases position)."""
    roll = batch.rollout
    assert roll is not None, "judge_step needs the rollout"
    batch.judged = judge(roll.articles, roll.a_text, roll.b_text, references_for(judge, batch.examples))
    return batch.judged


def calibrate_step(calibrator: Calibrator, batch: PairBatch) -> np.ndarray:
    """The arm's calibrator maps each raw logit to p = P(a better than b)."""
    roll = batch.rollout
    assert roll is not None and batch.judged is not None, "calibrate_step needs the judged rollout"
    batch.p = calibrate(calibrator, batch.judged.scores, roll.articles, roll.a_text, roll.b_text)
    return batch.p


def judge_groups_step(judge: Judge, calibrator: Calibrator, cfg: FeedbackLoopConfig, batch: PairBatch) -> Any:
    """judge_step and calibrate_step under grpo, in one batched judge call: the judge compares the samples
    inside each article's group (``rewards.scheme``), the arm's calibrator maps each comparison to p,
    and the p of each sample's comparisons become its reward (``loss.reward_aggregate``)."""
    roll = batch.rollout
    assert roll is not None, "judge_groups_step needs the rollout"
    batch.judged = judge_groups(judge, calibrator, cfg.judge, roll, batch.examples, cfg.rewards)
    batch.rewards, valid = reward_matrix(batch.judged)
    batch.mask = valid.float()
    return batch.judged


def make_pairs(batch: PairBatch, loss_cfg: LossConfig, judge_weight: float = 1.0) -> None:
    """p becomes the DPO target of each pair, and the mask of the pairs that enter the loss.

    ``judge_weight`` < 1 (a divergence alarm down-weighted the judge) shrinks p toward 0.5 first. A
    panel's pairs whose members disagree beyond ``loss.max_spread`` are skipped, and with
    ``loss.spread_weighting`` each pair counts ``1 - 2 * spread``.
    """
    assert batch.p is not None and batch.judged is not None, "make_pairs needs calibrated p"
    p = batch.p if judge_weight == 1.0 else 0.5 + judge_weight * (batch.p - 0.5)
    batch.targets, batch.mask = targets_from_probs(
        torch.tensor(p, dtype=torch.float32), loss_cfg.target, loss_cfg.margin
    )
    spread = batch.judged.spread
    if np.isfinite(spread).any():  # a panel
        batch.stats["spread_mean"] = float(np.nanmean(spread))
        batch.mask = (
            batch.mask * torch.as_tensor(np.nan_to_num(spread, nan=0.0) <= loss_cfg.max_spread).float()
        )
        if loss_cfg.spread_weighting:
            batch.weights = torch.as_tensor(1.0 - 2.0 * np.nan_to_num(spread, nan=0.5), dtype=torch.float32)


def make_advantages(batch: PairBatch, loss_cfg: LossConfig, judge_weight: float = 1.0) -> None:
    """make_pairs under grpo: group-relative advantages ``r - mean(group)`` (divided by the group's std under
    ``loss.scale_rewards: group``); samples without a reward, and groups with fewer than two, get 0.

    ``judge_weight`` < 1 (a divergence alarm down-weighted the judge) scales the advantages: the judge's
    weight in the policy gradient against the KL term.
    """
    assert batch.rewards is not None and batch.mask is not None, "make_advantages needs the rewards"
    batch.advantages = judge_weight * group_advantages(
        batch.rewards, batch.mask.bool(), loss_cfg.scale_rewards
    )


def policy_update(learner: Learner, batch: PairBatch, kl_coef: float) -> dict[str, float]:
    """One optimizer step of soft-target DPO + kl_coef * KL(pi || pi_ref) on this process's pairs.

    The DPO term is summed over pairs and divided by the per-process batch size (skipped pairs count
    as zero), and the KL term is a mean over samples, so the DDP gradient average equals the
    full-batch gradient when every process has the same batch size. With ``optim.update_chunk_size``
    the articles go through the forward and backward passes that many at a time, their gradients
    adding up to the same update (up to float summation order) at a fraction of the activation memory.
    """
    if learner.loss.type == "grpo":
        return grpo_update(learner, batch, kl_coef)
    roll, targets, mask = batch.rollout, batch.targets, batch.mask
    assert roll is not None and targets is not None and mask is not None, "policy_update needs the pairs"
    acc = learner.accelerator
    B = len(roll.prompts)
    chunk = learner.chunk_size or B
    parts = [
        _chunk_loss(learner, roll, targets, mask, lo, min(lo + chunk, B), B, kl_coef, batch.weights)
        for lo in range(0, B, chunk)
    ]
    grad_norm = optimizer_step(learner)
    # each chunk's terms are already weighted by its share of the batch: their sums are the batch's
    totals = [torch.stack([p[i] for p in parts]).sum() if len(parts) > 1 else parts[0][i] for i in range(5)]
    agree_n = mask.sum().clamp(min=1).to(acc.device)
    # the judge's signal: how far the targets of the pairs that count are from a coin flip
    margin = ((targets.to(acc.device) - 0.5).abs() * mask.to(acc.device)).sum() / agree_n
    stats = torch.stack([*totals, mask.float().mean().to(acc.device), margin])
    stats[4] = stats[4] / agree_n
    stats = acc.reduce(stats, reduction="mean")
    names = ["loss", "dpo_loss", "kl", "kl_k1", "margin_agreement", "kept_fraction", "target_margin"]
    batch.stats.update({n: float(v) for n, v in zip(names, stats.tolist())})
    batch.stats["grad_norm"] = grad_norm
    return batch.stats


def optimizer_step(learner: Learner) -> float:
    """Clip the gradients (when ``max_grad_norm`` > 0), step the optimizer and the schedule; the norm."""
    acc, model = learner.accelerator, learner.model
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


def grpo_update(learner: Learner, batch: PairBatch, kl_coef: float) -> dict[str, float]:
    """policy_update under grpo: one optimizer step of the clipped GRPO surrogate on the advantages
    (:func:`judgeloop.loop.losses.grpo_loss`, token-averaged over the global batch as TRL's default
    ``loss_type="dapo"``) + kl_coef * KL(pi || pi_ref) (a mean over samples), chunked as the DPO update."""
    roll, adv, mask = batch.rollout, batch.advantages, batch.mask
    assert roll is not None and adv is not None and mask is not None, "grpo_update needs the advantages"
    acc = learner.accelerator
    B = len(roll.prompts)
    tokens = torch.tensor(float(num_completion_tokens(roll)), device=acc.device)
    normalizer = (acc.reduce(tokens, reduction="sum") / acc.num_processes).clamp(min=1.0)
    chunk = learner.chunk_size or B
    parts = [
        grpo_chunk_terms(learner, roll, adv, lo, min(lo + chunk, B), B, kl_coef, normalizer)
        for lo in range(0, B, chunk)
    ]
    grad_norm = optimizer_step(learner)
    totals = [torch.stack([p[i] for p in parts]).sum() for i in range(4)]
    rewards = batch.rewards
    assert rewards is not None
    n = mask.sum().clamp(min=1)
    r_mean = (rewards * mask).sum() / n
    extra = [r_mean, mask.mean(), (adv.abs() * mask).sum() / n]
    stats = acc.reduce(torch.stack([*totals, *[x.to(acc.device) for x in extra]]), reduction="mean")
    names = ["loss", "grpo_loss", "kl", "kl_k1", "reward_mean", "kept_fraction", "advantage_abs_mean"]
    batch.stats.update({n: float(v) for n, v in zip(names, stats.tolist())})
    batch.stats["grad_norm"] = grad_norm
    return batch.stats


def _chunk_loss(
    learner: Learner, roll: Rollout, targets: torch.Tensor, mask: torch.Tensor, lo: int, hi: int, B: int,
    kl_coef: float, weights: torch.Tensor | None = None,
) -> list[torch.Tensor]:  # fmt: skip
    """Forward and backward of articles ``lo:hi`` of the batch; returns their (detached) share of the
    loss, DPO term, KL, k1 KL and the number of kept pairs whose margin agrees with the target."""
    acc, model, loss_cfg = learner.accelerator, learner.model, learner.loss
    prompts = roll.prompts[lo:hi]
    comps = roll.a_ids[lo:hi] + roll.b_ids[lo:hi]  # a-samples then b-samples; each prompt run once for both
    n, device = hi - lo, acc.device
    with generation_context(model):
        ref_tok, _ = reference_logprobs(
            acc.unwrap_model(model), learner.ref, prompts, comps, learner.pad_id, 2
        )
    prefix = roll.prefix if n == B else None  # the rollout's prompt pass, when it was kept (one chunk)
    roll.prefix = None
    pol_tok, tok_mask = token_logprobs(model, prompts, comps, learner.pad_id, 2, prefix)  # (2n, T)
    seq_pol, seq_ref = pol_tok.sum(-1), ref_tok.sum(-1)  # (2n,)
    h = dpo_margin(seq_pol[:n], seq_pol[n:], seq_ref[:n], seq_ref[n:])  # (n,)
    t, m = targets[lo:hi].to(device), mask[lo:hi].to(device)
    w = m if weights is None else m * weights[lo:hi].to(device)
    dpo = soft_dpo_loss(h, t, loss_cfg.beta, w).sum() / B
    share = (lambda x: x.mean()) if n == B else (lambda x: x.sum() / (2 * B))  # noqa: E731 - one chunk: as ever
    kl = share(kl_per_sequence(pol_tok, ref_tok, tok_mask, loss_cfg.kl_estimator))
    loss = dpo + kl_coef * kl
    last = hi == B
    with contextlib.nullcontext() if last else acc.no_sync(model):  # DDP: one gradient all-reduce per step
        acc.backward(loss)
    with torch.no_grad():
        k1 = share(kl_per_sequence(pol_tok.detach(), ref_tok, tok_mask, "k1"))
        agree = (((h.detach() > 0).float() == (t >= 0.5).float()).float() * m).sum()
    return [loss.detach(), dpo.detach(), kl.detach(), k1, agree]
