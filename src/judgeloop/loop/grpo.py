"""The loop's group-relative objective (``loss.type: grpo``): groupwise rewards from the arm's calibrated
judge, and the GRPO term of one update chunk.

Under grpo the step is still ``rollout -> judge -> calibrate -> rewards -> update``
(the steps of :mod:`judgeloop.loop.steps`): the rollout samples a group of k summaries per article;
the judge compares them inside each group and the arm's calibrator maps every comparison to p, both in
one batched call (:func:`judge_groups`: the run's training judge and current calibrator wrapped in a
:class:`~judgeloop.judges.calibrated.CalibratedJudge`, so every arm's calibrator applies as in DPO);
:func:`judgeloop.rewards.score_groups` aggregates the p into one reward per sample; the advantages are
group-relative (:func:`judgeloop.loop.losses.group_advantages`); the update is TRL's clipped surrogate
(:func:`judgeloop.loop.losses.grpo_loss`) plus the loop's KL penalty. One optimizer step per rollout:
the policy that sampled is the one updated (ratio 1), and the clipped form keeps the loss TRL's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from judgeloop.calibration import Calibrator
from judgeloop.data import SummExample
from judgeloop.distributed import generation_context
from judgeloop.judges import Judge, JudgeConfig, references_for
from judgeloop.loop.losses import grpo_loss, kl_per_sequence
from judgeloop.loop.policy import reference_logprobs
from judgeloop.loop.rollout import Rollout, token_logprobs
from judgeloop.rewards import Group, GroupScores, RewardConfig, score_groups


def groups_of(roll: Rollout, examples: Sequence[SummExample], judge: Judge) -> list[Group]:
    """One :class:`~judgeloop.rewards.Group` per article: its k samples, the references the judge reads,
    and (for ``rewards.scheme: anchor``) the article's first neutral reference as the anchor."""
    refs = references_for(judge, examples)
    return [
        Group(article, texts, e.neutral[0] if e.neutral else None, r)
        for article, texts, e, r in zip(roll.articles, roll.group_texts(), examples, refs)
    ]


def judge_groups(
    judge: Judge,
    calibrator: Calibrator,
    judge_cfg: JudgeConfig,
    roll: Rollout,
    examples: Sequence[SummExample],
    rewards: RewardConfig,
) -> GroupScores:
    """The work of the judge_groups_step (:mod:`judgeloop.loop.steps`): every comparison of every group
    judged in one call and calibrated by the arm's current ``calibrator``; one reward per sample (``None`` where no comparison was valid)."""
    from judgeloop.judges.calibrated import CalibratedJudge

    calibrated = CalibratedJudge(judge_cfg, calibrator, judge=judge)
    return score_groups(calibrated, groups_of(roll, examples, judge), rewards)


def reward_matrix(scores: GroupScores) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, k) rewards (0 where missing) and the (B, k) bool mask of samples that have one."""
    raw = np.array([[np.nan if r is None else r for r in g] for g in scores.rewards], dtype=float)
    valid = np.isfinite(raw)
    return torch.tensor(np.where(valid, raw, 0.0), dtype=torch.float32), torch.as_tensor(valid)


def num_completion_tokens(roll: Rollout) -> int:
    """The completion tokens of this process's batch (every sample, EOS included): what TRL's token
    averaging counts."""
    return sum(len(c) for ids in roll.sample_ids() for c in ids)


def grpo_chunk_terms(
    learner: Any, roll: Rollout, advantages: torch.Tensor, lo: int, hi: int, B: int, kl_coef: float,
    normalizer: torch.Tensor,
) -> list[torch.Tensor]:  # fmt: skip
    """Forward and backward of articles ``lo:hi`` (all k samples of each); returns their (detached)
    share of the loss, GRPO term, KL and k1 KL.

    ``advantages``: (B, k). ``normalizer``: the batch's completion tokens as TRL's default loss divides
    by them (the global count over the processes / their number, so that DDP's gradient average is the
    global token mean). The KL term is a mean over the batch's samples, as in the DPO path.
    """
    acc, model, loss_cfg = learner.accelerator, learner.model, learner.loss
    k, n, device = roll.num_samples, hi - lo, acc.device
    prompts = roll.prompts[lo:hi]
    comps = [
        c for ids in roll.sample_ids() for c in ids[lo:hi]
    ]  # sample-major: sample j of article i at j*n+i
    with generation_context(model):
        ref_tok, _ = reference_logprobs(
            acc.unwrap_model(model), learner.ref, prompts, comps, learner.pad_id, k
        )
    prefix = roll.prefix if n == B else None  # the rollout's prompt pass, when it was kept (one chunk)
    roll.prefix = None
    pol_tok, tok_mask = token_logprobs(model, prompts, comps, learner.pad_id, k, prefix)  # (k n, T)
    adv = advantages[lo:hi].to(device).T.reshape(-1)  # (k n,), the order of comps
    pg = grpo_loss(pol_tok, pol_tok.detach(), adv, tok_mask, loss_cfg.epsilon, normalizer.to(device))
    share = (lambda x: x.mean()) if n == B else (lambda x: x.sum() / (k * B))  # noqa: E731
    kl = share(kl_per_sequence(pol_tok, ref_tok, tok_mask, loss_cfg.kl_estimator))
    loss = pg + kl_coef * kl
    with contextlib.nullcontext() if hi == B else acc.no_sync(model):  # DDP: one gradient all-reduce per step
        acc.backward(loss)
    with torch.no_grad():
        k1 = share(kl_per_sequence(pol_tok.detach(), ref_tok, tok_mask, "k1"))
    return [loss.detach(), pg.detach(), kl.detach(), k1]
