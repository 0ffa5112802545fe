"""The loop's group-relative objective (``loss.type: grpo``): groupwise rewards from the arm's calibrated
judge, and step 5's GRPO update (the GRPO term of the shared chunked update,
:func:`judgeloop.loop.update.chunked_update`, as :func:`judgeloop.loop.dpo.dpo_update` is the DPO one).

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

from collections.abc import Sequence

import numpy as np
import torch

from judgeloop.calibration import Calibrator
from judgeloop.data import SummExample
from judgeloop.judges import Judge, JudgeConfig, references_for
from judgeloop.loop.losses import grpo_loss
from judgeloop.loop.rollout import Rollout
from judgeloop.loop.update import Learner, chunked_update
from judgeloop.rewards import Group, GroupScores, RewardConfig, score_groups

STATS = ("loss", "grpo_loss", "kl", "kl_k1", "reward_mean", "kept_fraction", "advantage_abs_mean")


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


def grpo_update(
    learner: Learner,
    roll: Rollout,
    advantages: torch.Tensor,
    rewards: torch.Tensor,
    mask: torch.Tensor,
    kl_coef: float,
) -> dict[str, float]:
    """policy_update under grpo: one optimizer step of the clipped GRPO surrogate on the advantages
    (:func:`judgeloop.loop.losses.grpo_loss`, token-averaged over the global batch as TRL's default
    ``loss_type="dapo"``) + kl_coef * KL(pi || pi_ref) (a mean over samples), chunked as the DPO update
    (:func:`judgeloop.loop.update.chunked_update`).

    Args:
        roll: the rollout's group of k samples per article.
        advantages: (B, k) group-relative advantages; rewards: (B, k) each sample's reward (0 where
            missing); mask: (B, k) the samples that have one.

    Returns:
        The stats of :data:`STATS`, averaged over the processes, and ``grad_norm``.
    """
    acc, epsilon = learner.policy.accelerator, learner.loss.epsilon
    # the batch's completion tokens as TRL's default loss divides by them: the global count over the
    # processes / their number, so that DDP's gradient average is the global token mean
    tokens = torch.tensor(float(num_completion_tokens(roll)), device=acc.device)
    normalizer = (acc.reduce(tokens, reduction="sum") / acc.num_processes).clamp(min=1.0)

    def term(
        pol_tok: torch.Tensor, ref_tok: torch.Tensor, tok_mask: torch.Tensor, lo: int, hi: int
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        adv = advantages[lo:hi].to(acc.device).T.reshape(-1)  # (k n,), the order of the samples
        return grpo_loss(pol_tok, pol_tok.detach(), adv, tok_mask, epsilon, normalizer.to(acc.device)), []

    def batch_stats(totals: list[torch.Tensor]) -> torch.Tensor:
        n = mask.sum().clamp(min=1)
        r_mean = (rewards * mask).sum() / n
        extra = [r_mean, mask.mean(), (advantages.abs() * mask).sum() / n]
        return torch.stack([*totals, *[x.to(acc.device) for x in extra]])

    return chunked_update(learner, roll, kl_coef, term, batch_stats, STATS)
