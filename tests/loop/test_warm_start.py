"""The policy's SFT warm start (judgeloop.loop.policy.load_policy): reused in one process only at its numerics."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def warmups(monkeypatch):
    """The thread counts the SFT warm-up ran at, with the in-process warm-start cache emptied before and
    after (it holds one entry, which other tests' runs would otherwise meet)."""
    from judgeloop.loop import policy

    calls: list[int] = []
    real = policy.sft_warmup

    def counted(*args, **kwargs):
        calls.append(torch.get_num_threads())
        return real(*args, **kwargs)

    monkeypatch.setattr(policy, "sft_warmup", counted)
    policy._SFT_CACHE.clear()
    yield calls
    policy._SFT_CACHE.clear()


def test_a_warm_start_is_reused_in_one_process_only_at_the_numerics_it_was_made_with(warmups):
    """Issue 54: the in-process warm-start cache was keyed by the settings and the data alone. A run at
    2 threads (a test at the machine's default) then one at threads=1 in the same process started from
    the 2-thread warm start, which differs from a fresh process's 1-thread one by float rounding (on
    some machines: measured on 3 and 16 threads here, not on 2); the resume tests compared such a run
    with a child process's and failed at rel 2.6e-5. Now another thread count or another autocast
    warms up again, and the same numerics still share it."""
    from judgeloop.devices import intra_op_threads
    from judgeloop.loop.config import PolicyConfig
    from judgeloop.loop.policy import load_policy
    from judgeloop.models import load_tokenizer

    cfg = PolicyConfig(model="judgeloop-tiny/causal-lm", sft_steps=2, sft_batch_size=2)
    tok = load_tokenizer(cfg.model)
    articles = ["the council met and voted today.", "rain is expected over the weekend.", "a cat sat."]
    sft = ([tok.encode(f"Summarize: {a}") for a in articles], ["the council voted", "rain soon", "a cat"])

    def warm(threads: int, autocast: bool = False) -> dict[str, torch.Tensor]:
        with intra_op_threads(threads), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            model, _, _ = load_policy(cfg, 0, sft, lean_cpu=True)
        return model.state_dict()

    at_two = warm(2)
    assert warmups == [2]
    again = warm(2)  # the same numerics: shared, as the ablation's arms share it
    assert warmups == [2] and all(torch.equal(again[k], at_two[k]) for k in at_two)
    at_one = warm(1)
    assert warmups == [2, 1]  # not the 2-thread warm start
    warm(1, autocast=True)
    assert warmups == [2, 1, 1]  # nor the fp32 one under bf16 autocast
    from judgeloop.loop import policy

    policy._SFT_CACHE.clear()
    fresh = warm(1)  # what a fresh process at threads=1 starts from
    assert all(torch.equal(fresh[k], at_one[k]) for k in fresh)
