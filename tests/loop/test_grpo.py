"""The loop's GRPO objective (loss.type=grpo): the loss and its gradients against TRL's GRPOTrainer,
the normalization of group-relative advantages, the Platt map's linear regime, and short runs."""

from __future__ import annotations

import copy
import json
import math

import numpy as np
import pytest
import torch

from judgeloop.calibration import PlattCalibrator
from judgeloop.config import load_config
from judgeloop.judges import JudgeConfig
from judgeloop.judges.calibrated import CalibratedJudge
from judgeloop.loop.config import FeedbackLoopConfig
from judgeloop.loop.losses import group_advantages, grpo_loss
from judgeloop.rewards import Group, RewardConfig, score_groups


def _trl_advantages(rewards: torch.Tensor, k: int, scale_rewards: str) -> torch.Tensor:
    """TRL's advantages, as ``GRPOTrainer._generate_and_score_completions`` computes them (one reward
    function, ``sum_then_normalize``): with TRL's own ``nanstd``; NaN marks a reward that is missing."""
    from trl.trainer.utils import nanstd

    mean = torch.nanmean(rewards.view(-1, k), dim=1).repeat_interleave(k, dim=0)
    std = nanstd(rewards.view(-1, k), dim=1).repeat_interleave(k, dim=0)
    adv = rewards - mean
    if scale_rewards != "none":
        adv = adv / (std + 1e-4)
    return torch.nan_to_num(adv, nan=0.0)


@pytest.fixture(scope="module")
def tiny_policy():
    from judgeloop.models import load_causal_lm, load_tokenizer

    tok = load_tokenizer("judgeloop-tiny/causal-lm")
    policy = load_causal_lm("judgeloop-tiny/causal-lm")
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for prm in policy.parameters():
            prm.add_(0.05 * torch.randn(prm.shape, generator=g))
    return tok, policy


@pytest.mark.parametrize("scale_rewards", ["group", "none"])
def test_grpo_loss_and_gradients_equal_trls(tmp_path, tiny_policy, scale_rewards):
    """TRL's ``GRPOTrainer._compute_loss`` (its default ``loss_type="dapo"``: the token sum over the
    batch's completion tokens; ``beta=0``, the loop's KL term is its own), called on the same
    completions, advantages and mask, against ``grpo_loss``. Off-policy old log-probs make the clip bite.

    * the loop's advantages equal TRL's formula on the same rewards (a missing one included);
    * ``grpo_loss`` on TRL's own per-token log-probs gives TRL's loss and every parameter's gradient
      (to float rounding): the clipped surrogate, mask and token averaging are TRL's;
    * on the loop's own log-probs (:func:`token_logprobs`) the log-probs agree to 1e-2, the loss and the
      gradients to 2%: TRL computes its log-probs with a fused log-prob head (``fused_lm_head=True``)
      whose values differ from plain autograd by up to 5e-3 and its gradients by about 1% on this
      model, while the loop's log-probs and their gradients equal a plain ``log_softmax`` pass to 1e-6
      (measured on this model and data, 2026-12-02).
    """
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from judgeloop.loop.rollout import right_pad, token_logprobs

    tok, base = tiny_policy
    k, groups = 4, 2
    rewards = torch.tensor([0.9, 0.1, 0.4, float("nan"), 0.3, 0.7, 0.2, 0.6])  # (groups * k,), one missing
    adv = group_advantages(
        torch.nan_to_num(rewards).view(groups, k), ~torch.isnan(rewards).view(groups, k), scale_rewards
    ).view(-1)
    torch.testing.assert_close(adv, _trl_advantages(rewards, k, scale_rewards), rtol=1e-6, atol=1e-7)

    prompt = tok("The river rose overnight and the town", add_special_tokens=False)["input_ids"]
    rng = np.random.default_rng(0)
    lengths = [3, 5, 2, 4, 6, 1, 4, 3]  # right padding differs per completion; one prompt: no left padding
    comps = [rng.integers(5, tok.vocab_size - 1, n).tolist() for n in lengths]
    n, eps = len(comps), 0.2
    c_ids, c_mask = right_pad(comps, tok.pad_token_id)
    shift = torch.tensor(rng.uniform(-0.5, 0.5, c_ids.shape), dtype=torch.float32)  # ratios in [0.6, 1.65]

    args = GRPOConfig(
        output_dir=str(tmp_path),
        beta=0.0,
        num_generations=k,
        per_device_train_batch_size=k,
        report_to=[],
        use_cpu=True,
        max_completion_length=8,
        scale_rewards=scale_rewards,
        epsilon=eps,
        temperature=1.0,
    )
    try:
        trainer = GRPOTrainer(
            model=copy.deepcopy(base),
            reward_funcs=lambda completions, **kw: [0.0] * len(completions),
            args=args,
            train_dataset=Dataset.from_list([{"prompt": "x"}] * k),
            processing_class=tok,
        )
        model = trainer.model
        model.eval()  # TRL's "eval" normalizer: the batch's tokens / processes, no accumulation window
        ids = torch.cat([torch.tensor([prompt] * n), c_ids], 1)
        attn = torch.cat([torch.ones(n, len(prompt), dtype=torch.long), c_mask], 1)
        with torch.no_grad():
            trl_logp = trainer._get_per_token_logps_and_entropies(model, ids, attn, c_ids.shape[1])[0]
        old = trl_logp + shift
        inputs = {
            "prompt_ids": ids[:, : len(prompt)],
            "prompt_mask": attn[:, : len(prompt)],
            "completion_ids": c_ids,
            "completion_mask": c_mask,
            "advantages": adv,
            "num_items_in_batch": c_mask.sum(),
            "old_per_token_logps": old,
        }
        trl_loss = trainer._compute_loss(model, inputs)
        trl_loss.backward()
        trl_grads = {name: p.grad.clone() for name, p in model.named_parameters()}
        model.zero_grad()
        logp = trainer._get_per_token_logps_and_entropies(model, ids, attn, c_ids.shape[1])[0]
        on_trl = grpo_loss(logp, old, adv, c_mask.float(), eps)
        on_trl.backward()
        assert on_trl.item() == pytest.approx(trl_loss.item(), rel=1e-6)
        for name, p in model.named_parameters():
            torch.testing.assert_close(p.grad, trl_grads[name], rtol=1e-5, atol=1e-9, msg=name)
    finally:  # TRL's trainer leaves accelerate's process-wide state behind
        from accelerate.state import AcceleratorState, GradientState

        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()

    ours_model = copy.deepcopy(base).eval()
    logp, mask = token_logprobs(ours_model, [prompt] * n, comps, tok.pad_token_id)
    torch.testing.assert_close(logp.detach() * mask, trl_logp * c_mask, rtol=0, atol=1e-2)
    loss = grpo_loss(logp, old, adv, mask, eps)
    loss.backward()
    clipped = ((torch.exp(logp.detach() - old) - 1).abs() > eps) & mask.bool()
    assert clipped.any() and (~clipped & mask.bool()).any()  # both branches of the clip are exercised
    assert loss.item() == pytest.approx(trl_loss.item(), rel=2e-2)
    for name, p in ours_model.named_parameters():
        want = trl_grads[name]
        assert float((p.grad - want).norm() / want.norm()) < 0.02, name


def test_grpo_loss_clips_like_ppo_off_policy():
    """Off-policy (ratio != 1) the surrogate is PPO's pessimistic clip, by hand."""
    logp = torch.log(torch.tensor([[1.5, 0.5], [1.5, 0.5]]))  # ratios 1.5 and 0.5 against old_logp = 0
    old = torch.zeros(2, 2)
    adv = torch.tensor([1.0, -1.0])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    got = grpo_loss(logp, old, adv, mask, epsilon=0.2)
    # A > 0: min(1.5, 1.2) = 1.2 and min(0.5, 0.8) = 0.5; A < 0: -max(1.5, 1.2) = -1.5 (the second masked)
    want = -(1.2 + 0.5 - 1.5) / 3
    assert got.item() == pytest.approx(want)


def test_advantages_are_affine_invariant_under_group_and_scale_under_none():
    g = torch.Generator().manual_seed(0)
    r = torch.rand(5, 4, generator=g)
    valid = torch.ones(5, 4, dtype=torch.bool)
    valid[1, 2] = False  # a missing reward is left out of its group's mean and std
    valid[3, 1:] = False  # a group with one valid sample: nothing to compare, all zero
    a, b = 3.0, -2.0
    base = group_advantages(r, valid, "group")
    assert torch.allclose(group_advantages(a * r + b, valid, "group"), base, atol=1e-3)  # up to TRL's 1e-4
    assert base[1, 2] == 0 and (base[3] == 0).all()
    assert torch.allclose(base[0].std(), torch.tensor(1.0), atol=1e-3)
    none = group_advantages(r, valid, "none")
    assert torch.allclose(group_advantages(a * r + b, valid, "none"), a * none, atol=1e-6)
    assert torch.allclose(none[0], r[0] - r[0].mean())


def _platt(a: float) -> PlattCalibrator:
    return PlattCalibrator().load_state_dict(
        {
            "method": "platt",
            "symmetric": True,
            "min_points": 10,
            "n_fit_": 100,
            "params": {"a_": a, "b_": 0.0, "fit_intercept": False, "target_smoothing": False},
        }
    )


def test_in_a_platt_maps_linear_regime_calibrated_advantages_are_the_raw_logits_whatever_the_slope():
    """p = sigmoid(a s) ~ 1/2 + a s / 4 for small a: each sample's win rate is affine in its mean raw logit
    against the others, so under ``scale_rewards: group`` the calibrated arm's advantages approach those
    of the mean raw logit at every small slope (the shrinkage divides out), up to TRL's + 1e-4 in the
    std once the rewards' spread nears it; under ``none`` they shrink with a. The mechanism the GRPO
    study puts to the test."""
    cfg = JudgeConfig(type="objective", signal="length", scale=0.5)  # shorter is better
    article = "the council met on monday and voted to expand the city park by ten acres next spring"
    groups = [
        Group(article, ["park grows", "the park grows soon", "the council votes and the park grows", "a"]),
        Group(article, ["the council met", "voted to expand the park by ten acres", "park", "it grows soon"]),
    ]
    raw_judge = CalibratedJudge(cfg, _platt(1.0))
    mean_logit = []
    for grp in groups:
        c = grp.completions
        pairs = [(i, j) for i in range(len(c)) for j in range(len(c)) if i != j]
        s = raw_judge.compare(
            [article] * len(pairs), [c[i] for i, _ in pairs], [c[j] for _, j in pairs]
        ).logit
        mean_logit.append(
            [np.mean([s[n] for n, (i, _) in enumerate(pairs) if i == row]) for row in range(len(c))]
        )
    valid = torch.ones(2, 4, dtype=torch.bool)
    raw_adv = group_advantages(torch.tensor(mean_logit, dtype=torch.float32), valid, "group")
    raw_none = group_advantages(torch.tensor(mean_logit, dtype=torch.float32), valid, "none")

    def eps_free(x: torch.Tensor) -> torch.Tensor:  # (r - mean) / std, without TRL's + 1e-4
        return (x - x.mean(-1, keepdim=True)) / x.std(-1, keepdim=True)

    m = torch.tensor(mean_logit, dtype=torch.float64)
    gaps, exact_gaps = [], []
    for slope in (0.3, 0.1, 0.03, 0.01):
        judge = CalibratedJudge(cfg, _platt(slope), judge=raw_judge.judge)
        out = score_groups(judge, groups, RewardConfig("round_robin", "win_rate"))  # k=4, m=2: every pair
        r = torch.tensor(out.rewards, dtype=torch.float32)
        gaps.append(float((group_advantages(r, valid, "group") - raw_adv).abs().max()))
        exact_gaps.append(float((eps_free(r.double()) - eps_free(m)).abs().max()))
        # unnormalized, the calibrated advantages are the raw ones shrunk by a / 4
        assert torch.allclose(group_advantages(r, valid, "none"), slope / 4 * raw_none, rtol=0.05, atol=1e-6)
    # the normalized win rates converge to the normalized mean raw logits as the slope falls
    assert exact_gaps[0] < 1e-2 and exact_gaps[1] < 1e-3 and exact_gaps[2] < 1e-4 and exact_gaps[3] < 1e-4
    # with TRL's + 1e-4 in the denominator they do too while the rewards spread well above 1e-4; at a
    # slope of 0.01 the group's std is ~4e-3 and the shrinkage starts to come back (2% here, 8% of a
    # unit advantage), measured on these groups
    assert max(gaps[:3]) < 0.05 and gaps[3] < 0.1 and gaps[3] > gaps[1]


def test_grpo_settings_are_checked_before_any_work():
    from judgeloop.config import ConfigError

    tiny = "configs/feedback_loop/tiny.yaml"
    for overrides, message in [
        (
            ["generation.num_samples_per_article=4"],
            "generation.num_samples_per_article=4 is read under loss.type=grpo",
        ),
        (["loss.scale_rewards=none"], "loss.scale_rewards='none' is a GRPO setting"),
        (["loss.type=grpo", "loss.beta=0.2"], "loss.beta=0.2 is a DPO setting (the DPO temperature"),
        (["loss.type=grpo", "loss.spread_weighting=true"], "loss.spread_weighting=True is a DPO setting"),
        (["loss.type=grpo", "generation.num_samples_per_article=1"], "generation.num_samples_per_article"),
        (["loss.type=grpo", "loss.epsilon=0"], "loss.epsilon"),
    ]:
        with pytest.raises((ConfigError, ValueError), match=message.replace("(", r"\(")):
            load_config(FeedbackLoopConfig, tiny, overrides)


# --- the loop under grpo --------------------------------------------------------------------------

GRPO = [
    "judge.model=judgeloop-tiny/encoder",
    "judge.cache_size=0",
    "policy.sft_steps=10",
    "max_steps=2",
    "eval_every_n_steps=0",
    "calibration.recalibrate_every_n_steps=0",
    "calibration.num_articles=20",
    "calibration.pairs_per_article=4",
    "calibration.extra_rounds=1",
    "calibration.min_points=4",
    "num_eval_articles=2",
    "num_validation_articles=2",
    "progress_bar=false",
    "log_with=[jsonl]",
    "data.embedded_size=120",
    "generation.max_new_tokens=8",
    "save_final_policy=false",
    "loss.type=grpo",
    "generation.num_samples_per_article=4",
]
TINY = "configs/feedback_loop/tiny.yaml"
ARMS = ("raw", "platt", "isotonic", "feature_platt", "style_residual", "panel", "oracle")


@pytest.fixture(scope="module")
def grpo_runs(tmp_path_factory):
    """``judgeloop train`` with loss.type=grpo, 2 steps on the tiny config, for every ablation arm (sharing
    their start work through one start cache, as an ablation's arms do)."""
    from judgeloop.cli import main

    root = tmp_path_factory.mktemp("grpo")
    reports = {}
    for arm in ARMS:
        out = root / arm
        extra = [f"calibration.method={arm}", f"output_dir={out}", f"start_cache={root / 'cache'}"]
        if arm == "panel":  # the judge beside an objective copy-rate member, as quickstart_grpo.yaml shows
            extra.append("calibration.panel.members=[{type: objective, signal: copy_rate, scale: 20.0}]")
        assert main(["train", "--config", TINY, *GRPO, *extra]) == 0
        reports[arm] = json.loads((out / "report.json").read_text())
    return root, reports


@pytest.mark.slow
def test_judgeloop_train_runs_grpo_for_every_ablation_arm(grpo_runs):
    _, reports = grpo_runs
    assert tuple(reports) == ARMS
    for arm, report in reports.items():
        log = report["train_log"]
        assert [r["step"] for r in log] == [1, 2], arm
        for row in log:
            assert {"grpo_loss", "kl", "reward_mean", "advantage_abs_mean", "p_mean"} <= set(row), arm
            assert math.isfinite(row["loss"]) and math.isfinite(row["grad_norm"]), arm
            assert row["kept_fraction"] > 0.5 and row["advantage_abs_mean"] > 0, arm
        assert report["judge_stats"]["status"], arm  # the judge was called on the groups' comparisons
    for arm in ("platt", "isotonic", "feature_platt", "style_residual"):  # each arm's own calibrator
        assert reports[arm]["refits"] and reports[arm]["refits"][0]["refit"], arm
        assert reports[arm]["arm"] == arm, arm
    # the arms differ only in the calibrated p of the same first rollout: the same samples, other rewards
    assert reports["raw"]["train_log"][0]["p_mean"] != reports["oracle"]["train_log"][0]["p_mean"]


@pytest.mark.slow
def test_a_grpo_run_resumed_from_its_checkpoint_equals_the_uninterrupted_one(grpo_runs):
    from judgeloop.recipes import train

    root, reports = grpo_runs
    base = [*GRPO, "calibration.method=platt", f"output_dir={root / 'cut'}", f"start_cache={root / 'cache'}"]
    part = train(load_config(FeedbackLoopConfig, TINY, [*base, "stop_after_n_steps=1"]))
    assert part["interrupted"] and part["step"] == 1
    resumed = train(load_config(FeedbackLoopConfig, TINY, [*base, f"resume_from={part['checkpoint']}"]))
    full = reports["platt"]
    for r, f in zip(resumed["train_log"], full["train_log"], strict=True):
        assert r.keys() == f.keys()
        for key in r:
            assert r[key] == pytest.approx(f[key], rel=1e-6, abs=1e-9), key
    assert resumed["final"]["rouge_l_neutral"] == pytest.approx(full["final"]["rouge_l_neutral"], rel=1e-6)


@pytest.mark.slow
def test_a_chunked_grpo_update_equals_the_whole_batch_one(grpo_runs):
    """optim.update_chunk_size=1 (one article's group per forward/backward, so the rollout's prompt pass is
    not reused either) gives the run of the whole-batch update that reuses it: the token normalizer and
    the KL share are the batch's in every chunk."""
    from judgeloop.recipes import train

    root, reports = grpo_runs
    over = [
        *GRPO,
        "calibration.method=platt",
        f"output_dir={root / 'chunked'}",
        f"start_cache={root / 'cache'}",
    ]
    chunked = train(load_config(FeedbackLoopConfig, TINY, [*over, "optim.update_chunk_size=1"]))
    for r, f in zip(chunked["train_log"], reports["platt"]["train_log"], strict=True):
        for key in ("loss", "grpo_loss", "kl", "kl_k1", "reward_mean", "grad_norm"):
            assert r[key] == pytest.approx(f[key], rel=1e-4, abs=1e-6), key
