"""The loop's losses: soft-target DPO (against TRL's sigmoid loss), the KL estimators and controller."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from judgeloop.loop.losses import (
    AdaptiveKLController,
    dpo_margin,
    kl_per_sequence,
    soft_dpo_loss,
    targets_from_probs,
)


def _logsig(x: float) -> float:
    return -math.log1p(math.exp(-x))


def test_soft_dpo_loss_hand_computed():
    h = torch.tensor([0.0, 1.0, -2.0, 3.0])
    p = torch.tensor([0.5, 1.0, 0.3, 0.0])
    beta = 0.5
    got = soft_dpo_loss(h, p, beta)
    want = [
        -(pi * _logsig(beta * hi) + (1 - pi) * _logsig(-beta * hi)) for hi, pi in zip(h.tolist(), p.tolist())
    ]
    assert torch.allclose(got, torch.tensor(want), atol=1e-6)
    assert got[0].item() == pytest.approx(math.log(2))  # h = 0: no preference expressed
    masked = soft_dpo_loss(h, p, beta, mask=torch.tensor([1.0, 0.0, 1.0, 0.0]))
    assert (
        masked[1].item() == 0.0
        and masked[3].item() == 0.0
        and masked[2].item() == pytest.approx(want[2], abs=1e-6)
    )


def test_dpo_margin_and_target_options():
    h = dpo_margin(torch.tensor([-1.0]), torch.tensor([-3.0]), torch.tensor([-2.0]), torch.tensor([-2.5]))
    assert h.item() == pytest.approx((-1 + 2) - (-3 + 2.5))
    p = torch.tensor([0.9, 0.55, 0.2, float("nan")])
    t, m = targets_from_probs(p, "soft", margin=0.1)
    assert torch.allclose(t[:3], p[:3]) and m.tolist() == [
        1.0,
        0.0,
        1.0,
        0.0,
    ]  # NaN judgement is skipped, not "b wins"
    t, m = targets_from_probs(p, "hard")
    assert t[:3].tolist() == [1.0, 1.0, 0.0] and m.tolist() == [1.0, 1.0, 1.0, 0.0]


def test_soft_dpo_matches_trl_sigmoid_loss_at_p_0_and_1(tmp_path):
    """At p=1 our loss (with our own log-probs) equals TRL's sigmoid DPO loss; at p=0 it equals TRL's loss
    with chosen and rejected swapped."""
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    from judgeloop.loop.rollout import token_logprobs
    from judgeloop.models import load_causal_lm, load_tokenizer

    tok = load_tokenizer("judgeloop-tiny/causal-lm")
    ref = load_causal_lm("judgeloop-tiny/causal-lm")
    policy = copy.deepcopy(ref)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for prm in policy.parameters():
            prm.add_(0.05 * torch.randn(prm.shape, generator=g))
    beta = 0.1
    row = {
        "prompt": "The river rose overnight.",
        "chosen": " Floods hit.",
        "rejected": " Markets fell.",
    }  # equal lengths: no padding

    def trl_loss(r: dict) -> tuple[float, torch.Tensor]:
        args = DPOConfig(
            output_dir=str(tmp_path),
            beta=beta,
            report_to=[],
            per_device_train_batch_size=1,
            use_cpu=True,
            loss_type=["sigmoid"],
        )
        trainer = DPOTrainer(
            model=policy, ref_model=ref, args=args, train_dataset=Dataset.from_list([r]), processing_class=tok
        )
        batch = next(iter(trainer.get_train_dataloader()))
        with torch.no_grad():
            return float(trainer.compute_loss(trainer.model, batch)), batch

    try:
        loss_p1, batch = trl_loss(row)
        loss_swapped, _ = trl_loss({**row, "chosen": row["rejected"], "rejected": row["chosen"]})
    finally:
        # TRL's trainer leaves accelerate's process-wide state behind; reset it so later tests start clean.
        from accelerate.state import AcceleratorState, GradientState

        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
    ids, cm = batch["input_ids"], batch["completion_mask"]
    prompt = [ids[0][cm[0] == 0].tolist()]
    chosen = [ids[0][cm[0] == 1].tolist()]
    rejected = [ids[1][cm[1] == 1].tolist()]
    with torch.no_grad():
        lp_c = token_logprobs(policy, prompt, chosen, tok.pad_token_id)[0].sum(-1)
        lp_r = token_logprobs(policy, prompt, rejected, tok.pad_token_id)[0].sum(-1)
        rf_c = token_logprobs(ref, prompt, chosen, tok.pad_token_id)[0].sum(-1)
        rf_r = token_logprobs(ref, prompt, rejected, tok.pad_token_id)[0].sum(-1)
    h = dpo_margin(lp_c, lp_r, rf_c, rf_r)
    assert abs(h.item()) > 1e-3  # a non-trivial margin
    # Tolerance: two DPOTrainer instances built identically on the same row already differ by ~1e-4 in
    # their loss (TRL's fused log-prob head), so agreement is checked at 1e-3.
    ours_p1 = soft_dpo_loss(h, torch.ones(1), beta).item()
    assert ours_p1 == pytest.approx(loss_p1, abs=1e-3)
    ours_p0 = soft_dpo_loss(h, torch.zeros(1), beta).item()
    assert ours_p0 == pytest.approx(loss_swapped, abs=1e-3)
    assert abs(ours_p0 - ours_p1) > 1e-2  # the two checks are not the same number


def test_kl_estimators_hand_computed_and_unbiased():
    # hand-computed: one sequence of two tokens, log pi = [-1, -2], log ref = [-1.5, -1]
    pol = torch.tensor([[-1.0, -2.0, 0.0]])
    ref = torch.tensor([[-1.5, -1.0, -9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])  # the third position is padding
    r = [-0.5, 1.0]
    assert kl_per_sequence(pol, ref, mask, "k1").item() == pytest.approx(-sum(r))
    assert kl_per_sequence(pol, ref, mask, "k3").item() == pytest.approx(
        sum(math.expm1(x) - x for x in r), abs=1e-6
    )
    # known case: single-token sequences sampled from p; both estimators' means approach KL(p || q)
    p = torch.tensor([0.6, 0.3, 0.1])
    q = torch.tensor([0.2, 0.5, 0.3])
    kl_true = float((p * (p / q).log()).sum())
    g = torch.Generator().manual_seed(0)
    y = torch.multinomial(p, 200_000, replacement=True, generator=g)
    lp, lq = p.log()[y][:, None], q.log()[y][:, None]
    ones = torch.ones_like(lp)
    for est in ("k1", "k3"):
        assert kl_per_sequence(lp, lq, ones, est).mean().item() == pytest.approx(kl_true, abs=0.01)
    assert (kl_per_sequence(lp, lq, ones, "k3") >= 0).all()


def test_adaptive_kl_controller_moves_toward_target():
    ctl = AdaptiveKLController(0.1, adaptive=True, target=1.0, horizon=10)
    assert ctl.update(5.0) == pytest.approx(0.1 * 1.02)  # error clipped to +0.2, times 1/10
    assert AdaptiveKLController(0.1, adaptive=True, target=1.0, horizon=10).update(0.5) == pytest.approx(
        0.1 * 0.98
    )  # clipped to -0.2
    assert AdaptiveKLController(0.1).update(5.0) == 0.1
    assert AdaptiveKLController(0.1).load_state_dict(ctl.state_dict()).coef == ctl.coef


def test_margin_agreement_counts_a_margin_within_rounding_of_zero_as_half():
    """Signs agree (1) or not (0); a margin within TIE_TOLERANCE of its log-probabilities' size is a tie
    (1/2), so a policy equal to its reference gives 0.5 whatever the rounding's sign on this CPU."""
    from judgeloop.loop.dpo import TIE_TOLERANCE, margin_agreement

    scale = torch.full((6,), 200.0)  # four sequence log-probs of about -50 each
    tiny = 0.5 * TIE_TOLERANCE * 200.0
    h = torch.tensor([0.3, -0.3, 0.3, tiny, -tiny, 0.0])
    t = torch.tensor([0.9, 0.9, 0.2, 0.9, 0.9, 0.1])
    assert margin_agreement(h, t, scale).tolist() == [1.0, 0.0, 0.0, 0.5, 0.5, 0.5]
    # a margin just past the tolerance is a sign again
    past = torch.tensor([-2 * TIE_TOLERANCE * 200.0])
    assert margin_agreement(past, torch.tensor([0.9]), torch.tensor([200.0])).tolist() == [0.0]
