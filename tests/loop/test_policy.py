"""The Policy (loop/policy.py): its rollout under hf is the loop's rollout as it was before the policy was one
object (a verbatim copy below is the reference), its greedy and reference decodes, its KL on its samples."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from judgeloop.config import load_config
from judgeloop.loop.config import FeedbackLoopConfig, GenerationConfig
from judgeloop.loop.rollout import (
    IN_PROCESS,
    GenerationBackend,
    PromptBuilder,
    PromptPrefix,
    Rollout,
    decode,
    generate,
)
from judgeloop.loop.state import load_splits
from loop_common import FAST, TINY


def rollout_before_policy(
    model,
    tokenizer,
    build_prompt: PromptBuilder,
    articles: Sequence[str],
    gen: GenerationConfig,
    seed: int,
    num_pairs: int = 1,
    keep_prefix: bool = False,
    num_samples: int = 2,
    backend: GenerationBackend = IN_PROCESS,
) -> Rollout:
    """``judgeloop.loop.rollout.rollout`` as of a9127de (before Policy.sample took its place), verbatim."""
    if num_samples != 2 and num_pairs != 1:
        raise ValueError(
            f"num_samples={num_samples} with num_pairs={num_pairs}: a group rollout has one group"
        )
    prompts = [build_prompt(a) for a in articles]
    kept: list[PromptPrefix] | None = [] if keep_prefix and num_pairs == 1 else None
    k = num_samples * num_pairs
    comps = generate(
        model, tokenizer, prompts, gen, num_samples=k, seed=seed, keep_prefix=kept, backend=backend
    )
    samples = [comps[j::num_samples] for j in range(num_samples)]  # sample j of each article (or pair)
    a_ids, b_ids = samples[0], samples[1]
    rep_articles = [a for a in articles for _ in range(num_pairs)]
    rep_prompts = [p for p in prompts for _ in range(num_pairs)]
    return Rollout(
        rep_articles,
        rep_prompts,
        a_ids,
        b_ids,
        decode(tokenizer, a_ids),
        decode(tokenizer, b_ids),
        kept[0] if kept else None,
        samples[2:],
        [decode(tokenizer, c) for c in samples[2:]],
    )


@pytest.fixture(scope="module", params=[False, True], ids=["full", "lora"])
def tiny(request):
    """A prepared tiny policy (full fine-tuning with its frozen copy, or LoRA), its Policy and articles."""
    from accelerate import Accelerator

    from judgeloop.loop.policy import Policy, load_policy

    lora = request.param
    cfg = load_config(
        FeedbackLoopConfig, TINY, [*FAST, "policy.sft_steps=0", f"policy.lora={str(lora).lower()}"]
    )
    model, tok, ref = load_policy(cfg.policy, 0)
    acc = Accelerator(cpu=True)
    model = acc.prepare(model)
    policy = Policy(acc, model, ref, tok, PromptBuilder(tok, cfg.policy))
    return cfg, policy, load_splits(cfg, 1).test[:3]


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"num_pairs": 3}, {"num_samples": 4}, {"keep_prefix": True}],
    ids=["pair", "pairs", "group", "prefix"],
)
def test_the_policys_sample_under_hf_is_the_rollout_before_it(tiny, kwargs):
    cfg, policy, examples = tiny
    articles = [e.article for e in examples]
    got = policy.sample(articles, cfg.generation, 7, **kwargs)
    want = rollout_before_policy(
        policy.unwrapped,
        policy.tokenizer,
        PromptBuilder(policy.tokenizer, cfg.policy),
        articles,
        cfg.generation,
        7,
        **kwargs,
    )
    for name in ("articles", "prompts", "a_ids", "b_ids", "a_text", "b_text", "more_ids", "more_text"):
        assert getattr(got, name) == getattr(want, name), name
    assert len({tuple(c) for c in got.a_ids + got.b_ids}) > 1  # really sampled
    assert (got.prefix is None) == (want.prefix is None) == (not kwargs.get("keep_prefix"))
    if got.prefix is not None:
        assert torch.equal(got.prefix.ids, want.prefix.ids) and torch.equal(got.prefix.mask, want.prefix.mask)
    with pytest.raises(ValueError, match="a group rollout has one group"):
        policy.sample(articles, cfg.generation, 7, num_pairs=2, num_samples=4)


def test_greedy_decodes_and_the_kl_of_a_policy_that_is_its_reference(tiny):
    """Greedy is the model's own generate (greedy) on the built prompts; before any update the policy is
    its reference (a frozen copy of the same weights, or LoRA adapters that start at zero), so both
    decode the same and the sampled k1 KL is 0 on every article."""
    cfg, policy, examples = tiny
    prompts = [policy.build_prompt(e.article) for e in examples]
    by_hand = decode(
        policy.tokenizer, generate(policy.unwrapped, policy.tokenizer, prompts, cfg.generation, greedy=True)
    )
    assert policy.greedy(examples, cfg.generation, 2) == by_hand
    assert policy.reference_greedy(examples, cfg.generation, 2) == by_hand
    kls, samples = policy.sampled_kl(examples, cfg.generation, 2, seed=3)
    assert kls == pytest.approx([0.0] * 3, abs=1e-6) and len(samples) == 3
    assert policy.unwrapped.training  # back in the mode it was in
