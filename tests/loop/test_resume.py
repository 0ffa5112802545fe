"""Checkpoints and resume (judgeloop.loop.run, loop.run_state_files): exact resume, real kills and stop signals, resume_from: auto, config changes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from judgeloop.config import ConfigError, load_config, to_yaml
from judgeloop.loop.config import FeedbackLoopConfig
from loop_common import FAST, TINY, same_row


@pytest.mark.slow
def test_exact_resume_after_interruption(tmp_path):
    from judgeloop.recipes import train

    full = train(load_config(FeedbackLoopConfig, TINY, [*FAST, f"output_dir={tmp_path / 'full'}"]))
    part = train(
        load_config(
            FeedbackLoopConfig, TINY, [*FAST, f"output_dir={tmp_path / 'cut'}", "stop_after_n_steps=2"]
        )
    )
    assert part["interrupted"] and part["step"] == 2
    ckpt = Path(part["checkpoint"])
    files = {p.name: p for p in ckpt.iterdir()}
    # accelerate's state (model, optimizer, scheduler, RNG per process) plus the loop's own files
    assert {"model.safetensors", "optimizer.bin", "scheduler.bin", "random_states_0.pkl"} <= set(files)
    assert {"calibrator.json", "state.json"} <= set(files)

    assert (ckpt / "config.yaml").is_file()  # the config the checkpoint was made with
    # what a run killed after its checkpoint leaves: rows logged past the checkpoint, and an orphan
    # temporary folder from a checkpoint write cut short
    metrics = tmp_path / "cut" / "metrics.jsonl"
    with metrics.open("a") as fh:
        fh.write(json.dumps({"step": 3, "train/loss": 9.0}) + "\n")
    orphan = tmp_path / "cut" / "checkpoints" / ".step_3.x1y2.tmp"
    orphan.mkdir()
    keep = ["save_every_n_steps=1", "keep_checkpoints=2"]  # resume-free: they cannot change results
    resumed = train(
        load_config(
            FeedbackLoopConfig, TINY, [*FAST, f"output_dir={tmp_path / 'cut'}", f"resume_from={ckpt}", *keep]
        )
    )
    assert not orphan.exists()
    # pruned to the newest two (the one resumed from went once step 3 was saved)
    assert sorted(p.name for p in (tmp_path / "cut" / "checkpoints").iterdir()) == ["step_3", "step_4"]
    assert resumed["steps_run"] == full["steps_run"] == 4

    # the log and the counters continue from the checkpoint: the same rows as the uninterrupted run
    def rows(d):
        return [
            (r["step"], sorted(r)) for r in map(json.loads, (d / "metrics.jsonl").read_text().splitlines())
        ]  # noqa: E731

    assert rows(tmp_path / "cut") == rows(tmp_path / "full")
    assert resumed["judge_stats"]["status"] == full["judge_stats"]["status"]
    assert resumed["prompts_truncated"] == full["prompts_truncated"]
    # Same metrics. Floats are compared at 1e-6 relative: the embedding judge caches embeddings per text, so a
    # freshly started (resumed) process batches texts differently and its cosines differ in the ~8th digit.
    same_row(resumed["final"], full["final"])
    for r, f in zip(resumed["train_log"], full["train_log"], strict=True):
        same_row(r, f)
    for r, f in zip(resumed["refits"], full["refits"], strict=True):
        same_row(r, f)
    # two scheduled refits; one may keep the previous calibrator (refit_accept=better) when the new one is worse
    assert sum(r["reason"] == "schedule" for r in full["refits"]) == 2
    assert (tmp_path / "cut" / "report.json").is_file()


@pytest.mark.slow
def test_a_lora_checkpoint_holds_the_adapters_only_and_resumes_exactly(tmp_path):
    from safetensors.torch import load_file

    from judgeloop.recipes import train

    lora = [*FAST, "policy.lora=true", "policy.lora_target_modules=[q_proj,v_proj]", "max_steps=2"]
    lora += ["eval_every_n_steps=0", "calibration.recalibrate_every_n_steps=0"]
    full = train(load_config(FeedbackLoopConfig, TINY, [*lora, f"output_dir={tmp_path / 'full'}"]))
    part = train(
        load_config(
            FeedbackLoopConfig, TINY, [*lora, f"output_dir={tmp_path / 'cut'}", "stop_after_n_steps=1"]
        )
    )
    saved = load_file(str(Path(part["checkpoint"]) / "model.safetensors"))
    assert saved and all("lora_" in k for k in saved), sorted(saved)[:3]  # not the frozen base
    resumed = train(
        load_config(
            FeedbackLoopConfig,
            TINY,
            [*lora, f"output_dir={tmp_path / 'cut'}", f"resume_from={part['checkpoint']}"],
        )
    )
    same_row(resumed["final"], full["final"])
    for r, f in zip(resumed["train_log"], full["train_log"], strict=True):
        same_row(r, f)


# A driver for real faults: the CLI runs in a child process, and the patch below kills it (SIGKILL) or
# presses Ctrl-C (SIGINT) at one exact point of the run. Only the timing is patched; the run is the real one.
_FAULT_DRIVER = """
import os, signal, sys
import judgeloop.loop.recalibration as rn
from judgeloop.cli import main

fault = os.environ["JL_FAULT"]
# a terminal's Ctrl-C: Python installs this handler only when SIGINT is not inherited as ignored, and a
# background job of a non-interactive shell (CI under nohup or `&`) inherits it ignored
signal.signal(signal.SIGINT, signal.default_int_handler)
if fault == "kill_in_write":  # the step-4 checkpoint is half written: accelerate's state is there, the rest not
    from accelerate import Accelerator
    real_save_state = Accelerator.save_state
    def save_state(self, output_dir=None, **kwargs):
        out = real_save_state(self, output_dir, **kwargs)
        if ".step_4." in str(output_dir):
            os.kill(os.getpid(), signal.SIGKILL)
        return out
    Accelerator.save_state = save_state
else:  # after the step-2 checkpoint, once step 3 has logged its training row
    real = rn.maybe_recalibrate
    def maybe_recalibrate(step, *args, **kwargs):
        out = real(step, *args, **kwargs)
        if step == 3:
            os.kill(os.getpid(), signal.SIGKILL if fault == "kill_after" else signal.SIGINT)
        return out
    rn.maybe_recalibrate = maybe_recalibrate
sys.exit(main(sys.argv[1:]))
"""


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    from judgeloop.recipes import train

    out = tmp_path_factory.mktemp("uninterrupted")
    report = train(  # at the faulted run's thread count: equal numbers need equal reduction orders
        load_config(
            FeedbackLoopConfig, TINY, [*FAST, f"output_dir={out}", "save_every_n_steps=2", "threads=1"]
        )
    )
    return out, report


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["kill_in_write", "kill_after", "ctrl_c"])
def test_a_real_kill_or_ctrl_c_then_resume_equals_the_uninterrupted_run(tmp_path, fault, uninterrupted):
    """SIGKILL during a checkpoint write, SIGKILL after one, and Ctrl-C: each resumed from the last
    finished checkpoint ends with the uninterrupted run's metrics, log rows and counters, and no orphan."""
    import os
    import subprocess
    import sys

    from judgeloop.recipes import train

    full_dir, full = uninterrupted
    out = tmp_path / "run"
    driver = tmp_path / "driver.py"
    driver.write_text(_FAULT_DRIVER)
    # the child at one thread, as the uninterrupted run and the resume (threads=1), on any machine
    args = ["train", "--config", str(TINY), *FAST, f"output_dir={out}", "save_every_n_steps=2", "threads=1"]
    env = {**os.environ, "JL_FAULT": fault}
    proc = subprocess.run([sys.executable, str(driver), *args], env=env, capture_output=True, text=True)
    ckpt = out / "checkpoints" / "step_2"
    if fault == "ctrl_c":  # one line naming the checkpoint and the override that continues
        assert proc.returncode == 130, proc.stderr[-2000:]
        assert proc.stderr.strip().splitlines()[-1] == (
            f"judgeloop train: interrupted; the last checkpoint is {ckpt}: continue with resume_from={ckpt}"
        )
    else:
        assert proc.returncode == -9, proc.stderr[-2000:]
    assert (ckpt / "state.json").is_file() and not (out / "report.json").exists()
    if fault == "kill_in_write":
        assert [p.name for p in (out / "checkpoints").iterdir() if p.name.startswith(".step_4.")]
    resumed = train(
        load_config(
            FeedbackLoopConfig, TINY, [*FAST, f"output_dir={out}", f"resume_from={ckpt}", "threads=1"]
        )
    )

    assert not [p for p in (out / "checkpoints").iterdir() if p.name.startswith(".")]  # no orphan left
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    full_rows = [json.loads(line) for line in (full_dir / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], sorted(r)) for r in rows] == [(r["step"], sorted(r)) for r in full_rows]
    assert resumed["judge_stats"] == full["judge_stats"]
    assert resumed["prompts_truncated"] == full["prompts_truncated"]
    assert resumed["num_refits"] == full["num_refits"]
    same_row(resumed["final"], full["final"])
    for key in ("train_log", "refits", "history"):
        assert len(resumed[key]) == len(full[key]), key
        for r, f in zip(resumed[key], full[key]):
            same_row(r, f)


@pytest.mark.slow
def test_the_loop_saves_its_final_calibrated_judge(uninterrupted):
    """OUTPUT_DIR/calibrated_judge: the configured judge with the run's final calibrator (the last
    checkpoint's, step 4), loadable where users train."""
    from judgeloop import CalibratedJudge

    out, report = uninterrupted
    judge = CalibratedJudge.from_pretrained(out / "calibrated_judge")
    final = json.loads((out / "checkpoints" / "step_4" / "calibrator.json").read_text())
    assert judge.method == "platt" and judge.calibrator.state_dict() == final
    taken = [r for r in report["refits"] if r["refit"]]
    assert judge.card["fit"]["pairs"] == taken[-1]["n_fit"] and judge.card["fit"]["step"] == taken[-1]["step"]
    out_p = judge.compare(["the cat sat on the mat"], ["a cat sat"], ["dogs bark"])
    assert out_p.valid.all() and 0 < out_p.p[0] < 1


_SIGNAL_DRIVER = """
import os, signal, sys
import judgeloop.loop.recalibration as rn
from judgeloop.cli import main

sig = getattr(signal, os.environ["JL_SIGNAL"])
if os.environ.get("JL_TWICE"):  # a second signal while the step-3 checkpoint is being written
    from accelerate import Accelerator
    real_save_state = Accelerator.save_state
    def save_state(self, output_dir=None, **kwargs):
        if ".step_3." in str(output_dir):
            os.kill(os.getpid(), sig)
        return real_save_state(self, output_dir, **kwargs)
    Accelerator.save_state = save_state
real = rn.maybe_recalibrate
def maybe_recalibrate(step, *args, **kwargs):  # mid-step 3: the step still finishes
    if step == 3:
        os.kill(os.getpid(), sig)
    return real(step, *args, **kwargs)
rn.maybe_recalibrate = maybe_recalibrate
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
@pytest.mark.parametrize(
    ("sig", "status", "resume", "twice"),
    [("SIGTERM", 143, "path", False), ("SIGUSR1", 138, "auto", False), ("SIGTERM", 143, "path", True)],
)
def test_a_stop_signal_checkpoints_the_step_then_resume_equals_the_uninterrupted_run(
    tmp_path, sig, status, resume, twice, uninterrupted
):
    """SIGTERM / SIGUSR1 mid-step 3 (and a second one during the checkpoint write): the step finishes,
    its checkpoint is written, one line names it and how to continue, the exit status is 128 + signum;
    the resumed run ends with the uninterrupted run's metrics, log rows and counters."""
    import os
    import subprocess
    import sys

    from judgeloop.recipes import train

    full_dir, full = uninterrupted
    out = tmp_path / "run"
    driver = tmp_path / "driver.py"
    driver.write_text(_SIGNAL_DRIVER)
    common = [*FAST, f"output_dir={out}", "save_every_n_steps=2", "threads=1"]
    auto = ["resume_from=auto"] if resume == "auto" else []
    env = {**os.environ, "JL_SIGNAL": sig, "JL_TWICE": "1" if twice else ""}
    proc = subprocess.run(
        [sys.executable, str(driver), "train", "--config", str(TINY), *common, *auto],
        env=env,
        capture_output=True,
        text=True,
    )
    ckpt = out / "checkpoints" / "step_3"
    assert proc.returncode == status, proc.stderr[-3000:]
    how = (
        "run the same command again to continue from it (resume_from=auto)"
        if resume == "auto"
        else f"continue with resume_from={ckpt}"
    )
    assert proc.stderr.strip().splitlines()[-1] == (
        f"judgeloop train: stopped by {sig} after step 3; checkpoint {ckpt}: {how}"
    )
    assert json.loads((ckpt / "state.json").read_text())["step"] == 3
    assert not (out / "report.json").exists()
    assert not [p for p in (out / "checkpoints").iterdir() if p.name.startswith(".")]
    again = auto or [f"resume_from={ckpt}"]
    resumed = train(load_config(FeedbackLoopConfig, TINY, [*common, *again]))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    full_rows = [json.loads(line) for line in (full_dir / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], sorted(r)) for r in rows] == [(r["step"], sorted(r)) for r in full_rows]
    assert resumed["steps_run"] == full["steps_run"]
    for key in ("judge_stats", "prompts_truncated", "num_refits", "kept_step", "judge_weight"):
        assert resumed[key] == full[key], key
    same_row(resumed["final"], full["final"])
    for key in ("train_log", "refits", "history"):
        assert len(resumed[key]) == len(full[key]), key
        for r, f in zip(resumed[key], full[key]):
            same_row(r, f)


@pytest.mark.slow
def test_resume_from_auto_starts_fresh_then_takes_the_newest_checkpoint(tmp_path, caplog):
    import logging

    from judgeloop.recipes import train

    common = [*FAST, f"output_dir={tmp_path}", "resume_from=auto", "max_steps=2"]
    with caplog.at_level(logging.INFO, logger="judgeloop"):
        part = train(load_config(FeedbackLoopConfig, TINY, [*common, "stop_after_n_steps=1"]))
    assert "resume_from=auto: no checkpoint under" in caplog.text and part["step"] == 1
    (tmp_path / "checkpoints" / ".step_2.ab12.tmp").mkdir()  # a half-written one is never taken
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="judgeloop"):
        report = train(load_config(FeedbackLoopConfig, TINY, common))
    assert f"resume_from=auto: resuming from {tmp_path / 'checkpoints' / 'step_1'}" in caplog.text
    assert report["steps_run"] == 2 and [r["step"] for r in report["train_log"]] == [1, 2]


@pytest.mark.slow
@pytest.mark.parametrize(
    "change",
    [
        "data.embedded_size=130",
        "policy.sft_steps=61",
        "calibration.method=isotonic",
        "loss.kl_coef=0.5",
        "optim.learning_rate=0.01",
        "seed=1",
        "judge.scale=10",
    ],
)
def test_resume_refuses_a_changed_config_naming_the_key(tmp_path, change, resume_checkpoint):
    from judgeloop.config import ConfigError
    from judgeloop.recipes import train

    key = change.split("=")[0]
    with pytest.raises(ConfigError, match=f"would change the run: {key}: "):
        train(
            load_config(
                FeedbackLoopConfig,
                TINY,
                [*FAST, f"output_dir={tmp_path}", f"resume_from={resume_checkpoint}", change],
            )
        )
    assert not (tmp_path / "report.json").exists()


@pytest.fixture(scope="module")
def resume_checkpoint(tmp_path_factory):
    from judgeloop.recipes import train

    out = tmp_path_factory.mktemp("ckpt")
    part = train(load_config(FeedbackLoopConfig, TINY, [*FAST, f"output_dir={out}", "stop_after_n_steps=1"]))
    return part["checkpoint"]


@pytest.mark.slow
def test_a_resume_at_another_thread_count_says_results_will_differ(tmp_path, resume_checkpoint):
    """The checkpoint records the numerics it ran with; a resume with others continues, says so in one
    log line, and the report keeps both segments."""
    import logging
    import shutil

    from judgeloop.recipes import train

    saved = json.loads((Path(resume_checkpoint) / "state.json").read_text())["numerics"]
    assert [set(s) for s in saved] == [{"from_step", "threads", "device", "precision", "kernels"}]
    assert saved[0]["precision"] == "fp32" and saved[0]["device"] == "cpu"
    other = saved[0]["threads"] + 1
    out = tmp_path / "run"
    shutil.copytree(Path(resume_checkpoint).parents[1], out)
    ckpt = out / "checkpoints" / Path(resume_checkpoint).name
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logging.getLogger("judgeloop").addHandler(handler)
    try:
        report = train(
            load_config(
                FeedbackLoopConfig,
                TINY,
                [*FAST, f"output_dir={out}", f"resume_from={ckpt}", f"threads={other}", "max_steps=2"],
            )
        )
    finally:
        logging.getLogger("judgeloop").removeHandler(handler)
    lines = [r.getMessage() for r in records if "other numerics" in r.getMessage()]
    assert lines == [
        f"resumed with other numerics than the checkpoint was made with (threads: {saved[0]['threads']} -> "
        f"{other}): results will differ from an uninterrupted run by float rounding"
    ]
    assert [(s["from_step"], s["threads"]) for s in report["numerics"]] == [
        (0, saved[0]["threads"]),
        (1, other),
    ]


@pytest.mark.slow
def test_resume_accepts_keys_that_cannot_change_results(tmp_path, resume_checkpoint):
    from judgeloop.loop.config import RESUME_FREE_KEYS
    from judgeloop.loop.run_state_files import checked_resume

    cfg = load_config(
        FeedbackLoopConfig,
        TINY,
        [*FAST, f"output_dir={tmp_path}", "max_steps=6", "progress_bar=true", "log_with=[jsonl,tensorboard]"],
    )
    assert checked_resume(to_yaml(cfg), resume_checkpoint, RESUME_FREE_KEYS) == 1
    with pytest.raises(ConfigError, match="not a checkpoint directory"):
        checked_resume(to_yaml(cfg), tmp_path, RESUME_FREE_KEYS)


@pytest.mark.slow
def test_resuming_a_checkpoint_past_max_steps_is_refused_naming_both(tmp_path):
    """A checkpoint at step 2 resumed with max_steps=1 ran nothing and exited 0; now one line names the
    checkpoint's step, max_steps and the fix, before any work."""
    from judgeloop.recipes import train

    out = tmp_path / "run"
    part = train(load_config(FeedbackLoopConfig, TINY, [*FAST, f"output_dir={out}", "stop_after_n_steps=2"]))
    ckpt = part["checkpoint"]
    with pytest.raises(
        ConfigError, match=r"is at step 2, past max_steps=1: nothing to run; set max_steps above 2"
    ):
        train(
            load_config(
                FeedbackLoopConfig, TINY, [*FAST, f"output_dir={out}", f"resume_from={ckpt}", "max_steps=1"]
            )
        )
    assert not (out / "report.json").exists()


@pytest.mark.parametrize(
    "name, text, says",
    [
        ("state.json", '{"step": 3, "cursor"', "not valid JSON (Expecting ':' delimiter: line 1 column 21"),
        ("state.json", '{"step": NaN}', "NaN is not strict JSON"),
        ("state.json", '{"step": "three"}', "step='three' is not a step number"),
        ("state.json", "[3]", "expected a JSON object, got list"),
        ("calibrator.json", '{"method": "platt", "a_": 1.0, "b', "not valid JSON (Unterminated string"),
        ("calibrator.json", None, "does not exist"),
    ],
)
def test_a_damaged_checkpoint_file_is_one_line_naming_it(tmp_path, name, text, says):
    """calibrator.json and state.json were read with plain json.loads: a truncated file was a
    JSONDecodeError traceback (and NaN passed). Now one line names the file, checked on resume before any
    weights load (the accelerator is never touched: None here)."""
    from judgeloop.io import DataError
    from judgeloop.loop.run_state_files import checked_resume, load_checkpoint

    ckpt = tmp_path / "checkpoints" / "step_3"
    ckpt.mkdir(parents=True)
    (ckpt / "state.json").write_text('{"step": 3}')
    (ckpt / "calibrator.json").write_text('{"method": "platt"}')
    if text is None:
        (ckpt / name).unlink()
    else:
        (ckpt / name).write_text(text)
    what = "checkpoint state" if name == "state.json" else "checkpoint calibrator"
    for read in (lambda: checked_resume("", ckpt, ()), lambda: load_checkpoint(None, ckpt)):
        with pytest.raises(DataError) as err:
            read()
        msg = str(err.value)
        assert msg.startswith(f"{what} {ckpt / name}") and says in msg and "\n" not in msg, msg
        assert msg.endswith(
            "; resume from another checkpoint under OUTPUT_DIR/checkpoints/, or start a new run"
        )
