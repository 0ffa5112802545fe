"""The loop's steps (judgeloop.loop.steps): one update, the shared prompt pass, sampling, precision."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from judgeloop.config import load_config
from judgeloop.loop.config import FeedbackLoopConfig
from judgeloop.loop.losses import (
    targets_from_probs,
)
from loop_common import FAST, TINY


def _tiny_rollout(n: int, seed: int = 0):
    from judgeloop.loop.rollout import Rollout

    g = torch.Generator().manual_seed(seed)
    prompts = [
        torch.randint(10, 900, (int(torch.randint(4, 9, (1,), generator=g)),), generator=g).tolist()
        for _ in range(n)
    ]
    a = [
        torch.randint(10, 900, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g).tolist() + [2]
        for _ in range(n)
    ]
    b = [
        torch.randint(10, 900, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g).tolist() + [2]
        for _ in range(n)
    ]
    return Rollout(["x"] * n, prompts, a, b, ["a"] * n, ["b"] * n)


def test_parameters_change_after_one_update_and_reference_does_not():
    from accelerate import Accelerator

    from judgeloop.loop.config import LossConfig
    from judgeloop.loop.steps import Learner, PairBatch, policy_update
    from judgeloop.models import load_causal_lm
    from loop_common import tiny_policy

    acc = Accelerator(cpu=True)
    model = load_causal_lm("judgeloop-tiny/causal-lm").train()
    ref = copy.deepcopy(model).eval()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ref_before = {n: p.detach().clone() for n, p in ref.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0)
    model, opt, sched = acc.prepare(model, opt, sched)
    batch = PairBatch(
        1, [], rollout=_tiny_rollout(4), targets=torch.tensor([0.9, 0.1, 0.7, 0.5]), mask=torch.ones(4)
    )
    stats = policy_update(
        Learner(tiny_policy(acc, model, ref), opt, sched, LossConfig(beta=0.1), 1.0), batch, 0.1
    )
    # pi == pi_ref at the first step: h = 0 and KL = 0 up to float noise (train- vs eval-mode attention kernels)
    assert stats["loss"] == pytest.approx(math.log(2), abs=1e-3)
    changed = [n for n, p in model.named_parameters() if not torch.equal(p, before[n])]
    assert len(changed) == len(before)
    assert all(torch.equal(p, ref_before[n]) for n, p in ref.named_parameters())


@pytest.mark.parametrize("lora", [False, True])
def test_shared_prompt_logprobs_equal_the_plain_pass(lora):
    """Running each prompt once for its two samples gives the same log-probs and gradients as the
    plain pass over prompt + summary for every sample (prompts and summaries of different lengths)."""
    from judgeloop.loop.rollout import token_logprobs
    from judgeloop.models import load_causal_lm

    model = load_causal_lm("judgeloop-tiny/causal-lm")
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(
            model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
        )
    g = torch.Generator().manual_seed(3)

    def seq(lo, hi):
        return torch.randint(10, 900, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g).tolist()

    B = 5
    prompts = [seq(3, 25) for _ in range(B)]
    comps = [seq(1, 10) + [2] for _ in range(2 * B)]
    comps[3] = []  # an empty sample: all-padding row
    results = []
    for shared in (False, True):
        model.zero_grad()
        if shared:
            lp, m = token_logprobs(model, prompts, comps, 0, samples_per_prompt=2)
        else:
            lp, m = token_logprobs(model, prompts + prompts, comps, 0)
        (lp * torch.linspace(0.5, 1.5, lp.numel()).view_as(lp)).sum().backward()
        grads = [p.grad.clone() for p in model.parameters() if p.requires_grad]
        results.append((lp.detach(), m, grads))
    (lp0, m0, g0), (lp1, m1, g1) = results
    assert torch.equal(m0, m1) and m0[3].sum() == 0
    torch.testing.assert_close(lp1, lp0, atol=2e-5, rtol=1e-5)
    for a, b in zip(g1, g0, strict=True):
        torch.testing.assert_close(a, b, atol=5e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="samples_per_prompt"):
        token_logprobs(model, prompts, comps[:-1], 0, samples_per_prompt=2)


@pytest.mark.parametrize("lora", [False, True])
def test_the_kept_prompt_pass_gives_the_fresh_pass_values_and_gradients(lora):
    """optim.share_prompt_pass: sampling keeps its prompt prefill with gradients (PromptPrefix) and the
    update scores the summaries on top of it. Same samples as without, and the same log-probs and
    gradients as the update's own pass over the prompts; the kept pass serves one update only."""
    from judgeloop.loop.config import GenerationConfig
    from judgeloop.loop.rollout import generate, prefix_reusable, token_logprobs
    from judgeloop.models import load_causal_lm, load_tokenizer

    model, tok = load_causal_lm("judgeloop-tiny/causal-lm"), load_tokenizer("judgeloop-tiny/causal-lm")
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(
            model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
        )
    assert prefix_reusable(model)
    prompts = [tok.encode(f"Summarize: the council {'met and voted ' * n}today.") for n in (1, 4, 7, 2)]
    gen = GenerationConfig(max_new_tokens=9, temperature=1.0)
    kept: list = []
    comps = generate(model, tok, prompts, gen, num_samples=2, seed=5, keep_prefix=kept)
    assert comps == generate(model, tok, prompts, gen, num_samples=2, seed=5)
    assert len(kept) == 1 and kept[0].cache.layers[-1].values.requires_grad  # the graph is kept
    ab = comps[0::2] + comps[1::2]  # the loop's order: a-samples, then b-samples
    model.train()
    results = []
    for prefix in (None, kept[0]):
        model.zero_grad()
        lp, m = token_logprobs(model, prompts, ab, tok.pad_token_id, 2, prefix)
        (lp * torch.linspace(0.5, 1.5, lp.numel()).view_as(lp)).sum().backward()
        grads = [p.grad.clone() for p in model.parameters() if p.requires_grad]
        results.append((lp.detach(), m, grads))
    (lp0, m0, g0), (lp1, m1, g1) = results
    assert torch.equal(m0, m1) and m0.sum() > 8
    torch.testing.assert_close(lp1, lp0, atol=2e-5, rtol=1e-5)
    for a, b in zip(g1, g0, strict=True):
        torch.testing.assert_close(a, b, atol=5e-5, rtol=1e-4)
    with pytest.raises(RuntimeError, match="already used"):
        token_logprobs(model, prompts, ab, tok.pad_token_id, 2, kept[0])
    with pytest.raises(ValueError, match="other prompts"):
        kept2: list = []
        generate(model, tok, prompts, gen, num_samples=2, seed=5, keep_prefix=kept2)
        token_logprobs(model, prompts[::-1], ab, tok.pad_token_id, 2, kept2[0])
    # a policy with active dropout computes otherwise in train mode: its prompt pass is not reused
    model.add_module("extra_dropout", torch.nn.Dropout(0.1))
    assert not prefix_reusable(model)


@pytest.mark.slow
def test_a_run_sharing_the_prompt_pass_equals_one_that_does_not(tmp_path, monkeypatch):
    """optim.share_prompt_pass (on by default) takes effect in the loop, and the run's log and final metrics
    are those of a run whose update runs the prompts itself (up to float rounding)."""
    from judgeloop.loop import rollout as rollout_module
    from judgeloop.recipes import train

    used = []
    real = rollout_module._logprobs_on_prefix
    monkeypatch.setattr(rollout_module, "_logprobs_on_prefix", lambda *a: used.append(1) or real(*a))
    on = train(load_config(FeedbackLoopConfig, TINY, [*FAST, f"output_dir={tmp_path / 'on'}"]))
    assert len(used) == 4  # one update per step, each on its rollout's prompt pass
    off = train(
        load_config(
            FeedbackLoopConfig,
            TINY,
            [*FAST, f"output_dir={tmp_path / 'off'}", "optim.share_prompt_pass=false"],
        )
    )
    assert len(used) == 4
    for a, b in zip(on["train_log"], off["train_log"], strict=True):
        assert a.keys() == b.keys()
        for k in a:
            assert a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-6), k
    assert on["final"].keys() == off["final"].keys()
    for k, v in on["final"].items():
        assert v == pytest.approx(off["final"][k], rel=1e-4, abs=1e-6), k


def test_sampling_with_one_prefill_per_prompt_gives_the_same_samples():
    """generate(num_samples=2) prefills each prompt once and repeats its cache; the samples equal those of
    prefilling each copy of the prompt (same seed, same random draws)."""
    from judgeloop.loop.config import GenerationConfig
    from judgeloop.loop.rollout import generate
    from judgeloop.models import load_causal_lm, load_tokenizer

    model, tok = load_causal_lm("judgeloop-tiny/causal-lm"), load_tokenizer("judgeloop-tiny/causal-lm")
    prompts = [tok.encode(f"Summarize: the council {'met and voted ' * n}today.") for n in (1, 4, 7)]
    gen = GenerationConfig(max_new_tokens=10, temperature=1.0)
    shared = generate(model, tok, prompts, gen, num_samples=2, seed=11)
    copies = generate(model, tok, [p for p in prompts for _ in range(2)], gen, num_samples=1, seed=11)
    assert len(shared) == 6 and shared == copies
    assert len({tuple(c) for c in shared}) > 1  # really sampled


def test_bf16_loop_context_serves_updated_weights():
    """The loop runs in one autocast context across optimizer steps (as train() does). After an update, a
    forward in that context must see the new weights: autocast's weight-cast cache would otherwise keep
    serving the bf16 copies made before the step."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    from judgeloop.loop.policy import Policy, load_policy
    from judgeloop.loop.rollout import PromptBuilder, token_logprobs
    from judgeloop.loop.setup import make_optimizer, mixed_precision_kwargs
    from judgeloop.loop.steps import Learner, PairBatch, policy_update

    cfg = load_config(FeedbackLoopConfig, TINY, [*FAST, "policy.sft_steps=0", "optim.learning_rate=0.05"])
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    try:
        acc = Accelerator(cpu=True, **mixed_precision_kwargs("bf16"))
        model, tok, ref = load_policy(cfg.policy, 0)
        opt, sched = make_optimizer(model, cfg)
        model, opt, sched = acc.prepare(model, opt, sched)
        articles = ["The council met on Tuesday and voted to close the old bridge for repairs."] * 2
        with acc.autocast():
            policy = Policy(acc, model, ref, tok, PromptBuilder(tok, cfg.policy))
            roll = policy.sample(articles, cfg.generation, 3)
            comps, prompts = roll.a_ids + roll.b_ids, roll.prompts * 2
            before, _ = token_logprobs(model, prompts, comps, tok.pad_token_id)
            targets, mask = targets_from_probs(torch.tensor([1.0, 0.0]), "soft")
            batch = PairBatch(1, [], rollout=roll, targets=targets, mask=mask)
            policy_update(Learner(policy, opt, sched, cfg.loss, 1.0), batch, 0.1)
            after, _ = token_logprobs(model, prompts, comps, tok.pad_token_id)
        with acc.autocast():  # a fresh context: casts the current weights
            fresh, _ = token_logprobs(model, prompts, comps, tok.pad_token_id)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
    assert not torch.allclose(before, after)  # the update shows in the same context
    torch.testing.assert_close(after, fresh, rtol=0, atol=0)


@pytest.mark.slow
def test_bf16_mixed_precision_run_trains_and_stays_close(tmp_path):
    """mixed_precision=bf16 (autocast over both passes and the judge) runs end to end with
    finite losses; master weights stay float32."""
    from accelerate.state import AcceleratorState, GradientState

    from judgeloop.recipes import train

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    try:
        over = [
            *FAST,
            f"output_dir={tmp_path}",
            "max_steps=2",
            "eval_every_n_steps=2",
            "mixed_precision=bf16",
        ]
        rep = train(load_config(FeedbackLoopConfig, TINY, over))
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
    assert rep["steps_run"] == 2
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["kl"]) for r in rep["train_log"])
    from safetensors.torch import load_file

    weights = load_file(str(tmp_path / "policy" / "model.safetensors"))
    assert {v.dtype for v in weights.values()} == {torch.float32}


@pytest.mark.parametrize("inside", [False, True])
def test_generation_runs_outside_autocast_unless_asked(inside):
    """Decoding under the run's bf16 autocast would re-cast every fp32 weight at every step; by default
    generation leaves autocast, and generation.autocast=true keeps it."""
    from judgeloop.loop.config import GenerationConfig
    from judgeloop.loop.rollout import generate
    from judgeloop.models import load_causal_lm, load_tokenizer

    tok = load_tokenizer("judgeloop-tiny/causal-lm")
    model = load_causal_lm("judgeloop-tiny/causal-lm")
    seen: list[bool] = []
    model.register_forward_pre_hook(lambda *_: seen.append(torch.is_autocast_enabled("cpu")))
    prompts = [tok.encode("Summarize: the council met and voted today.")] * 2
    gen = GenerationConfig(max_new_tokens=4, autocast=inside)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = generate(model, tok, prompts, gen, num_samples=2, seed=0)
        assert torch.is_autocast_enabled("cpu")  # the caller's context is left as it was
    assert len(out) == 4 and seen and set(seen) == {inside}
