"""The served judge under faults a user, a server, a proxy or a disk can produce: each ends as a masked
``failed`` pair or one line (exit status 2 through the command line), within the configured timeouts,
never a traceback or a hang. The servers are judgeloop's loopback server (``serving/openai_compat.py``
on the tiny Llama), scripted where a real server cannot produce the fault on demand."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from judgeloop.serving.openai_compat import LocalModel
from served_common import calibrate_served_tiny_args, start_server, stop_server

ROOT = Path(__file__).resolve().parents[2]
TINY = "judgeloop-tiny/causal-lm"


@pytest.fixture(scope="module")
def tiny_lm():
    return LocalModel(TINY)


@pytest.fixture(scope="module")
def tiny_server(tiny_lm):
    srv, url = start_server(tiny_lm)
    yield url
    stop_server(srv)


def _judgeloop(args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``judgeloop ARGS`` in a process of its own, on this checkout's code."""
    paths = [str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]
    full = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p), **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "judgeloop.cli", *args], capture_output=True, text=True, env=full, timeout=300
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "override, message",
    [
        (
            "judge.server.base_url=http://127.0.0.1:9/v1",
            "judge.server.base_url='http://127.0.0.1:9/v1': no server answers (ConnectError",
        ),
        (
            "judge.server.model=X",
            "judge.server.model='X' is not served at http://127.0.0.1:",
        ),
        (
            "judge.server.api_key_env=JUDGELOOP_NO_SUCH_KEY",
            "judge.server.api_key_env='JUDGELOOP_NO_SUCH_KEY' but $JUDGELOOP_NO_SUCH_KEY is not set",
        ),
    ],
)
def test_a_connect_time_error_is_one_line_and_exit_2_leaving_no_folder(
    tiny_server, tmp_path, override, message
):
    out = tmp_path / "run"
    done = _judgeloop(calibrate_served_tiny_args(tiny_server, out, override), {"JUDGELOOP_NO_SUCH_KEY": ""})
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
    # the log's progress lines, then the error: one line
    err = [line for line in done.stderr.splitlines() if not line[:8].replace(":", "").isdigit()]
    assert len(err) == 1 and err[0].startswith(f"judgeloop calibrate: error: {message}"), err
    assert not out.exists()  # nothing half-written


def test_the_bench_refuses_without_summeval_naming_the_path_and_the_flag(tmp_path, capsys):
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "bench_served_judge", ROOT / "scripts" / "bench_served_judge.py"
    )
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    missing = tmp_path / "summeval_dev.jsonl"
    with pytest.raises(SystemExit) as stop:
        bench.main(["--summeval", str(missing), "--base-url", "http://127.0.0.1:9", "--model", TINY])
    err = capsys.readouterr().err.strip().splitlines()
    assert stop.value.code == 2 and len(err) == 1
    assert f"--summeval {missing} is not a file" in err[0] and "--embedded-articles" in err[0]
    # the embedded articles, chosen explicitly: distinct pairs, each of an article and two of its sentences
    pairs = bench.summeval_pairs(3, 0, None)
    assert len(pairs) == 3 and all(a in art and b in art for art, a, b in pairs)
