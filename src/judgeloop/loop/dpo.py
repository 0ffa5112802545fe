"""The loop's pairwise objective (``loss.type: dpo``, the default): step 5's soft-target DPO update.

The pairs come from the steps of :mod:`judgeloop.loop.steps` (two samples per article, judged, calibrated,
made into soft targets by ``make_pairs``); :func:`dpo_update` is the DPO term of the shared chunked update
(:func:`judgeloop.loop.update.chunked_update`, which adds the KL penalty and steps the optimizer), as
:func:`judgeloop.loop.grpo.grpo_update` is the GRPO one. Under ``mode: rounds`` step 5 is
:func:`batch_dpo_update`: :func:`dpo_update` on minibatches of a round's pairs, for several passes.
"""

from __future__ import annotations

import numpy as np
import torch

from judgeloop.hashing import derive_seed
from judgeloop.loop.losses import dpo_margin, soft_dpo_loss
from judgeloop.loop.rollout import Rollout
from judgeloop.loop.update import Learner, chunked_update

STATS = ("loss", "dpo_loss", "kl", "kl_k1", "margin_agreement", "kept_fraction", "target_margin")


# A margin within this fraction of the summed |sequence log-probabilities| it is made of is float rounding:
# summed over a sequence's tokens, one float32 log-prob sum carries errors near 1e-7 of its size.
TIE_TOLERANCE = 1e-5


def margin_agreement(h: torch.Tensor, targets: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Per pair: 1 where the margin's sign agrees with the target's side (p >= 0.5: a), 0 where it does not,
    and 1/2 where the margin is a tie, ``|h| <= TIE_TOLERANCE * scale`` (``scale``: the summed |sequence
    log-probabilities| of the margin's four terms). A tie's sign is rounding noise that differs between
    kernels, CPUs and launches (at step 1 the policy is its reference and every margin is one), so a tie
    counts one half, as a tie does in an AUC, on every machine.
    """
    tie = h.abs() <= TIE_TOLERANCE * scale
    agree = ((h > 0) == (targets >= 0.5)).float()
    return torch.where(tie, torch.full_like(agree, 0.5), agree)


def dpo_update(
    learner: Learner,
    roll: Rollout,
    targets: torch.Tensor,
    mask: torch.Tensor,
    weights: torch.Tensor | None,
    kl_coef: float,
) -> dict[str, float]:
    """One optimizer step of soft-target DPO + kl_coef * KL(pi || pi_ref) on this process's pairs.

    The DPO term is summed over pairs and divided by the per-process batch size (skipped pairs count
    as zero), and the KL term is a mean over samples, so the DDP gradient average equals the
    full-batch gradient when every process has the same batch size. With ``optim.update_chunk_size``
    the articles go through the forward and backward passes that many at a time, their gradients
    adding up to the same update (up to float summation order) at a fraction of the activation memory.

    Args:
        roll: the rollout's two samples per article (a, b).
        targets: (B,) soft targets P(a better than b); mask: (B,) the pairs that enter the loss;
            weights: (B,) per-pair weights of the DPO term (None: all 1).

    Returns:
        The stats of :data:`STATS`, averaged over the processes, and ``grad_norm``.
    """
    assert roll.num_samples == 2, "the DPO update takes two samples per article"
    device, beta, B = learner.policy.accelerator.device, learner.loss.beta, len(roll.prompts)

    def term(
        pol_tok: torch.Tensor, ref_tok: torch.Tensor, tok_mask: torch.Tensor, lo: int, hi: int
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        n = hi - lo
        seq_pol, seq_ref = pol_tok.sum(-1), ref_tok.sum(-1)  # (2n,): a-samples then b-samples
        h = dpo_margin(seq_pol[:n], seq_pol[n:], seq_ref[:n], seq_ref[n:])  # (n,)
        t, m = targets[lo:hi].to(device), mask[lo:hi].to(device)
        w = m if weights is None else m * weights[lo:hi].to(device)
        dpo = soft_dpo_loss(h, t, beta, w).sum() / B
        with torch.no_grad():
            scale = torch.stack([seq_pol[:n], seq_pol[n:], seq_ref[:n], seq_ref[n:]]).detach().abs().sum(0)
            agree = (margin_agreement(h.detach(), t, scale) * m).sum()
        return dpo, [agree]

    def batch_stats(totals: list[torch.Tensor]) -> torch.Tensor:
        agree_n = mask.sum().clamp(min=1).to(device)
        # the judge's signal: how far the targets of the pairs that count are from a coin flip
        margin = ((targets.to(device) - 0.5).abs() * mask.to(device)).sum() / agree_n
        stats = torch.stack([*totals, mask.float().mean().to(device), margin])
        stats[4] = stats[4] / agree_n
        return stats

    return chunked_update(learner, roll, kl_coef, term, batch_stats, STATS, sum_one_chunk=False)


def batch_dpo_update(
    learner: Learner,
    roll: Rollout,
    targets: torch.Tensor,
    mask: torch.Tensor,
    weights: torch.Tensor | None,
    kl_coef: float,
    round_: int,
) -> dict[str, float]:
    """Step 5 of a round (``mode: rounds``, iterated batch DPO): ``learner.epochs`` passes over the round's
    pairs, each in its own seeded order, one :func:`dpo_update` (one optimizer step) per
    ``learner.minibatch_size`` pairs. DPO's reference and the KL term's stay the run's pi_ref (the
    starting policy) in every round; the pairs were sampled by the round's starting policy.

    Args:
        roll, targets, mask, weights: the round's pairs as step 4 left them ((B,) each).
        round_: the round's number (with ``learner.seed``, it seeds the minibatches' order).

    Returns:
        The mean of each :data:`STATS` entry and ``grad_norm`` over the round's optimizer steps, and
        ``optimizer_steps``.
    """
    assert learner.minibatch_size is not None, "batch_dpo_update needs the learner's minibatch size"
    n, size = len(roll.prompts), learner.minibatch_size
    steps: list[dict[str, float]] = []
    for epoch in range(learner.epochs):
        order = np.random.RandomState(derive_seed(learner.seed, "round_order", round_, epoch)).permutation(n)
        for lo in range(0, n, size):
            idx = order[lo : lo + size].tolist()
            w = None if weights is None else weights[idx]
            steps.append(dpo_update(learner, roll.select(idx), targets[idx], mask[idx], w, kl_coef))
    out = {}
    for key in steps[0]:
        values = np.array([s[key] for s in steps], dtype=float)
        out[key] = float(values[np.isfinite(values)].mean()) if np.isfinite(values).any() else float("nan")
    out["optimizer_steps"] = float(len(steps))
    return out
