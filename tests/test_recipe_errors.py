"""The recipes launched directly say a refused setting, data or output folder in one line (exit 2), as the
``judgeloop`` commands do; ``recipes/sft_raft.py`` opens its folder through ``judgeloop.rundir``."""

from __future__ import annotations

import json
import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

from judgeloop.rundir import RUN_FILE, lent_to_child, run_dir

ROOT = Path(__file__).resolve().parents[1]


def _recipe(name: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    env.pop("RANK", None)
    cmd = [sys.executable, str(ROOT / "recipes" / name), *args]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def _one_line(res: subprocess.CompletedProcess, prefix: str, *words: str) -> None:
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert res.returncode == 2, res.stderr[-2000:]
    assert "Traceback" not in res.stderr, res.stderr[-2000:]
    said = [line for line in lines if line.startswith(prefix)]
    assert len(said) == 1 and all(w in said[0] for w in words), res.stderr[-2000:]


@pytest.mark.parametrize(
    "override, key",
    [("loss.tau=nan", "loss.tau"), ("train.learning_rate=nan", "train.learning_rate")],
)
def test_train_retriever_recipe_config_error_is_one_line(tmp_path, override, key):
    res = _recipe(
        "train_retriever.py", "--config", str(ROOT / "configs/retriever/scifact.yaml"), override, cwd=tmp_path
    )
    _one_line(res, "train_retriever: error:", key)


def test_train_retriever_recipe_data_and_folder_errors_are_one_line(tmp_path):
    config = str(ROOT / "configs/retriever/scifact.yaml")
    missing = _recipe(
        "train_retriever.py",
        "--config",
        config,
        f"data.train.corpus_path={tmp_path / 'nowhere.jsonl'}",
        f"output_dir={tmp_path / 'out_a'}",
        cwd=tmp_path,
    )
    assert missing.returncode == 2 and "Traceback" not in missing.stderr, missing.stderr[-2000:]
    assert "train_retriever: error: data file " in missing.stderr and "does not exist" in missing.stderr
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "notes.txt").write_text("someone else's")
    res = _recipe("train_retriever.py", "--config", config, f"output_dir={taken}", cwd=tmp_path)
    _one_line(res, "train_retriever: error:", f"output_dir={taken}", "overwrite=true")


def test_sft_recipe_config_error_is_one_line(tmp_path):
    res = _recipe(
        "sft_raft.py",
        "--config",
        str(ROOT / "configs/raft/sft_pubmedqa.yaml"),
        "train.learning_rate=nan",
        cwd=tmp_path,
    )
    _one_line(res, "sft_raft: error:", "train.learning_rate")


def _sft_main(*args: str) -> int:
    return runpy.run_path(str(ROOT / "recipes" / "sft_raft.py"), run_name="sft_raft")["main"](list(args))


def test_sft_recipe_opens_its_folder_through_rundir(tmp_path, capsys):
    """Launched directly, the recipe refuses a folder holding another run before reading its data, and a
    run folder it opens gets its lock and manifest; launched by ``judgeloop sft``, it leaves the folder to
    its launcher (no second lock: no refusal of its own folder)."""
    config = str(ROOT / "configs/raft/sft_pubmedqa.yaml")
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "notes.txt").write_text("someone else's")
    no_data = f"data_dir={tmp_path / 'no_raft'}"
    assert _sft_main("--config", config, f"output_dir={taken}", no_data, "device=cpu") == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"sft_raft: error: output_dir={taken} holds files") and "\n" not in err, err

    fresh = tmp_path / "fresh"
    assert _sft_main("--config", config, f"output_dir={fresh}", no_data, "device=cpu") == 2
    err = capsys.readouterr().err.strip()
    assert "has no dataset/ folder" in err and "\n" not in err, err  # a DataError, after the folder opened
    assert not fresh.exists()  # it failed before writing: the run leaves no trace

    held = tmp_path / "held"
    with run_dir(held, "sft", _cfg(config, held)):
        manifest = json.loads((held / RUN_FILE).read_text())
        with lent_to_child(held):
            assert _sft_main("--config", config, f"output_dir={held}", no_data, "device=cpu") == 2
        err = capsys.readouterr().err.strip()
        assert "has no dataset/ folder" in err and "in use" not in err, err
        assert json.loads((held / RUN_FILE).read_text())["pid"] == manifest["pid"] == os.getpid()
    assert "HELD" not in " ".join(k for k in os.environ if k.startswith("JUDGELOOP_HELD"))


def _cfg(config: str, out: Path):
    from judgeloop.config import load_config
    from judgeloop.raft.sft import SftConfig

    return load_config(SftConfig, config, [f"output_dir={out}", "device=cpu"])
