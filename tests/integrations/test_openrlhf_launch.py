"""The OpenRLHF launch line the docs give, parsed by OpenRLHF 0.11.2's own ``train_ppo_ray`` argument
parser and run through its own checks: its reward-server URL is where the documented ``serve-judge``
line listens (host, port, judgeloop's OpenRLHF route) and its samples per prompt are the server's group
size. The parser is built from ``openrlhf/cli/train_ppo_ray.py`` itself (the ``__main__`` block, which
defines it inline), stopping before ``train``, so neither Ray nor a GPU starts."""

from __future__ import annotations

import argparse
import ast
import datetime
import os
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import openrlhf  # Makefile: openrlhf --no-deps; its client path's imports in the dev extras
import pytest

from judgeloop.config import load_config
from judgeloop.serving.config import ServeConfig
from judgeloop.serving.openrlhf import ROUTE
from launch_lines import launch_lines  # tests/ is on pytest's pythonpath

ROOT = Path(__file__).resolve().parents[2]
PAGES = ["integrations.md", "serving.md"]


def openrlhf_main(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> Any:
    """``python -m openrlhf.cli.train_ppo_ray ARGV`` up to its call of ``train(args)``: OpenRLHF's parser,
    its ``hierarchize`` and every check and default it applies after parsing; returns the ``args`` it
    would train with. An argument it does not know exits 2, as on the command line."""
    from importlib.metadata import version

    from packaging.version import Version

    assert Version(version("openrlhf")) >= Version("0.11.2"), version("openrlhf")
    source = Path(openrlhf.__file__).parent / "cli" / "train_ppo_ray.py"
    tree = ast.parse(source.read_text())
    (main,) = [
        node
        for node in tree.body
        if isinstance(node, ast.If)
        and "__main__" in ast.unparse(node.test)
        and "__name__" in ast.unparse(node.test)
    ]
    calls = [ast.unparse(s) for s in main.body]
    assert calls[-1] == "train(args)", calls[-1]  # the block ends by training: replaced below
    trained: list[Any] = []
    scope = {"argparse": argparse, "os": os, "datetime": datetime.datetime, "train": trained.append}
    monkeypatch.setattr(sys, "argv", ["train_ppo_ray", *argv])
    exec(compile(ast.Module(body=main.body, type_ignores=[]), str(source), "exec"), scope)  # noqa: S102
    (args,) = trained
    return args


def documented(page: str) -> tuple[ServeConfig, list[str]]:
    """The page's serve-judge line (as a loaded config) and its OpenRLHF line (the arguments)."""
    serve = [
        a for a in launch_lines(page, ".venv/bin/judgeloop serve-judge") if any("openrlhf." in x for x in a)
    ]
    assert len(serve) == 1, f"docs/{page}: expected one serve-judge line for OpenRLHF, found {serve}"
    argv = serve[0]
    assert argv[0] == "--config"
    cfg = load_config(ServeConfig, ROOT / argv[1], argv[2:])
    (train,) = launch_lines(page, "python -m openrlhf.cli.train_ppo_ray")
    return cfg, train


@pytest.mark.parametrize("page", PAGES)
def test_the_documented_openrlhf_line_points_at_the_documented_server(page, monkeypatch):
    cfg, argv = documented(page)
    args = openrlhf_main(argv, monkeypatch)
    # OpenRLHF splits --reward.remote_url on commas: one server here
    assert args.reward.remote_url == [args.reward.remote_url[0]]
    url = urlsplit(args.reward.remote_url[0])
    assert (url.scheme, url.hostname, url.port, url.path) == ("http", cfg.server.host, cfg.server.port, ROUTE)
    assert not url.query or cfg.server.api_key_env  # a token only where the server asks for one
    # the server gathers each prompt's samples into one group of the trainer's size
    assert args.rollout.n_samples_per_prompt == cfg.openrlhf.n_samples_per_prompt > 1
    assert args.train.agent_func_path is None  # an agent script would replace the remote URL


def test_openrlhfs_parser_refuses_what_it_does_not_know(monkeypatch, capsys):
    """The parser is OpenRLHF's own: a misspelled reward flag exits 2 naming it, and its own checks run
    (group estimators need more than one sample per prompt)."""
    with pytest.raises(SystemExit) as exit_:
        openrlhf_main(["--reward.remote_uri", "http://127.0.0.1:8000/openrlhf/get_reward"], monkeypatch)
    assert exit_.value.code == 2 and "--reward.remote_uri" in capsys.readouterr().err
    with pytest.raises(AssertionError, match="requires n_samples_per_prompt > 1"):
        openrlhf_main(
            ["--algo.advantage.estimator", "group_norm", "--reward.remote_url", "http://x/y"], monkeypatch
        )
