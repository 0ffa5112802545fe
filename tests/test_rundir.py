"""An output folder that holds another run (issue 40): every folder-writing command refuses it in one line,
or starts it clean, resumes only what matches, and holds ``run.lock`` while it runs (:mod:`judgeloop.rundir`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_retrieval_command import _overrides, beir_dir  # noqa: F401 (beir_dir: the fixture)

from judgeloop.cli import main
from judgeloop.config import load_config
from judgeloop.rundir import RunDirError, config_digest, open_run_dir, run_dir
from judgeloop.studies.calibration_lab import CalibrateConfig
from loop_common import FAST, TINY

ROOT = Path(__file__).resolve().parents[1]

CALIBRATE = [
    "calibrate",
    "--config",
    str(ROOT / "configs/calibrate/embedded_embedding.yaml"),
    "judge.model=judgeloop-tiny/encoder",
    "data.embedded_size=120",
    "max_pairs_per_article=6",
]


def _tree(folder: Path) -> dict[str, float]:
    """Every file under ``folder`` with its modification time (what a refused run must leave as it was)."""
    return {
        str(p.relative_to(folder)): p.stat().st_mtime_ns for p in sorted(folder.rglob("*")) if p.is_file()
    }


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


# --- the mechanism -------------------------------------------------------------------------------------


def test_a_folder_without_run_json_but_with_outputs_is_refused_and_overwrite_clears_only_run_folders(
    tmp_path,
):
    cfg = CalibrateConfig(output_dir=str(tmp_path / "old"))
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "report.json").write_text("{}")  # what an older judgeloop left
    with pytest.raises(RunDirError, match=r"^output_dir=\S+/old holds files \(report.json\) but no run.json"):
        open_run_dir(cfg.output_dir, "calibrate", cfg)
    assert sorted(p.name for p in (tmp_path / "old").iterdir()) == ["report.json", "run.lock"]
    other = tmp_path / "notes"
    other.mkdir()
    (other / "thesis.tex").write_text("mine")
    with pytest.raises(RunDirError, match=r"overwrite=true clears run folders only"):
        open_run_dir(other, "calibrate", CalibrateConfig(output_dir=str(other), overwrite=True))
    assert (other / "thesis.tex").read_text() == "mine"
    with run_dir(cfg.output_dir, "calibrate", CalibrateConfig(output_dir=cfg.output_dir, overwrite=True)):
        assert sorted(p.name for p in (tmp_path / "old").iterdir()) == ["run.json", "run.lock"]
    manifest = json.loads((tmp_path / "old" / "run.json").read_text())
    assert manifest["command"] == "calibrate" and manifest["state"] == "finished"
    assert manifest["config_digest"] == config_digest(cfg)  # overwrite and output_dir are no part of it


def test_a_failed_run_into_a_new_folder_leaves_nothing(tmp_path):
    cfg = CalibrateConfig(output_dir=str(tmp_path / "new"))
    with pytest.raises(ValueError, match="boom"), run_dir(cfg.output_dir, "calibrate", cfg):
        raise ValueError("boom")
    assert not (tmp_path / "new").exists()


def test_dotted_free_keys_leave_the_digest_as_it_is():
    from judgeloop.retrieval.trainer_config import TrainRetrieverConfig

    a = load_config(TrainRetrieverConfig, None, ["train.resume=true"])
    assert config_digest(a) == config_digest(load_config(TrainRetrieverConfig, None, ["train.resume=false"]))
    assert config_digest(a) != config_digest(load_config(TrainRetrieverConfig, None, ["train.seed=7"]))


# --- train ---------------------------------------------------------------------------------------------

_HOLD_DRIVER = """
import sys, time
from pathlib import Path
import judgeloop.loop.setup as setup
from judgeloop.cli import main

ready, go = Path(sys.argv[1]), Path(sys.argv[2])
real = setup.start_run
def start_run(run):  # the first run waits, holding its folder, while the second one tries
    ready.write_text("ready")
    while not go.exists():
        time.sleep(0.05)
    return real(run)
setup.start_run = start_run
sys.exit(main(sys.argv[3:]))
"""


@pytest.mark.slow
def test_two_train_runs_into_one_folder_the_second_refuses_then_a_rerun_is_refused_too(tmp_path, capsys):
    out = tmp_path / "run"
    args = ["train", "--config", str(TINY), *FAST, "max_steps=2", f"output_dir={out}"]
    driver = tmp_path / "driver.py"
    driver.write_text(_HOLD_DRIVER)
    ready, go = tmp_path / "ready", tmp_path / "go"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    first = subprocess.Popen(
        [sys.executable, str(driver), str(ready), str(go), *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.time() + 300
        while not ready.exists():
            assert first.poll() is None, first.communicate()[1][-3000:]
            assert time.time() < deadline
            time.sleep(0.1)
        assert main(args) == 2  # the second, at once: refused before its models load
        line = _one_line(capsys)
        assert line == (
            f"judgeloop train: error: output_dir={out} is in use by another run (train), pid {first.pid}; "
            "wait for it to end, or choose another output_dir"
        )
    finally:
        go.write_text("go")
        _, err = first.communicate(timeout=600)
    assert first.returncode == 0, err[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in rows if "train/loss" in r]
    assert steps == [1, 2]  # one run's rows only
    assert json.loads((out / "run.json").read_text())["state"] == "finished"
    before = _tree(out)
    # a fresh start into the finished run's folder would append to its metrics.jsonl: refused
    assert main(args) == 2
    assert _one_line(capsys) == (
        f"judgeloop train: error: output_dir={out} holds this train run already (finished); continue it with "
        "resume_from=auto, choose a new output_dir, or set overwrite=true to start it over"
    )
    # another config, even with resume_from=auto (it has no checkpoint to refuse): refused, naming the key
    assert main([*args, "resume_from=auto", "loss.beta=0.5"]) == 2
    line = _one_line(capsys)
    assert line.startswith(
        f"judgeloop train: error: output_dir={out} holds another train run, made with another"
    )
    assert "loss.beta: 0.1 -> 0.5" in line and line.endswith("or set overwrite=true to clear it")
    assert _tree(out) == before


def test_train_refuses_the_folder_of_a_calibrate_run_before_any_model_loads(tmp_path, capsys):
    out = tmp_path / "cal"
    assert main([*CALIBRATE, f"output_dir={out}"]) == 0
    capsys.readouterr()
    before = _tree(out)
    assert main(["train", "--config", str(TINY), *FAST, f"output_dir={out}"]) == 2
    assert _one_line(capsys) == (
        f"judgeloop train: error: output_dir={out} holds a calibrate run, not a train run; choose a new "
        "output_dir, or set overwrite=true to clear it"
    )
    assert _tree(out) == before


# --- calibrate -----------------------------------------------------------------------------------------


def test_calibrate_over_another_calibration_is_refused_and_overwrite_leaves_none_of_its_judges(
    tmp_path, capsys
):
    out = tmp_path / "cal"
    assert main([*CALIBRATE, f"output_dir={out}", "methods=[platt,isotonic]"]) == 0
    assert (out / "calibrated_judge" / "isotonic").is_dir()
    capsys.readouterr()
    before = _tree(out)
    assert main([*CALIBRATE, f"output_dir={out}", "methods=[platt]"]) == 2
    line = _one_line(capsys)
    assert line.startswith(f"judgeloop calibrate: error: output_dir={out} holds another calibrate run")
    assert "methods: ['platt', 'isotonic'] -> ['platt']" in line
    assert _tree(out) == before
    assert main([*CALIBRATE, f"output_dir={out}", "methods=[platt]", "overwrite=true"]) == 0
    assert sorted(p.name for p in (out / "calibrated_judge").iterdir()) == ["platt", "raw"]
    assert not (out / "calibrators" / "isotonic.json").exists()
    # the same config again: the run starts over in its own folder (nothing of another run there)
    assert main([*CALIBRATE, f"output_dir={out}", "methods=[platt]"]) == 0


# --- label-pairs ---------------------------------------------------------------------------------------


def test_label_pairs_refuses_an_older_dataset_folder(tiny_calibration, tmp_path, capsys):
    out = tmp_path / "labeled"
    (out / "dataset").mkdir(parents=True)  # what an older run left, without run.json
    (out / "dataset" / "old-run.arrow").write_text("old")
    data = tmp_path / "pairs.jsonl"
    data.write_text(json.dumps({"prompt": "an article", "chosen": "a summary", "rejected": "another"}) + "\n")
    args = [
        "label-pairs",
        "--config",
        str(ROOT / "configs/label_pairs/summeval.yaml"),
        f"judge_path={tiny_calibration / 'calibrated_judge' / 'platt'}",
        f"data.path={data}",
        "data.fields.source=null",
        "data.fields.references=null",
        f"output_dir={out}",
    ]
    assert main(args) == 2
    assert _one_line(capsys) == (
        f"judgeloop label-pairs: error: output_dir={out} holds files (dataset) but no run.json: an older "
        "judgeloop's run or other files; choose a new output_dir, or set overwrite=true to clear it"
    )
    assert not (out / "labeled.jsonl").exists()
    assert main([*args, "overwrite=true"]) == 0
    assert (out / "labeled.jsonl").is_file() and not (out / "dataset" / "old-run.arrow").exists()


# --- train-retriever -----------------------------------------------------------------------------------


@pytest.mark.slow
def test_train_retriever_resumes_only_its_own_run(tmp_path, beir_dir, capsys):  # noqa: F811
    out = tmp_path / "ret"
    base = ["train-retriever", "--config", str(ROOT / "configs/retriever/scifact.yaml")]
    common = [*_overrides(beir_dir, out), "train.save_every_n_steps=1", "log_with=[jsonl]"]
    assert main([*base, *common]) == 0
    capsys.readouterr()
    before = _tree(out)
    # another seed would have resumed the first run's checkpoint (a silent hybrid): refused
    assert main([*base, *common, "train.seed=7"]) == 2
    line = _one_line(capsys)
    assert line.startswith(
        f"judgeloop train-retriever: error: output_dir={out} holds another train-retriever run"
    )
    assert "train.seed: 0 -> 7" in line
    assert _tree(out) == before
    # with train.resume=false the run would start over in it: refused, naming how to continue
    assert main([*base, *common, "train.resume=false"]) == 2
    assert "holds this train-retriever run already (finished); continue it with train.resume=true" in (
        _one_line(capsys)
    )
    assert _tree(out) == before


# --- every other folder-writing command ----------------------------------------------------------------

OTHERS = [
    ("build-raft", "configs/raft/pubmedqa.yaml"),
    ("eval-raft", "configs/raft/eval_pubmedqa.yaml"),
    ("sft", "configs/raft/sft_pubmedqa.yaml"),
    ("conformal", "configs/conformal/scifact.yaml"),
    ("gate", "configs/gate/scifact.yaml"),
    ("route", "configs/routing/squad2.yaml"),
    ("answer", "configs/routing/squad2_abstain.yaml"),
    ("probe-judge", "configs/probe/summeval.yaml"),
    ("ablate", "configs/feedback_loop/tiny.yaml"),
]


@pytest.mark.parametrize(("command", "config"), OTHERS)
def test_every_folder_writing_command_refuses_another_runs_folder_in_one_line(
    tmp_path, capsys, command, config
):
    out = tmp_path / "out"
    held = CalibrateConfig(output_dir=str(out))
    with run_dir(out, "calibrate", held):
        (out / "report.json").write_text('{"from": "calibrate"}')
    before = _tree(out)
    extra = ["device=cpu"] if command == "sft" else []
    assert main([command, "--config", str(ROOT / config), f"output_dir={out}", *extra]) == 2
    assert _one_line(capsys) == (
        f"judgeloop {command}: error: output_dir={out} holds a calibrate run, not a {command} run; choose a "
        "new output_dir, or set overwrite=true to clear it"
    )
    assert _tree(out) == before


# --- ablate: jobs share the grid's folder --------------------------------------------------------------


def test_an_ablation_job_held_by_another_run_is_neither_cleaned_nor_resumed(tmp_path, capsys):
    from judgeloop.studies.ablation import arm_config, job_dir
    from judgeloop.studies.ablation_config import AblateConfig

    args = ["ablate", "--config", str(TINY), *FAST, f"output_dir={tmp_path / 'grid'}"]
    cfg = load_config(AblateConfig, TINY, [*FAST, f"output_dir={tmp_path / 'grid'}"])
    folder = job_dir(cfg, "raw", 0)
    # the same job, run by another --job task now: it holds the grid's folder (shared) and the job's
    grid = open_run_dir(cfg.output_dir, "ablate", cfg, on_match="keep", shared=True)
    held = open_run_dir(folder, "train", arm_config(cfg, "raw", 0), on_match="keep")
    try:
        (folder / "metrics.jsonl").write_text('{"step": 1}\n')
        assert main([*args, "--job", "raw:0"]) == 2
        assert _one_line(capsys) == (
            f"judgeloop ablate: error: output_dir={folder} is in use by another run (train), pid {os.getpid()}; "
            "wait for it to end, or choose another output_dir"
        )
        assert (folder / "metrics.jsonl").read_text() == '{"step": 1}\n'
        # a job task may not clear the grid's folder, which the other jobs are writing
        assert main([*args, "overwrite=true", "--job", "raw:1"]) == 2
        assert "overwrite=true clears the folder, which runs sharing it may be writing now" in _one_line(
            capsys
        )
    finally:
        held.release()
        grid.release()


def test_mine_negatives_is_refused_while_another_run_writes_its_output(tmp_path, capsys):
    from judgeloop.cli import main
    from judgeloop.commands.mine_negatives import MineNegativesConfig
    from judgeloop.rundir import output_file

    out = tmp_path / "negatives.jsonl"
    config = str(ROOT / "configs" / "retriever" / "mine_scifact.yaml")
    with output_file(out, "mine-negatives", MineNegativesConfig(output_path=str(out))) as run_id:
        assert run_id["command"] == "mine-negatives" and len(run_id["config_digest"]) > 8
        capsys.readouterr()
        assert main(["mine-negatives", "--config", config, f"output_path={out}"]) == 2
    err = capsys.readouterr().err.strip()
    assert f"output_path={out} is being written by another run, pid {os.getpid()}" in err and "\n" not in err
    assert not out.exists()


def test_ablate_aggregate_waits_for_no_grid_run_holding_the_folder(tmp_path):
    from judgeloop.commands.ablate import run
    from judgeloop.config import load_config
    from judgeloop.rundir import RunDirError
    from judgeloop.studies.ablation_config import AblateConfig

    cfg = load_config(AblateConfig, TINY, [f"output_dir={tmp_path / 'grid'}"])
    grid_run = run_dir(cfg.output_dir, "ablate", cfg, on_match="keep")  # a whole grid, writing results.*
    with grid_run, pytest.raises(RunDirError, match="is in use by another run"):
        run(cfg, aggregate_only=True)
    assert not (tmp_path / "grid" / "results.json").exists()
