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
and step 5's :func:`policy_update` runs :func:`judgeloop.loop.grpo.grpo_update` instead of
:func:`judgeloop.loop.dpo.dpo_update` (both over one chunked update, :mod:`judgeloop.loop.update`); 6 and 7
are the same.

Under ``mode: rounds`` (iterated batch DPO, :class:`~judgeloop.loop.config.RoundsConfig`) a step is a round:
step 1 samples a round's ``rounds.prompts_per_round`` articles with the policy as the round found it,
2-4 are as above, step 5's :func:`policy_update` runs :func:`judgeloop.loop.dpo.batch_dpo_update`
(``rounds.dpo_epochs`` passes over the round's pairs, one optimizer step per ``batch_size`` of them), and
step 6 refits the calibrator on fresh calibration-split samples of the new policy, for the next round.

``recipes/feedback_loop.py`` calls them in this order, between the set-up (:mod:`judgeloop.loop.setup`:
the run, step 0, a resume) and the evaluation, checkpoint and report around each step
(:mod:`judgeloop.loop.run`, over :mod:`judgeloop.loop.evaluation`); ``judgeloop train`` runs that recipe.
The steps take the run's parts (the :class:`~judgeloop.loop.policy.Policy`, the judge, the calibrator,
a :class:`Learner`), not the run.
Under ``accelerate launch`` each process runs every step on its share of the batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from judgeloop.calibration import Calibrator
from judgeloop.data import SummExample
from judgeloop.hashing import derive_seed
from judgeloop.judges import Judge, references_for
from judgeloop.logging import get_logger
from judgeloop.loop.config import FeedbackLoopConfig, LossConfig
from judgeloop.loop.dpo import batch_dpo_update, dpo_update
from judgeloop.loop.grpo import grpo_update, judge_groups, reward_matrix
from judgeloop.loop.losses import confidence_weights, group_advantages, sharpen, targets_from_probs
from judgeloop.loop.pairs import calibrate
from judgeloop.loop.policy import Policy
from judgeloop.loop.rollout import Rollout
from judgeloop.loop.update import Learner

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


def rollout_step(
    policy: Policy, batch: PairBatch, cfg: FeedbackLoopConfig, keep_prefix: bool = False
) -> Rollout:
    """The policy samples two summaries per article, or ``generation.num_samples_per_article``
    under grpo, where its backend says (the run's: ``hf`` in this process, or its vLLM engine);
    ``keep_prefix``: and keeps its prompt pass, with gradients, for the update."""
    batch.rollout = policy.sample(
        [e.article for e in batch.examples],
        cfg.generation,
        seed=derive_seed(cfg.seed, "rollout", batch.step, policy.accelerator.process_index),
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
    and the p of each sample's comparisons become its reward (``rewards.aggregate``)."""
    roll = batch.rollout
    assert roll is not None, "judge_groups_step needs the rollout"
    batch.judged = judge_groups(judge, calibrator, cfg.judge, roll, batch.examples, cfg.rewards)
    batch.rewards, valid = reward_matrix(batch.judged)
    batch.mask = valid.float()
    return batch.judged


def make_pairs(batch: PairBatch, loss_cfg: LossConfig, judge_weight: float = 1.0) -> None:
    """p becomes the DPO target of each pair, and the mask of the pairs that enter the loss.

    ``judge_weight`` < 1 (a divergence alarm down-weighted the judge) shrinks p toward 0.5 first; then
    ``loss.target_temperature`` sharpens or softens it (:func:`sharpen`). With ``loss.pair_weighting:
    confidence`` each pair's DPO term counts ``|2p - 1|``. A panel's pairs whose members disagree beyond
    ``loss.max_spread`` are skipped, and with ``loss.spread_weighting`` each pair counts
    ``1 - 2 * spread`` (times its confidence when both are on).
    """
    assert batch.p is not None and batch.judged is not None, "make_pairs needs calibrated p"
    p = batch.p if judge_weight == 1.0 else 0.5 + judge_weight * (batch.p - 0.5)
    batch.targets, batch.mask = targets_from_probs(
        torch.tensor(sharpen(p, loss_cfg.target_temperature), dtype=torch.float32),
        loss_cfg.target,
        loss_cfg.margin,
    )
    weights = []
    if loss_cfg.pair_weighting == "confidence":  # the calibrated confidence, before any sharpening
        weights.append(confidence_weights(p))
    spread = batch.judged.spread
    if np.isfinite(spread).any():  # a panel
        batch.stats["spread_mean"] = float(np.nanmean(spread))
        batch.mask = (
            batch.mask * torch.as_tensor(np.nan_to_num(spread, nan=0.0) <= loss_cfg.max_spread).float()
        )
        if loss_cfg.spread_weighting:
            weights.append(1.0 - 2.0 * np.nan_to_num(spread, nan=0.5))
    if weights:
        batch.weights = torch.as_tensor(np.prod(weights, axis=0), dtype=torch.float32)


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
    """One optimizer step on this process's batch: soft-target DPO on the pairs' targets
    (:func:`judgeloop.loop.dpo.dpo_update`), or under grpo the clipped GRPO surrogate on the advantages
    (:func:`judgeloop.loop.grpo.grpo_update`), each + kl_coef * KL(pi || pi_ref), both over one chunked
    update (:func:`judgeloop.loop.update.chunked_update`); under ``mode: rounds`` the round's optimizer
    steps, ``dpo_update`` on minibatches of its pairs (:func:`judgeloop.loop.dpo.batch_dpo_update`). The
    stats go into ``batch.stats``.
    """
    roll, mask = batch.rollout, batch.mask
    if learner.loss.type == "grpo":
        adv, rewards = batch.advantages, batch.rewards
        assert roll is not None and adv is not None and rewards is not None and mask is not None, (
            "policy_update under grpo needs the advantages"
        )
        stats = grpo_update(learner, roll, adv, rewards, mask, kl_coef)
    else:
        targets = batch.targets
        assert roll is not None and targets is not None and mask is not None, "policy_update needs the pairs"
        if learner.minibatch_size is not None:  # mode=rounds: passes over the round's pairs in minibatches
            stats = batch_dpo_update(learner, roll, targets, mask, batch.weights, kl_coef, batch.step)
        else:
            stats = dpo_update(learner, roll, targets, mask, batch.weights, kl_coef)
    batch.stats.update(stats)
    return batch.stats
