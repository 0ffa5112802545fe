"""Losses of the feedback loop: DPO with soft (calibrated) targets, GRPO on group-relative advantages,
and the KL penalty estimators.

Soft-target DPO (Rafailov et al. 2023, eq. 7, with the hard label replaced by a probability p):

    h    = (log pi(a) - log pi_ref(a)) - (log pi(b) - log pi_ref(b))      # summary tokens only
    loss = -[p * log sigmoid(beta * h) + (1 - p) * log sigmoid(-beta * h)]

At p = 1 this is TRL's ``loss_type="sigmoid"`` DPO loss (label smoothing 0); at p = 0 it is the same
loss with a and b swapped. Per-pair losses are averaged over the *whole* per-process batch (skipped
pairs count as zero), so that under DDP the gradient all-reduce gives exactly the full-batch mean.

Group-relative policy gradient (GRPO; Shao et al. 2024, "DeepSeekMath", sec. 4.1; the loss of TRL's
``GRPOTrainer._compute_loss``): k samples per prompt with rewards r, advantages

    A_i  = r_i - mean(r)                                  scale_rewards="none" (Dr. GRPO, Liu et al. 2025)
    A_i  = (r_i - mean(r)) / (std(r) + 1e-4)              scale_rewards="group" (std with Bessel's correction)

and, with rho_t = pi(y_t) / pi_old(y_t), the clipped surrogate summed over the completion tokens of the
batch and divided by their number (TRL's token-level averaging):

    loss = -sum_t min(rho_t A, clip(rho_t, 1 - eps, 1 + eps) A) / num_tokens

KL penalty on samples y ~ pi (Schulman, "Approximating KL divergence", 2020,
http://joschu.net/blog/kl-approx.html), with per-token log-ratio r_t = log pi_ref(y_t) - log pi(y_t):

    k1 = sum_t -r_t                     (unbiased, can be negative per sample)
    k3 = sum_t (exp(r_t) - 1 - r_t)     (unbiased, never negative; the usual choice as a loss term)
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from scipy.special import expit


def dpo_margin(
    policy_logp_a: torch.Tensor,
    policy_logp_b: torch.Tensor,
    ref_logp_a: torch.Tensor,
    ref_logp_b: torch.Tensor,
) -> torch.Tensor:
    """h = (log pi(a) - log pi_ref(a)) - (log pi(b) - log pi_ref(b)); all inputs (B,) sequence log-probs."""
    return (policy_logp_a - ref_logp_a) - (policy_logp_b - ref_logp_b)


def soft_dpo_loss(
    h: torch.Tensor,
    p: torch.Tensor,
    beta: float,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-pair soft-target DPO loss.

    Args:
        h: (B,) log-ratio margins from :func:`dpo_margin`.
        p: (B,) targets P(a better than b) in [0, 1] (soft, or 0/1 for hard labels).
        beta: DPO temperature.
        mask: (B,) 1 for pairs that count, 0 for skipped ones (low confidence, judge failure).

    Returns:
        (B,) losses, zero where masked. ``log sigmoid`` is evaluated stably with ``F.logsigmoid``.
    """
    if h.shape != p.shape:
        raise ValueError(
            f"soft_dpo_loss: h has shape {tuple(h.shape)} but p has {tuple(p.shape)}; one target per pair"
        )
    z = beta * h
    loss = -(p * F.logsigmoid(z) + (1.0 - p) * F.logsigmoid(-z))  # (B,)
    if mask is not None:
        loss = loss * mask.to(loss.dtype)
    return loss


def targets_from_probs(
    p: torch.Tensor, target: Literal["soft", "hard"] = "soft", margin: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Turn calibrated probabilities into DPO targets and a keep-mask.

    Args:
        p: (B,) P(a better than b); NaN where the judge failed (those pairs are skipped, never "b wins").
        target: ``soft`` keeps p; ``hard`` uses 1[p >= 0.5].
        margin: skip pairs with |p - 0.5| < margin (a confidence margin).

    Returns:
        (targets (B,), mask (B,) float).
    """
    ok = torch.isfinite(p)
    safe = torch.where(ok, p, torch.full_like(p, 0.5))
    mask = ok & ((safe - 0.5).abs() >= margin)
    t = (safe >= 0.5).to(p.dtype) if target == "hard" else safe
    return t, mask.to(p.dtype)


def sharpen(p: np.ndarray, temperature: float) -> np.ndarray:
    """p' = sigmoid(logit(p) / temperature): the same order, a larger (T < 1) or smaller (T > 1) signal;
    NaN (a failed judgement) stays NaN, and 0 or 1 stay where they are."""
    if temperature == 1.0:
        return p
    with np.errstate(divide="ignore", invalid="ignore"):
        logit = np.log(p) - np.log1p(-p)
    return expit(logit / temperature)


def confidence_weights(p: np.ndarray) -> np.ndarray:
    """Each pair's weight under ``pair_weighting: confidence``: the calibrated confidence ``|2p - 1|``
    (before any sharpening); a failed judgement (NaN) weighs 0."""
    return np.abs(2.0 * np.nan_to_num(np.asarray(p, dtype=float), nan=0.5) - 1.0)


def group_advantages(
    rewards: torch.Tensor, valid: torch.Tensor, scale_rewards: Literal["group", "none"] = "group"
) -> torch.Tensor:
    """Group-relative advantages (module docstring), over each group's valid samples.

    Args:
        rewards: (G, k) rewards, one row per prompt's group (any value where ``valid`` is False).
        valid: (G, k) bool, the samples that have a reward (a failed judgement has none).
        scale_rewards: ``group`` divides by the group's standard deviation (+ 1e-4, as TRL); ``none``
            does not.

    Returns:
        (G, k) advantages; 0 for invalid samples and for every sample of a group with fewer than two
        valid ones (nothing to compare against).
    """
    if rewards.shape != valid.shape or rewards.dim() != 2:
        raise ValueError(
            f"group_advantages: rewards {tuple(rewards.shape)} and valid {tuple(valid.shape)} must be one "
            "(num_groups, k) shape"
        )
    if scale_rewards not in ("group", "none"):
        raise ValueError(f"loss.scale_rewards must be 'group' or 'none', got {scale_rewards!r}")
    v = valid.to(rewards.dtype)
    n = v.sum(-1, keepdim=True)  # (G, 1)
    r = torch.where(valid, rewards, torch.zeros_like(rewards))
    mean = r.sum(-1, keepdim=True) / n.clamp(min=1)
    centered = (r - mean) * v
    adv = centered
    if scale_rewards == "group":
        std = (centered.pow(2).sum(-1, keepdim=True) / (n - 1).clamp(min=1)).sqrt()  # unbiased, as torch.std
        adv = centered / (std + 1e-4)
    return adv * (n >= 2).to(rewards.dtype)


def grpo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    token_mask: torch.Tensor,
    epsilon: float = 0.2,
    num_tokens: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """The clipped GRPO surrogate (module docstring), token-averaged.

    Args:
        logp: (N, T) log pi(y_t) of the sampled tokens, with gradients.
        old_logp: (N, T) the same under the policy that sampled them (detached; on-policy: ``logp.detach()``,
            so the ratio is 1 and the gradient is that of ``A * log pi``).
        advantages: (N,) one per sample.
        token_mask: (N, T) 1 on completion tokens (0 on padding and on samples that do not count).
        epsilon: clip range of the ratio.
        num_tokens: what the token sum is divided by (default ``token_mask.sum()``; the whole batch's
            count when this is one chunk of it, or the global count / processes under DDP).

    Returns:
        The scalar loss.
    """
    ratio = torch.exp(logp - old_logp)  # (N, T)
    a = advantages.unsqueeze(-1)  # (N, 1)
    per_token = -torch.min(ratio * a, torch.clamp(ratio, 1 - epsilon, 1 + epsilon) * a)  # (N, T)
    total = token_mask.sum().clamp(min=1.0) if num_tokens is None else num_tokens
    return (per_token * token_mask).sum() / total


def kl_per_sequence(
    policy_token_logp: torch.Tensor,
    ref_token_logp: torch.Tensor,
    token_mask: torch.Tensor,
    estimator: Literal["k1", "k3"] = "k3",
) -> torch.Tensor:
    """Sequence-level KL(pi || pi_ref) estimate for samples drawn from pi.

    Args:
        policy_token_logp: (N, T) log pi(y_t | y_<t) of the sampled tokens.
        ref_token_logp: (N, T) log pi_ref(y_t | y_<t) of the same tokens (no gradient needed).
        token_mask: (N, T) 1 on summary tokens, 0 on padding.
        estimator: ``k1`` (sum of log-ratios) or ``k3`` (sum of exp(r) - 1 - r), see module docstring.

    Returns:
        (N,) per-sequence estimates; their mean over samples from pi estimates KL(pi || pi_ref).
    """
    r = (ref_token_logp - policy_token_logp) * token_mask  # (N, T)
    if estimator == "k1":
        per_token = -r
    elif estimator == "k3":
        per_token = torch.expm1(r) - r
    else:
        raise ValueError(f"loss.kl_estimator must be 'k1' or 'k3', got {estimator!r}")
    return (per_token * token_mask).sum(-1)


class AdaptiveKLController:
    """Adaptive KL coefficient toward a target KL (Ziegler et al. 2019, "Fine-Tuning Language Models
    from Human Preferences", sec. 2.2): ``coef *= 1 + clip((KL - target) / target, -0.2, 0.2) * n / horizon``.

    ``adaptive=False`` keeps ``coef`` fixed. Stateful, with ``state_dict`` / ``load_state_dict``.
    """

    def __init__(self, init_coef: float, adaptive: bool = False, target: float = 1.0, horizon: int = 100):
        if init_coef < 0:
            raise ValueError(f"loss.kl_coef must be >= 0, got {init_coef}")
        self.coef = float(init_coef)
        self.adaptive = adaptive
        self.target = float(target)
        self.horizon = int(horizon)

    def update(self, kl: float, n_steps: int = 1) -> float:
        if self.adaptive:
            error = min(max((kl - self.target) / self.target, -0.2), 0.2)
            self.coef *= 1.0 + error * n_steps / self.horizon
        return self.coef

    def state_dict(self) -> dict[str, float]:
        return {"coef": self.coef}

    def load_state_dict(self, state: dict[str, float]) -> AdaptiveKLController:
        self.coef = float(state["coef"])
        return self
