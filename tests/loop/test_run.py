"""A run of the loop end to end (the recipe, judgeloop.loop.setup / run): config checks before any work, judge prefetch, early stopping, the recipe vs judgeloop train."""

from __future__ import annotations

import json
import re

import pytest
import torch

from judgeloop.config import ConfigError, load_config
from judgeloop.loop.config import FeedbackLoopConfig
from judgeloop.studies.ablation_config import AblateConfig
from loop_common import FAST, ROOT, TINY, same_row


def test_gpu_recipe_config_validates():
    cfg = load_config(FeedbackLoopConfig, ROOT / "configs" / "feedback_loop" / "gpu_qwen.yaml")
    assert cfg.device == "cuda" and cfg.policy.model == "Qwen/Qwen2.5-0.5B-Instruct"
    assert cfg.data.name == "cnn_dailymail"
    assert cfg.judge.type == "choice" and cfg.early_stopping_patience > 0


def test_config_errors_name_the_parameter():
    with pytest.raises(ConfigError, match="did you mean 'loss.kl_coef'"):
        load_config(FeedbackLoopConfig, TINY, ["loss.kl_cof=0.1"])
    with pytest.raises(ConfigError, match="ablation.arms has unknown arm"):  # judgeloop ablate's schema
        load_config(AblateConfig, TINY, ["ablation.arms=[raw,calibrated]"])
    with pytest.raises(ConfigError, match="needs a validation split"):
        load_config(FeedbackLoopConfig, TINY, ["early_stopping_patience=2", "data.split.validation=0.0"])
    with pytest.raises(ConfigError, match="loss.margin"):
        load_config(FeedbackLoopConfig, TINY, ["loss.margin=0.7"])


@pytest.mark.parametrize(
    ("override", "match"),
    [
        ("num_validation_articles=0", "but num_validation_articles=0; set num_validation_articles=16"),
        ("data.split.validation=0.001", "the 'validation' split is empty; use more articles"),
    ],
)
@pytest.mark.parametrize("keeper", ["early_stopping_patience=1", "alarms.action=stop"])
def test_keeping_the_best_policy_without_validation_articles_is_refused_before_any_step(
    tmp_path, override, match, keeper
):
    """Early stopping (or an alarm that stops) with no validation article ran every step and then failed
    on a missing best_policy/; now one line before any work."""
    from judgeloop.recipes import train

    alarm = ["alarms.every_n_steps=2", "alarms.signals=[rouge]"] if keeper.startswith("alarms") else []
    with pytest.raises(ConfigError, match=re.escape(match)) as err:
        train(
            load_config(FeedbackLoopConfig, TINY, [*FAST, f"output_dir={tmp_path}", keeper, *alarm, override])
        )
    assert "\n" not in str(err.value) and keeper.split("=")[0] in str(err.value)
    assert not (tmp_path / "metrics.jsonl").exists()


@pytest.mark.slow
def test_judge_prefetch_changes_nothing_but_timing(tmp_path):
    """The next batch's article embeddings computed on a background thread give the same run.

    Run on one intra-op thread, so that no core split happens and the comparison can be exact: with
    several threads the split gives the policy fewer threads, which changes float rounding only.
    """
    from judgeloop.recipes import train

    cached = [o for o in FAST if not o.startswith("judge.cache_size")] + [
        "max_steps=3",
        "eval_every_n_steps=0",
    ]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        runs = {
            on: train(
                load_config(
                    FeedbackLoopConfig,
                    TINY,
                    [*cached, f"output_dir={tmp_path / str(on)}", f"judge_prefetch={on}"],
                )
            )
            for on in (True, False)
        }
    finally:
        torch.set_num_threads(threads)
    assert runs[True]["steps_run"] == runs[False]["steps_run"] == 3
    for r, f in zip(runs[True]["train_log"], runs[False]["train_log"], strict=True):
        same_row(r, f)
    same_row(runs[True]["final"], runs[False]["final"])


def test_judge_prefetch_auto_rule_and_core_split():
    """Auto is off for a CPU judge; when on, the CPU cores are split between the judge thread and the
    caller while the judge thread works, and the caller gets every core back when it waits or closes."""
    from judgeloop.judges import build_judge
    from judgeloop.loop.prefetch import JudgePrefetch

    threads_before = torch.get_num_threads()
    cfg = load_config(FeedbackLoopConfig, TINY, [o for o in FAST if not o.startswith("judge.cache_size")])
    judge = build_judge(cfg.judge)
    no_cache = build_judge(load_config(FeedbackLoopConfig, TINY, FAST).judge)  # judge.cache_size=0
    assert not no_cache.can_prepare and JudgePrefetch(no_cache, True)._pool is None  # nothing would survive
    assert torch.get_num_threads() == threads_before
    auto = JudgePrefetch(judge)
    assert auto._pool is None
    auto.close()
    from judgeloop.loop.state import load_splits

    batch = load_splits(cfg).train[:2]
    threads = torch.get_num_threads()
    torch.set_num_threads(4)  # a 4-core split, whatever this machine has: thread counts are only settings
    try:
        on = JudgePrefetch(judge, True)
        try:
            assert on._pool is not None and torch.get_num_threads() == 4  # nothing pending yet
            on.start(batch)
            assert torch.get_num_threads() == 2  # the caller's half while the judge thread works
            assert on._pool.submit(torch.get_num_threads).result() == 2  # the judge thread's half
            on.wait()
            assert torch.get_num_threads() == 4  # the judge call itself gets every core
            on.start(batch)
        finally:
            on.close()
        assert torch.get_num_threads() == 4
        three = JudgePrefetch(judge, True, threads=3)
        try:
            three.start(batch)
            assert torch.get_num_threads() == 1
            assert three._pool.submit(torch.get_num_threads).result() == 3
        finally:
            three.close()
        assert torch.get_num_threads() == 4
    finally:
        torch.set_num_threads(threads)


def test_early_stopping_unit(tmp_path):
    """Patience counts evaluations without improvement; the best policy is saved when validation improves."""
    from accelerate import Accelerator

    from judgeloop.loop.evaluation import early_stopping
    from judgeloop.loop.state import LoopState
    from judgeloop.models import load_causal_lm

    acc = Accelerator(cpu=True)
    model = load_causal_lm("judgeloop-tiny/causal-lm")
    out = tmp_path
    cfg = load_config(FeedbackLoopConfig, TINY, [f"output_dir={out}", "early_stopping_patience=2"])
    state = LoopState()
    decisions = [
        early_stopping({"val_rouge_l_neutral": v, "step": s}, state, cfg, acc, model)
        for s, v in [(0, 0.10), (2, 0.20), (4, 0.15), (6, 0.20), (8, 0.19)]
    ]
    assert decisions == [False, False, False, True, True]  # 0.20 again is not an improvement
    assert (state.best_step, state.best_val, state.bad_evals) == (2, 0.20, 3)
    assert (out / "best_policy" / "policy.safetensors").is_file()
    # patience 0 never stops and saves nothing
    cfg0 = load_config(FeedbackLoopConfig, TINY, [f"output_dir={out}/off"])
    s0 = LoopState()
    assert not any(
        early_stopping({"val_rouge_l_neutral": v, "step": i}, s0, cfg0, acc, model)
        for i, v in enumerate([0.3, 0.1, 0.1, 0.1])
    )
    assert not (out / "off" / "best_policy").exists()


@pytest.mark.slow
def test_early_stopping_restores_the_best_validation_policy(tmp_path):
    """A learning rate far too high makes validation ROUGE-L fall: the run stops early, keeps the best
    validation step (chosen without the test split), and exports that policy, not the last one."""
    from safetensors.torch import load_file

    from judgeloop.recipes import train

    over = [
        *FAST,
        f"output_dir={tmp_path}",
        "max_steps=8",
        "eval_every_n_steps=1",
        "early_stopping_patience=2",
        "optim.learning_rate=0.3",
        "calibration.recalibrate_every_n_steps=0",
    ]
    rep = train(load_config(FeedbackLoopConfig, TINY, over))
    vals = [(h["step"], h["val_rouge_l_neutral"]) for h in rep["history"]]
    best_step, best_val = max(vals, key=lambda sv: (sv[1], -sv[0]))
    assert rep["stopped_early"] and rep["steps_run"] < 8
    assert rep["kept_step"] == best_step and rep["kept_step"] != rep["steps_run"]
    assert rep["final"]["step"] == best_step and rep["final"]["val_rouge_l_neutral"] == best_val
    # exactly `patience` evaluations without improvement after the best one
    assert sum(1 for s, _ in vals if s > best_step) == 2
    assert "best validation ROUGE-L" in rep["kept_reason"]
    # the exported policy is the best checkpoint's weights
    best = load_file(str(tmp_path / "best_policy" / "policy.safetensors"))
    exported = load_file(str(tmp_path / "policy" / "model.safetensors"))
    for k, v in best.items():
        torch.testing.assert_close(exported[k], v, rtol=0, atol=0)
    assert (tmp_path / "policy" / "calibrator.json").is_file()


@pytest.mark.parametrize(
    "override, message",
    [
        (
            "policy.model=no-such-org/no-such-model",
            "policy.model='no-such-org/no-such-model' is not in the Hugging Face cache",
        ),
        ("judge.model=./no/such/dir", "judge.model='./no/such/dir' is not a directory"),
    ],
)
def test_an_unresolvable_model_is_one_config_error_before_any_work(tmp_path, override, message):
    from judgeloop.recipes import train

    cfg = load_config(FeedbackLoopConfig, TINY, [*FAST, f"output_dir={tmp_path}", override])
    with pytest.raises(ConfigError, match=re.escape(message)):  # offline here: no hub retries first
        train(cfg)
    assert not (tmp_path / "config.yaml").exists()  # nothing written


@pytest.mark.slow
def test_judgeloop_train_and_accelerate_launch_of_the_recipe_give_the_same_report(tmp_path):
    """``judgeloop train`` runs recipes/feedback_loop.py (one copy of the loop): the CLI and
    ``accelerate launch recipes/feedback_loop.py`` on the same config write the same report.json and
    per_article.jsonl, and the recipe prints the report's head."""
    import subprocess
    import sys

    args = ["--config", str(TINY), *FAST, "max_steps=2", "eval_every_n_steps=2", "threads=1"]
    cli, launched = tmp_path / "cli", tmp_path / "launched"
    runs = [
        [sys.executable, "-m", "judgeloop.cli", "train", *args, f"output_dir={cli}"],
        [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--num_processes",
            "1",
            "--num_machines",
            "1",
            "--mixed_precision",
            "no",
            "--dynamo_backend",
            "no",
            str(ROOT / "recipes" / "feedback_loop.py"),
            *args,
            f"output_dir={launched}",
        ],
    ]
    procs = [subprocess.run(cmd, capture_output=True, text=True, timeout=600) for cmd in runs]
    for proc in procs:
        assert proc.returncode == 0, proc.stderr[-2000:]
    printed = json.loads(procs[1].stdout[procs[1].stdout.index("{") :])
    report = json.loads((launched / "report.json").read_text())
    assert printed["kept_step"] == report["kept_step"] == 2 and report["steps_run"] == 2
    assert (cli / "report.json").read_bytes() == (launched / "report.json").read_bytes()
    assert (cli / "per_article.jsonl").read_bytes() == (launched / "per_article.jsonl").read_bytes()
    assert (launched / "policy").is_dir()


def test_a_batch_the_train_split_cannot_fill_stops_before_any_output(tmp_path):
    from judgeloop.recipes import train

    out = tmp_path / "run"
    cfg = load_config(FeedbackLoopConfig, TINY, [*FAST, "batch_size=5000", f"output_dir={out}"])
    with pytest.raises(ConfigError, match=r"train split has \d+ articles, fewer than batch_size=5000; lower"):
        train(cfg)
    assert not out.exists()  # no config.yaml, no tracker folder, no metrics.jsonl


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "stop_signals=[SIGTREM]",
            "stop_signals lists 'SIGTREM', which is no signal name; did you mean SIGTERM?",
        ),
        (
            "stop_signals=[SIGKILL]",
            "stop_signals lists SIGKILL, which cannot be caught; use SIGTERM or SIGUSR1",
        ),
        ("ablation.save_every_n_steps=-1", "ablation.save_every_n_steps=-1 must be >= 0 (0: no checkpoints)"),
    ],
)
def test_stop_signal_and_job_checkpoint_errors_name_the_key(override, message):
    from judgeloop.config import ConfigError

    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(
            AblateConfig if override.startswith("ablation.") else FeedbackLoopConfig, TINY, [override]
        )


def test_allow_missing_goes_with_aggregate(tmp_path, capsys):
    from judgeloop.cli import main

    assert main(["ablate", "--config", str(TINY), f"output_dir={tmp_path}", "--allow-missing"]) == 2
    assert capsys.readouterr().err.strip() == (
        "judgeloop ablate: error: --allow-missing goes with --aggregate (it lets the summary leave out "
        "unfinished jobs)"
    )
