from __future__ import annotations

import subprocess
import sys

import pytest

from judgeloop.cli import main


def test_unknown_key_exits_2_with_message(repo, capsys):
    rc = main(
        ["calibrate", "--config", str(repo / "configs/calibrate/embedded_embedding.yaml"), "judge.scael=3"]
    )
    err = capsys.readouterr().err
    assert rc == 2
    assert "unknown config key 'judge.scael'" in err and "did you mean 'judge.scale'" in err


def test_print_config(repo, capsys):
    rc = main(
        [
            "calibrate",
            "--config",
            str(repo / "configs/calibrate/embedded_embedding.yaml"),
            "--print-config",
            "num_bins=10",
        ]
    )
    assert rc == 0
    assert "num_bins: 10" in capsys.readouterr().out


@pytest.mark.slow
def test_console_script_help():
    out = subprocess.run(
        [sys.executable, "-m", "judgeloop.cli", "--help"], capture_output=True, text=True, check=True
    )
    assert "calibrate" in out.stdout


def test_output_dir_that_is_a_file_is_one_line_before_any_work(tmp_path, capsys):
    from judgeloop.cli import main

    target = tmp_path / "a_file"
    target.write_text("x")
    rc = main(["train", "--config", "configs/feedback_loop/tiny.yaml", f"output_dir={target}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1
    assert (
        err[0]
        == f"judgeloop train: config error: output_dir={target} is a file; point output_dir at a folder"
    )
