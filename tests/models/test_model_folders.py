"""Offline models load anywhere: the local folder of a packaged model is a complete transformers
checkpoint (``architectures`` named, so TRL and plain transformers take its path),
``python -m judgeloop.models ID`` prints it, and a hub id that is not local while the hub is off fails at
once with that advice."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import transformers

from judgeloop.models import check_model, load_causal_lm, load_tokenizer, resolve_model_path
from judgeloop.models.saving import save_model_folder

SMOL = "HuggingFaceTB/SmolLM2-135M-Instruct"
SRC = str(Path(__file__).resolve().parents[2] / "src")


def _cli(*args: str, **env: str) -> subprocess.CompletedProcess:
    full = {**os.environ, "PYTHONPATH": SRC, **env}
    return subprocess.run(
        [sys.executable, "-m", "judgeloop.models", *args],
        capture_output=True,
        text=True,
        env=full,
        timeout=300,
    )


def _trl_load(path: str):
    """A model as TRL's trainers build one from a path: the class named by config.architectures[0]."""
    from trl.trainer.utils import create_model_from_path

    return create_model_from_path(path)


def test_saved_folder_names_its_architecture(tmp_path):
    model = load_causal_lm("judgeloop-tiny/causal-lm")
    assert not model.config.architectures  # built from config: nothing named yet
    save_model_folder(tmp_path / "m", model, load_tokenizer("judgeloop-tiny/causal-lm"))
    assert json.loads((tmp_path / "m" / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    assert type(_trl_load(str(tmp_path / "m"))).__name__ == "LlamaForCausalLM"


def test_cached_folder_without_architectures_is_repaired_and_printed(tmp_path, monkeypatch):
    """A SmolLM2 folder written before the fix (no ``architectures``) gets it on the next resolve; the CLI
    prints that folder and TRL loads from it."""
    monkeypatch.setenv("JUDGELOOP_CACHE", str(tmp_path))
    folder = tmp_path / "models" / SMOL.replace("/", "--")
    save_model_folder(
        folder, load_causal_lm("judgeloop-tiny/causal-lm"), load_tokenizer("judgeloop-tiny/causal-lm")
    )
    config = json.loads((folder / "config.json").read_text())
    del config["architectures"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(TypeError):
        _trl_load(str(folder))  # the bug: TRL reads config.architectures[0]
    done = _cli(SMOL, JUDGELOOP_CACHE=str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(folder)
    assert json.loads((folder / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    assert type(_trl_load(done.stdout.strip())).__name__ == "LlamaForCausalLM"
    assert resolve_model_path(SMOL) == str(folder)


@pytest.mark.slow
def test_cli_prints_the_smollm2_folder_plain_transformers_loads():
    done = _cli(SMOL)
    assert done.returncode == 0, done.stderr
    path = done.stdout.strip()
    assert Path(path).is_dir() and not done.stdout.strip().count("\n")
    config = transformers.AutoConfig.from_pretrained(path)
    assert config.architectures == ["LlamaForCausalLM"]
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    assert 130e6 < sum(p.numel() for p in model.parameters()) < 140e6
    assert type(getattr(transformers, config.architectures[0]).from_pretrained(path)) is type(model)


def test_hub_id_offline_fails_fast_with_the_folder_command(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    start = time.perf_counter()
    with pytest.raises(ValueError) as err:
        load_causal_lm("no-such-org/no-such-model")
    assert time.perf_counter() - start < 2.0
    msg = str(err.value)
    assert "\n" not in msg and "'no-such-org/no-such-model'" in msg and "HF_HUB_OFFLINE is set" in msg
    assert "run python -m judgeloop.models no-such-org/no-such-model and pass the folder" in msg
    with pytest.raises(
        ValueError, match=r"\(python -m judgeloop.models no-such-org/x prints its local folder\)"
    ):
        check_model("no-such-org/x", "policy.model")  # a config key's check gives the same advice


@pytest.mark.slow
def test_hub_id_without_network_fails_fast():
    """The hub unreachable (a closed port stands for no network) and HF_HUB_OFFLINE unset: the same advice,
    from the loader and from the CLI, without transformers' retries."""
    env = {"HF_HUB_OFFLINE": "0", "TRANSFORMERS_OFFLINE": "0", "HF_ENDPOINT": "http://127.0.0.1:9"}
    code = (
        "import time; from judgeloop.models import load_causal_lm\n"
        "t = time.perf_counter()\n"
        "try: load_causal_lm('no-such-org/no-such-model')\n"
        "except ValueError as e: print(round(time.perf_counter() - t, 2)); print(e)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": SRC, **env},
    )
    seconds, msg = done.stdout.strip().split("\n")
    assert float(seconds) < 2.0, done.stdout
    assert "the hub cannot be reached" in msg
    assert "run python -m judgeloop.models no-such-org/no-such-model and pass the folder" in msg
    cli = _cli("no-such-org/no-such-model", **env)
    assert cli.returncode == 2 and cli.stdout == ""
    (line,) = cli.stderr.strip().split("\n")
    assert line.startswith("judgeloop.models: error: model 'no-such-org/no-such-model' is not local")


def test_cli_rejects_a_missing_path_and_bad_usage(tmp_path):
    done = _cli(str(tmp_path / "nope"))
    assert done.returncode == 2 and "is not a directory" in done.stderr and done.stderr.count("\n") == 1
    assert _cli().returncode == 2
