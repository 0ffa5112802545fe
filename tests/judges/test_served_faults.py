"""The served judge under faults a user, a server, a proxy or a disk can produce: each ends as a masked
``failed`` pair or one line (exit status 2 through the command line), within the configured timeouts,
never a traceback or a hang. The servers are judgeloop's loopback server (``testing/openai_compat.py``
on the tiny Llama), scripted where a real server cannot produce the fault on demand."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from judgeloop.errors import UserError
from judgeloop.judges import JudgeConfig, ServerConfig, build_judge
from judgeloop.testing.openai_compat import Handler
from served_common import TINY, calibrate_served_tiny_args, start_server, stop_server

ROOT = Path(__file__).resolve().parents[2]
ARTICLE, A, B = ["The cat sat on the mat today. It was warm."], ["A cat sat."], ["It was warm."]


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


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--pairs", "0"], "--pairs 0; it must be at least 1"),
        (["--repeats", "0"], "--repeats 0; it must be at least 1"),
        (["--concurrency", "4", "0"], "--concurrency 0; every level must be at least 1"),
        (["--base-url", "http://127.0.0.1:9"], "--base-url needs --model"),
    ],
)
def test_the_profile_script_refuses_bad_settings_in_one_line_before_any_server(argv, message, capsys):
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "profile_served", ROOT / "scripts" / "profile_served_judge.py"
    )
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)  # type: ignore[union-attr]
    with pytest.raises(SystemExit) as stop:
        script.main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert stop.value.code == 2 and len(err) == 1 and message in err[0], err


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


class _Faulty(Handler):
    """Answers each judgement request with the next scripted fault (``(status, body, headers)``, or
    ``"drip"``: a body sent a byte at a time), then for real; ``repeat``: the last fault for ever.
    ``models``: the body of ``GET /v1/models`` instead of the real one."""

    script: list = []
    repeat = False
    models: str | None = None

    def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
        if self.path == "/v1/models" and self.models is not None:
            self._send(200, self.models)
        else:
            super().do_GET()

    def fault(self) -> bool:
        if not self.script:
            return False
        kind = self.script[0] if self.repeat and len(self.script) == 1 else self.script.pop(0)
        if kind == "drip":
            raw = b'{"choices": [{"text": "A"}]}' + b" " * 40
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            for byte in raw:
                self.wfile.write(bytes([byte]))
                self.wfile.flush()
                time.sleep(0.1)
            return True
        status, body, headers = kind
        self._send(status, body, headers)
        return True


@pytest.fixture
def faulty(tiny_lm):
    srv, url = start_server(tiny_lm, handler=_Faulty)
    yield srv, url
    _Faulty.script, _Faulty.repeat, _Faulty.models = [], False, None
    stop_server(srv)


def _judge(url, **server):
    return build_judge(
        JudgeConfig(
            type="served",
            model=TINY,
            position_debias=False,
            server=ServerConfig(base_url=url, model=TINY, **server),
        )
    )


def _within(seconds: float, fn):
    """``fn()``'s result, failing the test if it takes more than ``seconds`` (a hang, not a slow run)."""
    box: list = []
    worker = threading.Thread(target=lambda: box.append(fn()), daemon=True)
    worker.start()
    worker.join(seconds)
    assert not worker.is_alive(), f"still running after {seconds} s: a hang"
    return box[0]


@pytest.mark.parametrize(
    "after", ["99999999", "1e9", "-5", "soon", "nan", "inf", "Wed, 21 Oct 2099 07:28:00 GMT", "0.05"]
)
def test_any_retry_after_waits_at_most_the_timeout(faulty, after):
    srv, url = faulty
    judge = _judge(url, route="vllm", timeout_s=1.0, max_retries=1, backoff_s=0.01)
    _Faulty.script[:] = [(429, {"error": "slow down"}, {"Retry-After": after})]
    t0 = time.monotonic()
    out = _within(20, lambda: judge(ARTICLE, A, B))
    assert out.status == ["ok"] and judge.client.retries == 1
    assert time.monotonic() - t0 < 10


def _verdicts(judge, values):
    a, b = judge.verdict_ids
    return {f"token_id:{a}": values[0], f"token_id:{b}": values[1]}


WRONG_SHAPES = {
    "not JSON": lambda j: "{not json",
    "a list": lambda j: "[]",
    "a string choice": lambda j: json.dumps({"choices": ["A"]}),
    "a list of log-probabilities": lambda j: json.dumps(
        {"choices": [{"text": "A", "logprobs": {"top_logprobs": [[1]]}}]}
    ),
    "no log-probabilities": lambda j: json.dumps({"choices": [{"text": "A", "logprobs": None}]}),
    "a NaN log-probability": lambda j: json.dumps(
        {"choices": [{"text": "A", "logprobs": {"top_logprobs": [_verdicts(j, [float("nan"), -1.0])]}}]}
    ),
    "a positive log-probability": lambda j: json.dumps(
        {"choices": [{"text": "A", "logprobs": {"top_logprobs": [_verdicts(j, [3.0, -1.0])]}}]}
    ),
    "a string log-probability": lambda j: json.dumps(
        {"choices": [{"text": "A", "logprobs": {"top_logprobs": [_verdicts(j, ["x", -1.0])]}}]}
    ),
}


@pytest.mark.parametrize("shape", list(WRONG_SHAPES))
def test_a_reply_of_the_wrong_shape_or_values_is_failed_never_scored_nor_cached(faulty, tmp_path, shape):
    srv, url = faulty
    db = str(tmp_path / "j.sqlite")
    judge = _judge(url, route="vllm", timeout_s=2.0, max_retries=1, backoff_s=0.01, cache_path=db)
    _Faulty.script[:], _Faulty.repeat = [(200, WRONG_SHAPES[shape](judge), None)], True
    out = _within(20, lambda: judge(ARTICLE, A, B))
    assert out.status == ["failed"] and np.isnan(out.scores).all() and judge.failures
    _Faulty.script[:], _Faulty.repeat = [], False
    again = _judge(url, route="vllm", cache_path=db)
    assert again(ARTICLE, A, B).status == ["ok"] and again.client.cache_hits == 0  # nothing was cached


def test_a_reply_that_trickles_in_fails_within_the_timeout(faulty):
    srv, url = faulty
    judge = _judge(url, route="vllm", timeout_s=1.0, max_retries=0)
    _Faulty.script[:] = ["drip"]  # 68 bytes at 0.1 s each: no read waits 1 s, the whole takes 7
    t0 = time.monotonic()
    out = _within(20, lambda: judge(ARTICLE, A, B))
    assert out.status == ["failed"] and time.monotonic() - t0 < 4


@pytest.mark.parametrize(
    "models",
    ["<html>502 Bad Gateway</html>", "[1, 2]", '{"data": "x"}', '{"data": [{"name": "m"}]}', '{"data": [1]}'],
)
def test_a_models_answer_that_is_no_model_list_is_one_line(faulty, models):
    srv, url = faulty
    _Faulty.models = models
    with pytest.raises(
        UserError, match=r"/v1/models answered something that is not an OpenAI model list"
    ) as err:
        _judge(url)
    assert "\n" not in str(err.value)


def _foreign(path):
    import sqlite3

    db = sqlite3.connect(path)
    db.execute("CREATE TABLE replies (id INTEGER, payload BLOB)")
    db.commit()
    db.close()


def _read_only(path):
    path.write_bytes(b"")
    path.chmod(0o444)


CACHE_FAULTS = {
    "not a database": (lambda p: p.write_bytes(b"\x00garbage" * 500), "is not an SQLite judgement cache"),
    "another program's database": (_foreign, "is not an SQLite judgement cache"),
    "a read-only file": (_read_only, "cannot be written"),
    "a folder": (lambda p: p.mkdir(), "cannot be opened"),
}


@pytest.mark.parametrize("fault", list(CACHE_FAULTS))
def test_a_cache_file_that_cannot_serve_is_one_line_before_any_judging(tiny_server, tmp_path, fault):
    if fault == "a read-only file" and os.geteuid() == 0:
        pytest.skip("root writes a read-only file")
    damage, message = CACHE_FAULTS[fault]
    path = tmp_path / "judgements.sqlite"
    damage(path)
    with pytest.raises(UserError, match=rf"judge.server.cache_path={path}: .*{message}") as err:
        _judge(tiny_server, route="vllm", cache_path=str(path))
    assert "\n" not in str(err.value)


def test_a_damaged_cached_judgement_is_asked_again_and_replaced(tiny_server, tmp_path):
    import sqlite3

    path = tmp_path / "judgements.sqlite"
    first = _judge(tiny_server, route="vllm", cache_path=str(path))
    ok = first(ARTICLE, A, B)
    db = sqlite3.connect(path)
    db.execute("UPDATE replies SET reply = ?", ('{"logprobs": [1, 2',))
    db.commit()
    db.close()
    again = _judge(tiny_server, route="vllm", cache_path=str(path))
    out = again(ARTICLE, A, B)
    assert out.status == ["ok"] and again.client.cache_hits == 0 and again.client.calls == 1
    np.testing.assert_array_equal(out.scores, ok.scores)
    third = _judge(tiny_server, route="vllm", cache_path=str(path))
    assert third(ARTICLE, A, B).status == ["ok"] and third.client.cache_hits == 1  # replaced


def test_a_cache_that_fails_mid_run_loses_no_judgement(tiny_server, tmp_path, caplog):
    """The disk fills or the file is taken away during a run: the judgements already paid for are used,
    one warning says they were not kept."""
    path = tmp_path / "judgements.sqlite"
    judge = _judge(tiny_server, route="vllm", cache_path=str(path))
    judge.client._cache._db.close()  # every later read or write of the file fails
    out = judge(ARTICLE * 3, A * 3, ["It was warm.", "Warm.", "A mat."])
    assert out.status == ["ok"] * 3
    assert "judge.server.cache_path" in caplog.text and "not kept" in caplog.text


def test_another_top_logprobs_k_is_not_served_from_the_cache(tiny_server, tmp_path):
    db = str(tmp_path / "j.sqlite")
    _judge(tiny_server, route="top_logprobs", top_logprobs=5, cache_path=db)(ARTICLE, A, B)
    wider = _judge(tiny_server, route="top_logprobs", top_logprobs=50, cache_path=db)
    wider(ARTICLE, A, B)
    assert wider.client.cache_hits == 0 and wider.client.calls == 1  # k=5's bound is not k=50's answer


def test_a_server_that_failed_the_first_call_is_probed_again_not_judged_on_text(faulty, tmp_path):
    srv, url = faulty
    judge = _judge(url, max_retries=0)  # route: auto
    _Faulty.script[:], _Faulty.repeat = [(503, {"error": "starting"}, None)], True
    assert judge(ARTICLE, A, B).status == ["failed"] and judge.route == ""
    _Faulty.script[:], _Faulty.repeat = [], False  # the server is up now
    assert judge(ARTICLE, ["Cat."], B).status == ["ok"] and judge.route == "vllm"
