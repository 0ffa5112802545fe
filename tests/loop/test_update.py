"""Step 5's shared skeleton (judgeloop.loop.update): the DPO and the GRPO update run one chunked update."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch


def _rollout(n: int, k: int):
    from judgeloop.loop.rollout import Rollout

    g = torch.Generator().manual_seed(0)

    def seq(lo: int, hi: int, end: list[int]) -> list[int]:
        length = int(torch.randint(lo, hi, (1,), generator=g))
        return torch.randint(10, 900, (length,), generator=g).tolist() + end

    prompts = [seq(4, 9, []) for _ in range(n)]
    samples = [[seq(2, 6, [2]) for _ in range(n)] for _ in range(k)]
    more_text = [["c"] * n for _ in samples[2:]]
    a, b, more = samples[0], samples[1], samples[2:]
    return Rollout(["x"] * n, prompts, a, b, ["a"] * n, ["b"] * n, more_ids=more, more_text=more_text)


@pytest.mark.parametrize("loss_type", ["dpo", "grpo"])
def test_both_updates_backpropagate_each_chunk_under_no_sync_but_the_last(loss_type, monkeypatch):
    """Five articles two at a time: three chunks, the first two backward passes under ``no_sync`` (DDP
    all-reduces the gradients once per step), then one optimizer step; the stats carry the objective's names."""
    from accelerate import Accelerator

    from judgeloop.loop.config import LossConfig
    from judgeloop.loop.losses import group_advantages
    from judgeloop.loop.steps import Learner, PairBatch, policy_update
    from judgeloop.models import load_causal_lm
    from loop_common import tiny_policy

    acc = Accelerator(cpu=True)
    model = load_causal_lm("judgeloop-tiny/causal-lm").train()
    ref = copy.deepcopy(model).eval()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0)
    model, opt, sched = acc.prepare(model, opt, sched)
    calls: list[str] = []
    real_no_sync, real_backward, real_step = acc.no_sync, acc.backward, opt.step

    @contextlib.contextmanager
    def no_sync(m):
        calls.append("no_sync")
        with real_no_sync(m):
            yield

    monkeypatch.setattr(acc, "no_sync", no_sync)
    monkeypatch.setattr(acc, "backward", lambda loss: (calls.append("backward"), real_backward(loss)))
    monkeypatch.setattr(opt, "step", lambda *a, **kw: (calls.append("step"), real_step(*a, **kw)))
    k = 4 if loss_type == "grpo" else 2
    batch = PairBatch(1, [], rollout=_rollout(5, k))
    if loss_type == "grpo":
        batch.rewards = torch.rand(5, k, generator=torch.Generator().manual_seed(1))
        batch.mask = torch.ones(5, k)
        batch.advantages = group_advantages(batch.rewards, batch.mask.bool(), "group")
    else:
        batch.targets, batch.mask = torch.tensor([0.9, 0.1, 0.7, 0.5, 0.3]), torch.ones(5)
    learner = Learner(
        tiny_policy(acc, model, ref), opt, sched, LossConfig(type=loss_type, beta=0.1), 1.0, chunk_size=2
    )
    stats = policy_update(learner, batch, 0.1)
    assert calls == ["no_sync", "backward", "no_sync", "backward", "backward", "step"]
    objective = "grpo_loss" if loss_type == "grpo" else "dpo_loss"
    assert {"loss", objective, "kl", "kl_k1", "kept_fraction", "grad_norm"} <= set(stats)
    assert stats["kept_fraction"] == 1.0
