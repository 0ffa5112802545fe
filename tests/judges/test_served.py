"""The served judge against a real OpenAI-compatible server on a loopback port (judgeloop's own
``testing/openai_compat.py`` wrapping the tiny Llama, and SmolLM2-135M-Instruct for parity), plus a scripted
server for the faults a real one cannot produce on demand (429 with Retry-After, 5xx, a hang, bad JSON)."""

from __future__ import annotations

import asyncio
import json
import math
import time
from pathlib import Path

import numpy as np
import pytest

from judgeloop.cli import main as cli
from judgeloop.judges import JudgeConfig, ServerConfig, build_judge
from judgeloop.judges.calibrated import CalibratedJudge
from judgeloop.judges.choice import ChoiceJudge
from judgeloop.judges.served import ServedJudge, verdict_score
from judgeloop.judges.served_client import Reply
from judgeloop.testing.openai_compat import Handler
from served_common import (
    ARTICLES,
    TINY,
    A,
    B,
    calibrate_served_tiny,
    grpo_trl_tiny,
    start_server,
    stop_server,
)

ROOT = Path(__file__).resolve().parents[2]


def _judge(url, model=TINY, tokenizer=TINY, **server):
    return build_judge(
        JudgeConfig(type="served", model=tokenizer, server=ServerConfig(base_url=url, model=model, **server))
    )


@pytest.mark.parametrize("route", ["auto", "vllm", "sglang"])
def test_exact_id_routes_equal_the_in_process_choice_judge(tiny_server, route):
    ref = ChoiceJudge(TINY, device="cpu")(ARTICLES, A, B)
    judge = _judge(tiny_server, route=route)
    out = judge(ARTICLES, A, B)
    assert judge.route == ("vllm" if route == "auto" else route)
    assert out.status == ["ok"] * 4
    np.testing.assert_allclose(out.scores, ref.scores, atol=1e-5)
    np.testing.assert_allclose(out.forward, ref.forward, atol=1e-5)


def test_auto_falls_back_to_top_logprobs_then_text(tiny_lm):
    srv, url = start_server(tiny_lm, routes=("completions",), logprobs=False)
    try:
        judge = _judge(url)
        out = judge(ARTICLES, A, B)
        assert judge.route == "text"
        # the tiny model's greedy token is not a verdict: unparsed, masked, never a preference
        assert set(out.status) <= {"text_only", "unparsed"} and np.isnan(out.scores[~out.valid]).all()
    finally:
        stop_server(srv)


def test_top_logprobs_route_with_the_whole_vocabulary_is_exact(tiny_server, tiny_lm):
    ref = ChoiceJudge(TINY, device="cpu")(ARTICLES, A, B)
    vocab = len(tiny_lm.tokenizer)
    out = _judge(tiny_server, route="top_logprobs", top_logprobs=vocab)(ARTICLES, A, B)
    assert out.status == ["ok"] * 4
    np.testing.assert_allclose(out.scores, ref.scores, atol=1e-5)


@pytest.mark.parametrize("route", ["vllm", "sglang", "top_logprobs"])
def test_text_prompts_equal_id_prompts(tiny_server, route):
    ids = _judge(tiny_server, route=route, prompt_format="ids")(ARTICLES, A, B)
    judge = _judge(tiny_server, route=route, prompt_format="text")
    text = judge(ARTICLES, A, B)
    assert judge.client.prompt_format == "text" and text.status == ids.status
    np.testing.assert_allclose(text.scores, ids.scores, atol=1e-6)


class _Retokenizing(Handler):
    """Counts one token more than it was sent, as a server whose tokenizer differs would."""

    def _completions(self, body):
        out = super()._completions(body)
        out["usage"]["prompt_tokens"] += 1
        return out


def test_a_text_prompt_the_server_tokenizes_otherwise_is_failed_never_scored(tiny_lm):
    srv, url = start_server(tiny_lm, handler=_Retokenizing)
    try:
        judge = _judge(url, route="vllm", prompt_format="text", max_retries=2)
        out = judge(ARTICLES, A, B)
        assert out.status == ["failed"] * 4 and judge.client.retries == 0  # not retried: it would recur
        assert "not the" in judge.failures[0] and "tokens" in judge.failures[0]
        # ids are taken as sent: the same server scores them
        assert _judge(url, route="vllm", prompt_format="ids")(ARTICLES, A, B).status == ["ok"] * 4
    finally:
        stop_server(srv)


def test_verdict_score_statuses_by_hand():
    ids, labels = (5, 7), ("A", "B")
    assert verdict_score(Reply({5: -1.0, 7: -3.0}), ids, labels) == (2.0, "ok")
    # B outside the top k: log P(B) <= bound = -4, so s >= -1 - (-4) = 3
    assert verdict_score(Reply({5: -1.0, 9: -4.0}, bound=-4.0), ids, labels) == (3.0, "outside_topk")
    assert verdict_score(Reply({7: -2.0, 9: -4.0}, bound=-4.0), ids, labels) == (-2.0, "outside_topk")
    assert math.isnan(verdict_score(Reply({9: -1.0}, bound=-1.0), ids, labels)[0])
    assert verdict_score(Reply(None, text=" B"), ids, labels) == (-1.0, "text_only")
    assert verdict_score(Reply(None, text="C"), ids, labels)[1] == "unparsed"
    assert verdict_score(Reply(error="HTTP 500"), ids, labels)[1] == "failed"


class _Scripted(Handler):
    """Answers the next scripted fault (then serves for real): 429 / 500 / hang / bad_json."""

    script: list[str] = []

    def fault(self) -> bool:
        if not self.script:
            return False
        kind = self.script.pop(0)
        if kind == "429":
            self._send(429, {"error": "rate limited"}, {"Retry-After": "0.05"})
        elif kind == "500":
            self._send(500, {"error": "boom"})
        elif kind == "bad_json":
            self._send(200, "{not json")
        elif kind == "hang":
            time.sleep(1.5)
            self._send(500, {"error": "late"})
        return True


@pytest.mark.parametrize("faults", [["429", "429"], ["500", "500"], ["bad_json"], ["hang"]])
def test_retries_recover_from_scripted_faults(tiny_lm, faults):
    srv, url = start_server(tiny_lm, handler=_Scripted)
    try:
        judge = _judge(url, route="vllm", timeout_s=0.5, backoff_s=0.01, concurrency=1)
        _Scripted.script[:] = list(faults)
        out = judge(ARTICLES[:1], A[:1], B[:1])
        assert out.status == ["ok"] and judge.client.retries == len(faults)
    finally:
        _Scripted.script[:] = []
        stop_server(srv)


def test_a_killed_server_masks_every_pair_or_stops_the_run(tiny_lm, caplog):
    srv, url = start_server(tiny_lm)
    masked = _judge(url, route="vllm", max_retries=1, backoff_s=0.01)
    stopping = _judge(url, route="vllm", max_retries=0, on_failure="stop")
    stop_server(srv)
    out = masked(ARTICLES, A, B)
    assert out.status == ["failed"] * 4 and np.isnan(out.scores).all() and not out.valid.any()
    assert "4 of 4 pairs failed" in caplog.text
    assert not masked._cache  # a failure is tried again next time, not remembered
    with pytest.raises(RuntimeError, match=r"4 of 4 pairs failed .*on_failure=stop"):
        stopping(ARTICLES, A, B)


class _VirtualClock:
    """Time for the rate limiter that moves only when the limiter sleeps (and then by exactly what it
    asked): what the limiter decides no longer depends on how fast a loaded machine answers."""

    def __init__(self) -> None:
        self.now, self.slept = 0.0, []

    def __call__(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds
        await asyncio.sleep(0)  # let the other requests run, as a real sleep does


def test_the_requests_per_minute_limit_holds_the_third_call_across_batches(tiny_server):
    from judgeloop.judges.served_client import _RateLimiter

    judge = build_judge(
        JudgeConfig(
            type="served",
            model=TINY,
            position_debias=False,
            server=ServerConfig(base_url=tiny_server, model=TINY, route="vllm", max_requests_per_minute=2),
        )
    )
    clock = _VirtualClock()
    limiter = judge.client._limiter
    assert (limiter.rpm, limiter.tpm, limiter.window_s) == (2, 0, 60.0)  # what the config asked for
    limiter.clock, limiter.sleep = clock, clock.sleep
    assert judge(ARTICLES[:2], A[:2], B[:2]).status == ["ok", "ok"]  # two requests: both at once
    assert clock.slept == [] and [t for t, _ in limiter._sent] == [0.0, 0.0]
    assert judge(ARTICLES[2:3], A[2:3], B[2:3]).status == ["ok"]  # the third waits for the window
    assert clock.slept == [60.0] and [t for t, _ in limiter._sent] == [60.0]  # sent a minute after the first
    assert judge.client.calls == 3
    # the tokens-per-minute limit on the same clock: a request that would pass the budget waits the window
    tokens = _RateLimiter(0, 100, clock=clock, sleep=clock.sleep)
    asyncio.run(tokens.wait(60))
    asyncio.run(tokens.wait(40))  # 100 in the window: at the limit, not over it
    assert clock.slept == [60.0]
    asyncio.run(tokens.wait(1))
    assert clock.slept == [60.0, 60.0] and clock.now == 120.0


def test_a_server_that_refuses_the_key_fails_in_one_line_before_any_judging(tiny_lm, monkeypatch):
    srv, url = start_server(tiny_lm, api_key="right-key")
    try:
        monkeypatch.setenv("JUDGELOOP_TEST_KEY", "wrong-key")
        with pytest.raises(
            ValueError, match=r"refused the API key \(HTTP 401\); set the key in \$JUDGELOOP_TEST_KEY"
        ) as err:
            _judge(url, route="vllm", api_key_env="JUDGELOOP_TEST_KEY")
        assert "\n" not in str(err.value) and "wrong-key" not in str(err.value)
        assert srv.requests == 0  # no completion was asked for
        monkeypatch.setenv("JUDGELOOP_TEST_KEY", "right-key")  # the control: the right key judges
        assert (
            _judge(url, route="vllm", api_key_env="JUDGELOOP_TEST_KEY")(ARTICLES, A, B).status == ["ok"] * 4
        )
    finally:
        stop_server(srv)


def test_the_tls_context_is_built_once_per_process_not_once_per_batch(tiny_server, monkeypatch):
    """httpx builds a TLS context (reading the CA bundle, ~90 ms) for every client, and the served client
    opens one per batch: the process's one context is passed instead, so batches after the first build none
    (scripts/profile_served_judge.py found the 90 ms in every ``score`` call)."""
    import ssl

    from judgeloop.judges import served_client

    built = []  # httpx builds a context by ssl.create_default_context (the CA bundle read), looked up per call
    real = ssl.create_default_context
    monkeypatch.setattr(ssl, "create_default_context", lambda *a, **k: built.append(1) or real(*a, **k))
    served_client._tls_context.cache_clear()
    judge = _judge(tiny_server, route="vllm")
    for k in range(3):
        assert judge([ARTICLES[k]], [A[k]], [B[k]]).status == ["ok"]
    assert len(built) == 1


def test_each_prompt_is_rendered_and_tokenized_once_per_batch(tiny_server, monkeypatch):
    """The requests and the scoring of a batch share its prompts' token ids: tokenizing is most of the
    client's own CPU time (scripts/profile_served_judge.py), and it was done twice per prompt."""
    judge = _judge(tiny_server, route="vllm")
    ref = judge(ARTICLES, A, B)
    calls = []
    real = judge.prompt_ids
    monkeypatch.setattr(judge, "prompt_ids", lambda pair: calls.append(pair) or real(pair))
    judge._cache.clear()  # the in-process cache would answer without a prompt
    out = judge(ARTICLES, A, B)
    assert len(calls) == 2 * len(ARTICLES)  # each order of each pair once
    np.testing.assert_array_equal(out.scores, ref.scores)
    assert judge._ids == {}  # nothing kept past the batch


def test_the_sqlite_cache_serves_a_second_run_without_calls(tiny_server, tmp_path):
    db = str(tmp_path / "j.sqlite")
    first = _judge(tiny_server, route="vllm", cache_path=db)
    s1 = first(ARTICLES, A, B).scores
    again = _judge(tiny_server, route="vllm", cache_path=db)
    s2 = again(ARTICLES, A, B).scores
    assert first.client.calls == 8 and again.client.calls == 0 and again.client.cache_hits == 8
    np.testing.assert_array_equal(s1, s2)


def test_a_rerun_under_route_auto_is_served_from_the_cache_with_no_request(tiny_lm, tmp_path):
    srv, url = start_server(tiny_lm)
    try:
        db = str(tmp_path / "j.sqlite")
        first = _judge(url, cache_path=db)  # route: auto, the default
        before = srv.requests
        s1 = first(ARTICLES, A, B).scores
        # 8 judgements; the probe's answer is the first of them, not asked twice
        assert first.route == "vllm" and srv.requests - before == 8 and first.client.cache_misses == 8
        again = _judge(url, cache_path=db)
        before = srv.requests
        s2 = again(ARTICLES, A, B).scores
        assert srv.requests == before and again.client.cache_hits == 8 and again.client.cache_misses == 0
        assert again.route == "vllm"
        np.testing.assert_array_equal(s1, s2)
    finally:
        stop_server(srv)


def test_a_server_that_answers_on_another_route_since_is_asked_again_never_mixed(tiny_lm, tmp_path, caplog):
    srv, url = start_server(tiny_lm)
    try:
        db = str(tmp_path / "j.sqlite")
        _judge(url, cache_path=db)(ARTICLES[:2], A[:2], B[:2])  # 4 prompts cached on vllm
        srv.routes = {"sglang"}  # the same URL now answers /generate only
        again = _judge(url, cache_path=db)
        before = srv.requests
        out = again(ARTICLES, A, B)  # 4 prompts cached on vllm, 4 new
        assert out.status == ["ok"] * 4 and again.route == "sglang"
        assert "now answers on route 'sglang'" in caplog.text
        # the vllm probe (404), the 4 new on sglang (the probe's answer one of them), the 4 cached asked again
        assert srv.requests - before == 9 and again.client.cache_hits == 0
        third = _judge(url, cache_path=db)
        before = srv.requests
        assert third(ARTICLES, A, B).status == ["ok"] * 4 and third.route == "sglang"
        assert srv.requests == before
    finally:
        stop_server(srv)


def test_a_recalibration_reads_every_judgement_from_the_cache_file_and_says_so(tiny_lm, tmp_path):
    srv, url = start_server(tiny_lm)
    try:
        db = f"judge.server.cache_path={tmp_path / 'judgements.sqlite'}"
        assert calibrate_served_tiny(url, tmp_path / "first", db) == 0
        before = srv.requests
        assert calibrate_served_tiny(url, tmp_path / "second", db) == 0
        assert srv.requests == before  # route: auto, and not one request
        first, second = (
            json.loads((tmp_path / r / "report.json").read_text())["judge"] for r in ("first", "second")
        )
        sent = first["stored_cache"]["misses"]
        assert sent > 0 and first["stored_cache"]["hits"] == 0
        assert second["stored_cache"] == {"hits": sent, "misses": 0} and second["status"] == first["status"]
    finally:
        stop_server(srv)


def test_a_run_where_every_pair_failed_gives_and_writes_the_status_counts(tiny_lm, tmp_path, capsys):
    srv, url = start_server(tiny_lm, routes=())  # /v1/models answers, every judgement is a 404
    try:
        out = tmp_path / "run"
        assert calibrate_served_tiny(url, out) == 2
    finally:
        stop_server(srv)
    err = capsys.readouterr().err.strip().splitlines()
    written = json.loads((out / "judge_status.json").read_text())["judge"]
    n_fit, n_test = (sum(written["status"][s].values()) for s in ("calibration", "test"))
    assert written["status"] == {"calibration": {"failed": n_fit}, "test": {"failed": n_test}} and n_fit > 0
    assert [line for line in err if line.startswith("judgeloop")] == [
        f"judgeloop calibrate: error: every calibration pair failed judging (judge statuses: calibration "
        f"{{failed: {n_fit}}}, test {{failed: {n_test}}}); nothing to fit: see the warnings above for why; "
        f"the counts are in {out / 'judge_status.json'}"
    ]
    assert json.loads((out / "run.json").read_text())["state"] == "stopped"


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"base_url": "http://127.0.0.1:9"}, "no server answers"),
        (
            {"model": "other/model"},
            r"judge.server.model='other/model' is not served at .* \(it serves \['judgeloop-tiny",
        ),
        ({"api_key_env": "JUDGELOOP_NO_SUCH_KEY"}, r"\$JUDGELOOP_NO_SUCH_KEY is not set"),
        ({"verdict": ["Answer A", "B"]}, "must be a single token"),
    ],
)
def test_bad_settings_fail_in_one_line_before_any_judging(tiny_server, settings, message):
    server = {"base_url": tiny_server, "model": TINY, **settings}
    verdict = server.pop("verdict", ["A", "B"])
    with pytest.raises(ValueError, match=message) as err:
        build_judge(
            JudgeConfig(type="served", model=TINY, verdict_tokens=verdict, server=ServerConfig(**server))
        )
    assert "\n" not in str(err.value)


def test_every_judgeloop_line_of_the_served_docs_loads(monkeypatch, capsys):
    from launch_lines import launch_lines  # tests/ is on pytest's pythonpath

    monkeypatch.chdir(ROOT)
    lines = launch_lines("served.md", ".venv/bin/judgeloop")
    assert len(lines) >= 5  # the lab, graded, vLLM, SGLang, hosted API, on_failure=stop
    for args in lines:
        assert cli([*args, "--print-config"]) == 0, args
    capsys.readouterr()


VLLM_LINE = ".venv-vllm/bin/python -m vllm.entrypoints.openai.api_server"


def _vllm_lines() -> list[str]:
    """The docs' vLLM launch lines as written (``\\`` continuations joined)."""
    from launch_lines import launch_lines

    lines = (ROOT / "docs" / "served.md").read_text().splitlines()
    texts = []
    for i, line in enumerate(lines):
        if line.startswith(VLLM_LINE):
            text = line
            while text.endswith("\\"):
                i += 1
                text = text[:-1] + " " + lines[i].strip()
            texts.append(text)
    assert len(texts) == len(launch_lines("served.md", VLLM_LINE))
    return texts


def test_the_docs_vllm_line_serves_the_id_the_shipped_config_asks_for():
    """The line runs where ``make vllm`` built vLLM (``python -m``, not the failing ``vllm`` command), and
    its ``--served-model-name`` is the config's ``judge.server.model`` (a folder path would be the id)."""
    import shlex

    import yaml

    config = yaml.safe_load((ROOT / "configs/calibrate/summeval_served.yaml").read_text())
    texts = _vllm_lines()
    assert len(texts) >= 2  # the page's opening block and the vLLM section
    assert not any(
        line.startswith("vllm serve") for line in (ROOT / "docs/served.md").read_text().splitlines()
    )
    for text in texts:
        args = shlex.split(text)[len(shlex.split(VLLM_LINE)) :]
        assert args[args.index("--served-model-name") + 1] == config["judge"]["server"]["model"]
        assert args[args.index("--model") + 1].startswith("$(.venv/bin/python -m judgeloop.models ")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.skipif(
    not ((ROOT / ".venv-vllm/bin/python").is_file() and (ROOT / ".venv/bin/python").is_file()),
    reason="no .venv-vllm beside .venv in this checkout (make vllm builds it: 3.5 GB, see docs/vllm.md)",
)
def test_the_docs_vllm_line_runs_as_written_and_serves_the_judge(tmp_path):
    """The docs' line run by bash in the checkout (only the port changed, to a free one on loopback); the shipped
    config's model id then judges on the exact-id route."""
    import os
    import signal
    import subprocess
    import urllib.request

    text = _vllm_lines()[0]
    port = _free_port()
    assert " --port 8000 " in text
    with open(tmp_path / "vllm.log", "w") as log:
        proc = subprocess.Popen(
            # the line as written but for a free port, and on loopback only (vLLM binds every interface)
            ["bash", "-c", "exec " + text.replace(" --port 8000 ", f" --host 127.0.0.1 --port {port} ")],
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "HF_HUB_OFFLINE": "1"},
        )
    try:
        deadline = time.monotonic() + 600
        while True:
            assert proc.poll() is None, (tmp_path / "vllm.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the documented vLLM line did not serve within 600 s"
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5)
                break
            except OSError:
                time.sleep(2)
        smol = "HuggingFaceTB/SmolLM2-135M-Instruct"
        judge = _judge(f"http://127.0.0.1:{port}", model=smol, tokenizer=smol)
        out = judge(ARTICLES[:2], A[:2], B[:2])
        assert judge.route == "vllm" and out.status == ["ok", "ok"]
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)


def test_served_config_errors():
    with pytest.raises(ValueError, match="judge.type=served needs judge.server.base_url"):
        JudgeConfig(type="served")
    with pytest.raises(ValueError, match="judge.server.route='fast'"):
        ServerConfig(route="fast")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="judge.server.prompt_format='tokens'"):
        ServerConfig(prompt_format="tokens")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="set judge.type=served"):
        JudgeConfig(type="choice", server=ServerConfig(base_url="http://x", model="m"))


@pytest.fixture(scope="module")
def served_calibration(tiny_server, tmp_path_factory):
    """``judgeloop calibrate`` on the served tiny judge (embedded corpus, ROUGE labels): its output folder."""
    out = tmp_path_factory.mktemp("served_calibration") / "run"
    rc = calibrate_served_tiny(tiny_server, out, f"judge.server.cache_path={out / 'judgements.sqlite'}")
    assert rc == 0
    return out


def test_calibrate_writes_a_served_judge_that_loads_and_refuses_another_model(
    served_calibration, tiny_server
):
    from judgeloop.judges.calibrated import CARD_FILE

    report = json.loads((served_calibration / "report.json").read_text())
    assert report["judge"]["served"]["route"] == "vllm" and report["judge"]["served"]["model"] == TINY
    assert report["judge"]["status"]["test"] == {"ok": report["n_eval"] // 2}
    assert "route `vllm`" in (served_calibration / "report.md").read_text()
    folder = served_calibration / "calibrated_judge" / "platt"
    card = json.loads((folder / CARD_FILE).read_text())
    judge = CalibratedJudge.from_pretrained(folder)
    assert isinstance(judge.judge, ServedJudge)
    comp = judge.compare(ARTICLES, A, B)
    assert comp.status == ["ok"] * 4 and np.isfinite(comp.p).all()
    # the card: the route and each status the fit saw, per split; what the server reported of itself
    served = card["served"]
    assert served["route"] == "vllm" and served["model"] == TINY and served["extractor"] == "verdict"
    assert served["verdict_token_ids"] == list(judge.judge.verdict_ids)
    assert served["version"]["version"] == "judgeloop-openai-compat"
    assert served["max_logprobs"] == len(judge.judge.tokenizer)  # the loopback server's own figure
    assert "api_key" not in json.dumps(card).lower().replace("api_key_env", "")
    assert card["statuses"] == report["judge"]["status"]
    assert set(card["statuses"]) == {"calibration", "test"}
    assert card["statuses"]["calibration"] == {"ok": report["n_fit"]}  # every pair judged, none masked
    readme = (folder / "README.md").read_text()
    assert "Served: model `judgeloop-tiny/causal-lm`" in readme and "route `vllm`" in readme
    assert f"max logprobs {served['max_logprobs']}" in readme
    assert f"Judge statuses seen: {card['statuses']}" in readme
    with pytest.raises(ValueError, match=r"changes? \['server.model'\]|overrides change \['server.model'\]"):
        CalibratedJudge.from_pretrained(folder, ["server.model=other/model"])


def test_loading_against_a_server_of_another_model_is_one_line(served_calibration, tmp_path):
    import shutil

    from judgeloop.judges.calibrated import CARD_FILE

    folder = tmp_path / "judge"
    shutil.copytree(served_calibration / "calibrated_judge" / "platt", folder)
    card = json.loads((folder / CARD_FILE).read_text())
    card["served"]["model"] = "Qwen/Qwen3-8B"  # as if it had been fit on another model
    (folder / CARD_FILE).write_text(json.dumps(card))
    with pytest.raises(
        ValueError, match=r"calibrated on model 'Qwen/Qwen3-8B' but the server serves 'judgeloop-tiny"
    ):
        CalibratedJudge.from_pretrained(folder)


def test_the_served_judge_rewards_a_trl_grpo_trainer(served_calibration, tmp_path):
    out = grpo_trl_tiny(served_calibration / "calibrated_judge" / "platt", tmp_path / "grpo")
    assert out["report"]["steps"] == 2 and out["reward"].judge_calls == 2
    rewards = [r for call in out["reward"].history for r in call["rewards"]]
    assert rewards and all(r is None or np.isfinite(r) for r in rewards)


def test_a_panel_with_a_served_member_calibrates_and_reloads(tiny_server, tmp_path):
    """A panel takes a served judge as a member like any other: ``judgeloop calibrate`` on a panel of the
    served tiny judge and an objective judge writes a calibrated panel whose served member judges again
    after a reload, its statuses counted."""
    import yaml

    cfg = yaml.safe_load((ROOT / "configs/calibrate/summeval_served.yaml").read_text())
    served = {**cfg["judge"], "model": TINY, "batch_size": 4}
    served["server"] = {
        **served["server"],
        "base_url": tiny_server,
        "model": TINY,
        "cache_path": str(tmp_path / "judgements.sqlite"),
    }
    cfg["judge"] = {
        "type": "panel",
        "panel": {
            "combine": "mean_logit",
            "members": [served, {"type": "objective", "signal": "length", "scale": 5.0}],
        },
    }
    cfg["data"] = {"format": "embedded", "embedded_size": 40, "split": cfg["data"]["split"]}
    cfg.update(
        labels={"type": "rouge"}, methods=["platt"], max_pairs_per_article=3, output_dir=str(tmp_path / "run")
    )
    path = tmp_path / "panel.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert cli(["calibrate", "--config", str(path)]) == 0
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["judge"]["status"]["test"] == {"ok": report["n_eval"] // 2}
    judge = CalibratedJudge.from_pretrained(tmp_path / "run" / "calibrated_judge" / "platt")
    (_, member), _ = judge.judge.members
    assert isinstance(member, ServedJudge) and member.client.cfg.base_url == tiny_server
    comp = judge.compare(ARTICLES, A, B)
    assert comp.status == ["ok"] * 4 and np.isfinite(comp.p).all()
