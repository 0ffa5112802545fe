"""``device: auto | cpu | cuda`` for the loop, the retriever, SFT and the judges; bf16 master weights and
the autocast cache whatever turns bf16 on (issue: the GPU path made correct, items 9, 10 and 13)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from judgeloop.config import ConfigError, load_config, migrate
from judgeloop.devices import check_device, on_cpu, process_device, resolve_device
from judgeloop.loop.config import FeedbackLoopConfig

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "feedback_loop" / "tiny.yaml"
NO_GPU = not torch.cuda.is_available()


def test_the_old_cpu_switch_is_refused_with_its_replacement():
    with pytest.raises(ConfigError, match="'cpu' is retired; set device: cpu"):
        load_config(FeedbackLoopConfig, TINY, ["cpu=true"])
    assert load_config(FeedbackLoopConfig, TINY).device == "auto"
    # a saved config from before the change still reads back (the retired key is dropped)
    assert "cpu" not in migrate(FeedbackLoopConfig, {"cpu": True, "seed": 3})


def test_bad_device_values_are_config_errors():
    with pytest.raises(ConfigError, match=r"'device' must be one of \['auto', 'cpu', 'cuda'\], got 'gpu'"):
        load_config(FeedbackLoopConfig, TINY, ["device=gpu"])
    with pytest.raises(ConfigError, match="judge.device='cuda:x'"):
        load_config(FeedbackLoopConfig, TINY, ["judge.device=cuda:x"])


@pytest.mark.skipif(not NO_GPU, reason="checks the no-GPU error")
def test_cuda_without_a_gpu_stops_before_any_work(tmp_path):
    from judgeloop.recipes import train

    out = tmp_path / "run"
    cfg = load_config(FeedbackLoopConfig, TINY, ["device=cuda", f"output_dir={out}"])
    with pytest.raises(ConfigError, match=r"device=cuda but torch sees no CUDA GPU.*use device=auto"):
        train(cfg)
    assert not out.exists()  # nothing written
    cfg = load_config(FeedbackLoopConfig, TINY, ["judge.device=cuda", f"output_dir={out}"])
    with pytest.raises(
        ConfigError, match=r"judge.device=cuda but torch sees no CUDA GPU.*use judge.device=auto"
    ):
        train(cfg)
    assert not out.exists()


@pytest.mark.skipif(not NO_GPU, reason="checks the no-GPU error")
def test_one_resolver_for_the_run_and_every_judge_names_the_key():
    assert resolve_device("auto") == torch.device("cpu") and resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(
        ConfigError, match=r"^judges.honest.device=cuda:1 but torch sees no CUDA GPU.*use judges"
    ):
        resolve_device("cuda:1", "judges.honest.device")
    with pytest.raises(ConfigError, match=r"^device=cuda but torch sees no CUDA GPU"):
        check_device("cuda")  # the run's device: the same check after the auto/cpu/cuda one


@pytest.mark.slow
@pytest.mark.skipif(not NO_GPU, reason="checks the no-GPU error")
@pytest.mark.parametrize(
    "command,config", [("train-retriever", "retriever/scifact.yaml"), ("sft", "raft/sft_pubmedqa.yaml")]
)
def test_cuda_without_a_gpu_is_a_one_line_error_for_every_trainer(tmp_path, command, config):
    out = tmp_path / "out"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "judgeloop.cli",
            command,
            "--config",
            str(ROOT / "configs" / config),
            "device=cuda",
            f"output_dir={out}",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert "device=cuda but torch sees no CUDA GPU" in last and "use device=auto" in last
    assert "Traceback" not in proc.stderr and not out.exists()


def test_auto_follows_the_run_and_cuda_means_this_process_gpu():
    class Run:  # what process_device reads of an Accelerator
        def __init__(self, device: str, n: int):
            self.device, self.num_processes = torch.device(device), n

    assert process_device("auto", Run("cpu", 1)) == "cpu"
    assert process_device("auto", Run("cpu:0", 2)) == "cpu"  # what a 2-process CPU run reports
    assert process_device("cpu", Run("cuda:3", 8)) == "cpu"
    assert process_device("auto", Run("cuda:3", 8)) == "cuda:3"
    assert process_device("cuda", Run("cuda:3", 8)) == "cuda:3"
    assert process_device("cuda:0", Run("cuda:3", 8)) == "cuda:3"  # never every process on GPU 0
    assert process_device("cuda:1", Run("cuda:0", 1)) == "cuda:1"  # one process: as asked
    assert on_cpu("cpu") and on_cpu("auto") == NO_GPU
    check_device("auto")
    check_device("cpu")


def test_bf16_policy_keeps_float32_master_weights_and_trains_at_a_small_lr():
    """policy.dtype=bfloat16: the trained weights stay float32 (AdamW at lr 1e-6 on bf16 weights loses
    almost every update), the frozen weights are bf16; frozen_fp32 (FSDP) keeps every weight float32."""
    from judgeloop.loop.policy import load_policy
    from judgeloop.loop.setup import make_optimizer

    cfg = load_config(
        FeedbackLoopConfig, TINY, ["policy.dtype=bfloat16", "policy.sft_steps=0", "optim.learning_rate=1e-6"]
    )
    model, tok, ref = load_policy(cfg.policy, 0)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert {p.dtype for p in ref.parameters()} == {torch.bfloat16}
    before = [p.detach().clone() for p in model.parameters()]
    opt, _ = make_optimizer(model, cfg)
    ids = torch.randint(10, 500, (2, 12))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(input_ids=ids).logits.float().logsumexp(-1).mean()
    loss.backward()
    opt.step()
    changed = sum(int((a != p.detach()).sum()) for a, p in zip(before, model.parameters()))
    total = sum(a.numel() for a in before)
    assert changed / total > 0.5, f"only {changed}/{total} weights moved"
    # the same update on bf16 weights: most of it is lost to rounding (the bug this guards against)
    bf = [a.to(torch.bfloat16) for a in before]
    stepped = [(a.float() + 1e-6 * torch.sign(torch.randn_like(a.float()))).to(torch.bfloat16) for a in bf]
    assert sum(int((a != s).sum()) for a, s in zip(bf, stepped)) / total < 0.2

    lora = load_config(
        FeedbackLoopConfig, TINY, ["policy.dtype=bfloat16", "policy.sft_steps=0", "policy.lora=true"]
    )
    model, _, ref = load_policy(lora.policy, 0)
    assert ref is None
    dtypes = {n: p.dtype for n, p in model.named_parameters()}
    assert {d for n, d in dtypes.items() if "lora_" in n} == {torch.float32}
    assert {d for n, d in dtypes.items() if "lora_" not in n} == {torch.bfloat16}
    model, _, _ = load_policy(lora.policy, 0, frozen_fp32=True)
    assert {p.dtype for p in model.parameters()} == {torch.float32}


CACHE_PROBE = r"""
import sys, torch
from judgeloop.config import load_config
from judgeloop.loop.config import FeedbackLoopConfig
from judgeloop.loop.setup import make_accelerator
cfg = load_config(FeedbackLoopConfig, sys.argv[1], sys.argv[3:])
acc = make_accelerator(cfg, __import__("pathlib").Path(sys.argv[2]))
with acc.autocast():
    print(acc.mixed_precision, torch.is_autocast_enabled("cpu"), torch.is_autocast_cache_enabled())
"""


@pytest.mark.slow
@pytest.mark.parametrize(
    "env,overrides",
    [
        ({"ACCELERATE_MIXED_PRECISION": "bf16"}, []),  # what a launch file's mixed_precision: bf16 sets
        ({}, ["mixed_precision=bf16"]),
        ({}, ["policy.dtype=bfloat16"]),
    ],
)
def test_the_autocast_cache_is_off_whatever_turns_bf16_on(tmp_path, env, overrides):
    """The loop runs in one autocast context across optimizer steps; with the weight-cast cache on, every
    forward would use the trainable weights as first cast. It must be off when bf16 comes from a launch
    file too (every shipped one sets mixed_precision: bf16)."""
    proc = subprocess.run(
        [sys.executable, "-c", CACHE_PROBE, str(TINY), str(tmp_path), "device=cpu", *overrides],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **env},
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["bf16", "True", "False"]


def test_generation_autocast_off_reaches_a_prepared_model():
    """accelerate's prepare wraps a model's forward in its own autocast under bf16; generation.autocast=
    false must still decode in float32 (and true in bf16)."""
    import dataclasses

    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    from judgeloop.loop.rollout import generate
    from judgeloop.loop.setup import mixed_precision_kwargs
    from judgeloop.models import load_causal_lm, load_tokenizer

    cfg = load_config(FeedbackLoopConfig, TINY, ["generation.max_new_tokens=3"])
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    try:
        acc = Accelerator(cpu=True, **mixed_precision_kwargs("bf16"))
        model = acc.prepare(load_causal_lm(cfg.policy.model))
        tok = load_tokenizer(cfg.policy.model)
        seen: list[torch.dtype] = []
        inner = acc.unwrap_model(model)
        inner.lm_head.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
        with acc.autocast():
            for on in (False, True):
                gen = dataclasses.replace(cfg.generation, autocast=on)
                generate(inner, tok, [[5, 6, 7, 8]], gen, greedy=True)
                assert set(seen) == {torch.bfloat16 if on else torch.float32}, (on, seen)
                seen.clear()
        assert "forward" in inner.__dict__  # the prepared wrapper is back in place afterwards
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()


def test_a_chunked_update_equals_the_whole_batch_update():
    """optim.update_chunk_size runs the update's passes a few articles at a time; the gradients add up to
    the whole-batch update (up to float summation order), and so do the logged statistics."""
    import copy

    from accelerate import Accelerator

    from judgeloop.loop.rollout import Rollout
    from judgeloop.loop.steps import Learner, PairBatch, policy_update
    from judgeloop.models import load_causal_lm
    from loop_common import tiny_policy

    cfg = load_config(FeedbackLoopConfig, TINY, ["loss.kl_coef=0.2"])
    g = torch.Generator().manual_seed(0)

    def seq(lo: int, hi: int) -> list[int]:
        return torch.randint(10, 900, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g).tolist()

    n = 5
    prompts, a, b = (
        [seq(4, 9) for _ in range(n)],
        [seq(2, 6) + [2] for _ in range(n)],
        [seq(2, 6) + [2] for _ in range(n)],
    )
    roll = Rollout(["x"] * n, prompts, a, b, ["a"] * n, ["b"] * n)
    base = load_causal_lm("judgeloop-tiny/causal-lm")
    ref = copy.deepcopy(base).eval()
    with torch.no_grad():
        for q in base.parameters():
            q.add_(0.02 * torch.randn(q.shape, generator=g))
    acc = Accelerator(cpu=True)
    results = {}
    for chunk in (None, 2, 1):
        model = copy.deepcopy(base).train()
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0)
        learner = Learner(tiny_policy(acc, model, ref), opt, sched, cfg.loss, 1.0, chunk)
        batch = PairBatch(
            1,
            [],
            rollout=roll,
            targets=torch.tensor([0.9, 0.2, 0.7, 0.4, 0.5]),
            mask=torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0]),
        )
        stats = policy_update(learner, batch, 0.2)
        results[chunk] = ({k: v.detach().clone() for k, v in model.state_dict().items()}, stats)
    whole, whole_stats = results[None]
    for chunk in (2, 1):
        params, stats = results[chunk]
        for k in whole:
            torch.testing.assert_close(params[k], whole[k], atol=1e-6, rtol=1e-5, msg=k)
        for k in whole_stats:
            assert stats[k] == pytest.approx(whole_stats[k], rel=1e-4, abs=1e-6), (chunk, k)
    assert any(not torch.equal(whole[k], base.state_dict()[k]) for k in whole)  # the update moved weights


@pytest.mark.parametrize(
    "overrides, shared",
    [
        ([], True),
        (["policy.dtype=bfloat16"], False),
        (["mixed_precision=bf16"], False),
        (["mixed_precision=bf16", "generation.autocast=true"], True),
        (["optim.share_prompt_pass=false"], False),
    ],
)
def test_the_prompt_pass_is_shared_only_at_one_precision(overrides, shared):
    """optim.share_prompt_pass is dropped where generation and update would run at different precisions:
    a bf16 frozen base turns the run's bf16 autocast on (as mixed_precision=bf16 does) while generation
    leaves it, unless generation.autocast."""
    from accelerate.state import AcceleratorState, GradientState

    from judgeloop.loop.setup import make_accelerator, shares_prompt_pass
    from judgeloop.models import load_causal_lm

    cfg = load_config(FeedbackLoopConfig, TINY, ["device=cpu", *overrides])
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    try:
        acc = make_accelerator(cfg, Path("unused"))
        assert shares_prompt_pass(cfg, acc, acc.prepare(load_causal_lm(cfg.policy.model))) is shared
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
