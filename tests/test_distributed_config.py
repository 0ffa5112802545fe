"""The DeepSpeed settings the loop and the retriever fill before ``prepare`` (they pass no DataLoader, so
accelerate cannot infer them), GradCache refused under DeepSpeed, and checkpoint pruning.

These tests build accelerate's real ``DeepSpeedPlugin`` from the shipped launch files' settings, which
is what ``accelerate launch`` hands the ``Accelerator``, and check what the library writes into it; the
2-process ZeRO-2 / ZeRO-3 runs themselves are in ``tests/test_deepspeed.py``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from accelerate.utils import DeepSpeedPlugin

from judgeloop.checkpointing import prune_checkpoints
from judgeloop.config import ConfigError
from judgeloop.distributed import (
    check_launch,
    configure_deepspeed,
    inference_ds_config,
    prepare_for_inference,
    refuse_gradcache_under_deepspeed,
)

ROOT = Path(__file__).resolve().parents[1]


def _launch(name: str, **overrides) -> SimpleNamespace:
    """An accelerator-like view of a shipped DeepSpeed launch file: its plugin and process count."""
    launch = yaml.safe_load((ROOT / "configs" / "accelerate" / name).read_text())
    ds = {**launch["deepspeed_config"], **overrides}
    plugin = DeepSpeedPlugin(
        zero_stage=ds["zero_stage"],
        gradient_accumulation_steps=ds["gradient_accumulation_steps"],
        gradient_clipping=ds.get("gradient_clipping"),
        zero3_init_flag=ds.get("zero3_init_flag", False),
    )
    return SimpleNamespace(
        state=SimpleNamespace(deepspeed_plugin=plugin), num_processes=launch["num_processes"]
    )


@pytest.mark.parametrize("name", ["deepspeed_zero2.yaml", "deepspeed_zero3.yaml"])
def test_the_micro_batch_is_set_from_the_config_before_prepare(name):
    acc = _launch(name)
    ds = acc.state.deepspeed_plugin.deepspeed_config
    assert ds["train_micro_batch_size_per_gpu"] == "auto"  # what accelerate would refuse without a loader
    configure_deepspeed(acc, micro_batch_size=8, max_grad_norm=1.0, key="optim.max_grad_norm")
    assert ds["train_micro_batch_size_per_gpu"] == 8
    assert ds["train_batch_size"] == 8 * acc.num_processes * ds["gradient_accumulation_steps"]
    assert ds["gradient_clipping"] == 1.0


def test_a_different_gradient_clipping_is_an_error_naming_both():
    acc = _launch("deepspeed_zero2.yaml", gradient_clipping=1.0)  # an explicit value in a launch file
    with pytest.raises(ConfigError, match=r"gradient_clipping=1.0 differs from optim.max_grad_norm=0.5"):
        configure_deepspeed(acc, micro_batch_size=8, max_grad_norm=0.5, key="optim.max_grad_norm")
    auto = _launch("deepspeed_zero2.yaml", gradient_clipping="auto")
    configure_deepspeed(auto, micro_batch_size=4, max_grad_norm=0.5, key="optim.max_grad_norm")
    assert auto.state.deepspeed_plugin.deepspeed_config["gradient_clipping"] == 0.5


@pytest.mark.parametrize("name", ["deepspeed_zero2.yaml", "deepspeed_zero3.yaml"])
def test_the_shipped_files_take_max_grad_norm_and_write_clipping_off_out(name):
    acc = _launch(name)  # gradient_clipping: auto
    configure_deepspeed(acc, micro_batch_size=2, max_grad_norm=0.0, key="optim.max_grad_norm")
    # written out: a config without gradient_clipping makes DeepSpeed clip at 1.0
    assert acc.state.deepspeed_plugin.deepspeed_config["gradient_clipping"] == 0.0


def test_a_launch_gradient_clipping_of_zero_is_not_dropped(monkeypatch):
    """``accelerate launch --use_deepspeed --gradient_clipping 0``: accelerate up to 1.1x left the key out of
    the DeepSpeed config (0 is falsy there) and kept it on the plugin; later versions (1.16 here) write
    0.0. Either way a 0 must not become max_grad_norm silently, and it reaches DeepSpeed as 0.0."""
    monkeypatch.setenv("ACCELERATE_GRADIENT_CLIPPING", "0")
    plugin = DeepSpeedPlugin(zero_stage=2)
    assert plugin.deepspeed_config.get("gradient_clipping", 0.0) == 0.0 and plugin.gradient_clipping == 0.0
    acc = SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=plugin), num_processes=2)
    with pytest.raises(ConfigError, match=r"gradient_clipping=0.0 differs from train.max_grad_norm=1.0"):
        configure_deepspeed(acc, micro_batch_size=2, max_grad_norm=1.0, key="train.max_grad_norm")
    configure_deepspeed(acc, micro_batch_size=2, max_grad_norm=0.0, key="train.max_grad_norm")
    assert plugin.deepspeed_config["gradient_clipping"] == 0.0


def test_a_bare_deepspeed_launch_takes_max_grad_norm(monkeypatch):
    monkeypatch.delenv("ACCELERATE_GRADIENT_CLIPPING", raising=False)
    plugin = DeepSpeedPlugin(zero_stage=3)  # what `--use_deepspeed --zero_stage 3` builds
    acc = SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=plugin), num_processes=2)
    configure_deepspeed(acc, micro_batch_size=2, max_grad_norm=0.25, key="optim.max_grad_norm")
    assert plugin.deepspeed_config["gradient_clipping"] == 0.25


def test_a_second_run_in_the_same_process_fills_from_the_launch_not_from_the_first_run(monkeypatch):
    """The ablation's jobs (and the test workers) share accelerate's plugin: the first run's fill is not
    the launch's value (a second max_grad_norm was refused as differing from the first's)."""
    monkeypatch.delenv("ACCELERATE_GRADIENT_CLIPPING", raising=False)
    plugin = DeepSpeedPlugin(zero_stage=2)
    acc = SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=plugin), num_processes=2)
    configure_deepspeed(acc, micro_batch_size=2, max_grad_norm=1.0, key="optim.max_grad_norm")
    configure_deepspeed(acc, micro_batch_size=3, max_grad_norm=0.3, key="optim.max_grad_norm")
    ds = plugin.deepspeed_config
    assert ds["gradient_clipping"] == 0.3 and ds["train_micro_batch_size_per_gpu"] == 3
    assert ds["train_batch_size"] == 6


def test_on_a_cpu_a_deepspeed_launch_gets_gloo(monkeypatch):
    from judgeloop.distributed import accelerator_kwargs

    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    kw = accelerator_kwargs(cpu=True)
    assert kw["cpu"] is False and kw["kwargs_handlers"][0].backend == "gloo"
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "false")
    assert accelerator_kwargs(cpu=True) == {"cpu": True, "kwargs_handlers": []}


def test_outside_deepspeed_nothing_changes():
    plain = SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=None), num_processes=2)
    configure_deepspeed(plain, micro_batch_size=8, max_grad_norm=1.0, key="optim.max_grad_norm")
    refuse_gradcache_under_deepspeed(plain, chunk_size=16)
    model = object()
    assert prepare_for_inference(model, plain) is model


def test_gradcache_is_refused_under_deepspeed():
    acc = _launch("deepspeed_zero2.yaml")
    with pytest.raises(ConfigError, match="train.gradcache_chunk_size=16 cannot run under DeepSpeed"):
        refuse_gradcache_under_deepspeed(acc, chunk_size=16)
    refuse_gradcache_under_deepspeed(acc, chunk_size=0)


def test_the_inference_config_of_a_zero3_judge():
    acc = _launch("deepspeed_zero3.yaml")
    configure_deepspeed(acc, micro_batch_size=8, max_grad_norm=1.0, key="optim.max_grad_norm")
    train = acc.state.deepspeed_plugin.deepspeed_config
    cfg = inference_ds_config({**train, "optimizer": {"type": "AdamW"}}, hidden_size=1536)
    assert "optimizer" not in cfg and "train_batch_size" not in cfg
    assert cfg["zero_optimization"]["stage"] == 3
    assert cfg["zero_optimization"]["stage3_param_persistence_threshold"] == 15360
    assert train["zero_optimization"].get("stage3_param_persistence_threshold") != 15360  # not mutated


def test_the_inference_config_of_a_flags_only_zero3_launch(monkeypatch):
    """``--use_deepspeed --zero_stage 3`` with no launch file: accelerate leaves the accumulation (and
    the batch sizes) ``auto``, and the reference and judge engines are built before ``configure_deepspeed``
    fills them; DeepSpeed multiplied the string into its batch size (a TypeError) until it was set to 1."""
    monkeypatch.delenv("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", raising=False)
    plugin = DeepSpeedPlugin(zero_stage=3)  # what the launcher's flags alone give
    train = plugin.deepspeed_config
    assert train["gradient_accumulation_steps"] == "auto" and train["train_batch_size"] == "auto"
    cfg = inference_ds_config(train, hidden_size=None)
    assert cfg["gradient_accumulation_steps"] == 1 and cfg["train_micro_batch_size_per_gpu"] == 1
    assert "train_batch_size" not in cfg and train["gradient_accumulation_steps"] == "auto"  # not mutated


def _launched(monkeypatch, **env: str) -> None:
    """The variables ``accelerate launch`` sets for these flags (and no others from this shell)."""
    import os

    for k in [k for k in os.environ if k.startswith("ACCELERATE_")]:
        monkeypatch.delenv(k)
    for k, v in env.items():
        monkeypatch.setenv(f"ACCELERATE_{k}", v)


def test_a_flags_only_launch_passes_the_check_and_a_differing_one_is_refused_naming_the_flag(monkeypatch):
    """``check_launch`` reads the launch before any work (the real runs: tests/test_deepspeed.py)."""
    _launched(monkeypatch, USE_DEEPSPEED="true", DEEPSPEED_ZERO_STAGE="3", MIXED_PRECISION="no")
    check_launch(2, "batch_size", 1.0, "optim.max_grad_norm")  # gradient_clipping auto: max_grad_norm
    _launched(monkeypatch, USE_DEEPSPEED="true", DEEPSPEED_ZERO_STAGE="2", GRADIENT_CLIPPING="0.5")
    with pytest.raises(ConfigError) as err:
        check_launch(2, "batch_size", 1.0, "optim.max_grad_norm")
    assert str(err.value) == (
        "the launch's gradient_clipping=0.5 differs from optim.max_grad_norm=1.0; DeepSpeed clips with its "
        "own value: launch with --gradient_clipping 1.0 (or leave it out), or set optim.max_grad_norm=0.5"
    )
    check_launch(2, "batch_size", 0.5, "optim.max_grad_norm")
    _launched(monkeypatch, USE_DEEPSPEED="true", GRADIENT_CLIPPING="0")  # 0 is a value, not "unset"
    with pytest.raises(ConfigError, match="gradient_clipping=0.0 differs"):
        check_launch(2, "batch_size", 1.0, "optim.max_grad_norm")
    check_launch(2, "batch_size", 0.0, "optim.max_grad_norm")


@pytest.mark.parametrize(
    "env, expect",
    [
        ({"USE_DEEPSPEED": "true", "GRADIENT_ACCUMULATION_STEPS": "2"}, "--gradient_accumulation_steps 1"),
        (
            {"USE_DEEPSPEED": "true", "DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "cpu"},
            "without --offload_optimizer",
        ),
        (
            {"USE_DEEPSPEED": "true", "DEEPSPEED_OFFLOAD_PARAM_DEVICE": "cpu", "DEEPSPEED_ZERO_STAGE": "3"},
            "without --offload_param",
        ),
        ({"MIXED_PRECISION": "fp16"}, "--mixed_precision no or bf16"),
        ({"GRADIENT_ACCUMULATION_STEPS": "4"}, "--gradient_accumulation_steps 1"),
    ],
)
def test_launches_that_cannot_equal_one_process_are_refused(monkeypatch, env, expect):
    _launched(monkeypatch, **env)
    with pytest.raises(ConfigError, match=re.escape(expect)):
        check_launch(2, "batch_size", 1.0, "optim.max_grad_norm")


def test_a_deepspeed_config_file_is_named_in_the_refusal(monkeypatch, tmp_path):
    ds = {
        "zero_optimization": {"stage": 2},
        "gradient_clipping": 2.0,
        "train_micro_batch_size_per_gpu": "auto",
    }
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds))
    _launched(monkeypatch, USE_DEEPSPEED="true", DEEPSPEED_CONFIG_FILE=str(path))
    with pytest.raises(ConfigError, match=f"in the DeepSpeed config file {re.escape(str(path))}.*auto there"):
        check_launch(2, "batch_size", 1.0, "optim.max_grad_norm")
    path.write_text(json.dumps({**ds, "gradient_clipping": "auto", "gradient_accumulation_steps": 3}))
    with pytest.raises(ConfigError, match="gradient_accumulation_steps: 1 there"):
        check_launch(2, "batch_size", 1.0, "optim.max_grad_norm")
    path.write_text(json.dumps({**ds, "gradient_clipping": "auto", "train_micro_batch_size_per_gpu": 8}))
    with pytest.raises(ConfigError, match=r"train_micro_batch_size_per_gpu=8 .* differs from batch_size=2"):
        check_launch(2, "batch_size", 1.0, "optim.max_grad_norm")
    monkeypatch.setenv("WORLD_SIZE", "2")  # what torchrun sets
    path.write_text(json.dumps({**ds, "gradient_clipping": "auto", "train_batch_size": 8}))
    with pytest.raises(ConfigError, match=r"train_batch_size=8 .* is not batch_size=2 x 2 process\(es\) = 4"):
        check_launch(2, "batch_size", 1.0, "optim.max_grad_norm")
    path.write_text(json.dumps({**ds, "gradient_clipping": "auto", "train_batch_size": 4}))
    check_launch(2, "batch_size", 1.0, "optim.max_grad_norm")


def test_pruning_keeps_the_newest_checkpoints(tmp_path):
    for step in (2, 10, 4, 8):
        (tmp_path / f"step_{step}").mkdir()
    removed = prune_checkpoints(tmp_path, keep=2)
    assert sorted(p.name for p in removed) == ["step_2", "step_4"]  # by step number, not by name
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_10", "step_8"]
    assert prune_checkpoints(tmp_path, keep=None) == []


def test_the_fsdp_launch_file_is_fsdp2_and_accelerate_accepts_its_settings():
    from accelerate.utils import FullyShardedDataParallelPlugin

    launch = yaml.safe_load((ROOT / "configs" / "accelerate" / "fsdp.yaml").read_text())
    fsdp = launch["fsdp_config"]
    assert launch["distributed_type"] == "FSDP" and fsdp["fsdp_version"] == 2
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=fsdp["fsdp_version"],
        reshard_after_forward=fsdp["fsdp_reshard_after_forward"],
        auto_wrap_policy=fsdp["fsdp_auto_wrap_policy"].lower(),
        state_dict_type=fsdp["fsdp_state_dict_type"],
        cpu_offload=fsdp["fsdp_offload_params"],
        cpu_ram_efficient_loading=fsdp["fsdp_cpu_ram_efficient_loading"],
    )
    assert plugin.fsdp_version == 2 and plugin.reshard_after_forward is True


def test_a_run_after_another_in_the_same_process_gets_its_own_precision():
    """train-retriever at bf16 then train (which passes no mixed_precision for fp32) in one process: the
    second run's Accelerator must not inherit bf16 from accelerate's process-wide state."""
    from judgeloop.distributed import new_accelerator

    first = new_accelerator(cpu=True, mixed_precision="bf16")
    assert first.mixed_precision == "bf16"
    second = new_accelerator(cpu=True)
    assert second.mixed_precision == "no"
    assert new_accelerator(cpu=True, mixed_precision="bf16").mixed_precision == "bf16"  # no refusal either


@pytest.mark.slow
def test_a_run_releases_its_process_group_at_exit(tmp_path):
    """The process group is destroyed at interpreter exit, before finalization (a gloo group left alive
    aborted one rank of a 2-process DeepSpeed run in CI: "terminate called without an active exception").
    A real gloo group and a real accelerator in a fresh process; the exit hook registered first runs last
    and sees the group already gone."""
    import subprocess
    import sys

    script = tmp_path / "run.py"
    script.write_text(
        "import atexit, torch.distributed as dist\n"
        "atexit.register(lambda: print('group alive at exit:', dist.is_initialized(), flush=True))\n"
        f"dist.init_process_group('gloo', init_method='file://{tmp_path / 'store'}', rank=0, world_size=1)\n"
        "from judgeloop.distributed import new_accelerator\n"
        "acc = new_accelerator(cpu=True)\n"
        "print('group alive after the run:', dist.is_initialized(), flush=True)\n"
    )
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "group alive after the run: True" in res.stdout
    assert "group alive at exit: False" in res.stdout
