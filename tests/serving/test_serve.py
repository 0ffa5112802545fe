"""The judge server as users run it: ``judgeloop serve-judge`` started as a real process on a free
loopback port and called over HTTP (no test client): answers equal the in-process calibrated judge
bit for bit on the same batch, and within float rounding when the server merges requests; the OpenRLHF route answers OpenRLHF's own client code; verl's route is tested through verl in tests/integrations/test_verl.py;
bad requests get their codes and one-line reasons; 16 concurrent clients lose nothing; SIGTERM drains.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from judgeloop.calibration import PlattCalibrator
from judgeloop.judges import JudgeConfig
from judgeloop.judges.calibrated import CalibratedJudge
from judgeloop.rewards import Group, RewardConfig, score_groups

REPO = Path(__file__).resolve().parents[2]
CONFIG = str(REPO / "configs" / "serve" / "judge.yaml")
JUDGELOOP = str(Path(sys.executable).parent / "judgeloop")

ARTICLES = [
    "The city council voted on Tuesday to expand the bus network to the northern suburbs, citing rising demand.",
    "A new study finds that regular walking lowers blood pressure in adults over sixty, researchers said.",
    "The football club confirmed its coach will leave at the end of the season after five years in charge.",
]
SUMMARIES = [
    "The council expanded buses to the north.",
    "Council votes to extend bus lines to northern suburbs because demand rises.",
    "Buses.",
    "Walking lowers blood pressure in older adults, a study finds.",
    "A study about walking.",
    "The coach leaves the club after five years.",
    "The club's coach will depart at season's end after five years.",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def serve(
    judge_path: Path, *overrides: str, env: dict[str, str] | None = None
) -> Iterator[tuple[str, subprocess.Popen]]:
    """A real ``judgeloop serve-judge`` process; yields its base URL once ``/health`` answers."""
    port = free_port()
    proc = subprocess.Popen(
        [
            JUDGELOOP,
            "serve-judge",
            "--config",
            CONFIG,
            f"judge_path={judge_path}",
            f"server.port={port}",
            *overrides,
        ],
        env={**os.environ, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            if proc.poll() is not None:
                raise AssertionError(
                    f"server exited {proc.returncode}: {proc.stdout.read() if proc.stdout else ''}"
                )
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            assert time.monotonic() < deadline, "server did not come up in 90 s"
            time.sleep(0.2)
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()


def items(n: int, seed: int) -> list[dict[str, str]]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        i, j = rng.choice(len(SUMMARIES), 2, replace=False)
        out.append(
            {"prompt": ARTICLES[int(rng.integers(len(ARTICLES)))], "a": SUMMARIES[i], "b": SUMMARIES[j]}
        )
    return out


def local(judge: CalibratedJudge, batch: list[dict[str, str]]) -> dict[str, list]:
    out = judge.compare([x["prompt"] for x in batch], [x["a"] for x in batch], [x["b"] for x in batch])
    return {
        "p": [float(v) if np.isfinite(v) else None for v in out.p],
        "logit": [float(v) if np.isfinite(v) else None for v in out.logit],
        "status": out.status,
    }


@pytest.fixture(scope="module")
def tiny_judge_path(tiny_calibration: Path) -> Path:
    return tiny_calibration / "calibrated_judge" / "platt"


@pytest.fixture(scope="module")
def tiny_server(tiny_judge_path: Path) -> Iterator[str]:
    with serve(
        tiny_judge_path,
        "server.max_items_per_request=50",
        "server.max_chars_per_text=5000",
        "server.max_body_bytes=200000",
    ) as (url, _):
        yield url


@pytest.fixture(scope="module")
def length_judge_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("length_judge") / "judge"
    platt = PlattCalibrator().load_state_dict(
        {
            "method": "platt",
            "symmetric": True,
            "min_points": 10,
            "n_fit_": 100,
            "params": {"a_": 0.7, "b_": 0.0, "fit_intercept": False, "target_smoothing": False},
        }
    )
    CalibratedJudge(JudgeConfig(type="objective", signal="length", scale=0.5), platt).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def length_server(length_judge_path: Path) -> Iterator[str]:
    with serve(
        length_judge_path,
        "server.api_key_env=JUDGE_TEST_TOKEN",
        "server.max_batch_size=64",
        "server.max_wait_ms=10",
        "openrlhf.n_samples_per_prompt=4",
        "server.num_threads=3",  # no torch work in this judge: the setting only has to reach its thread
        env={"JUDGE_TEST_TOKEN": "s3cret"},
    ) as (url, _):
        yield url


AUTH = {"Authorization": "Bearer s3cret"}


# --- answers equal the in-process judge -----------------------------------------------------------
def test_compare_equals_in_process(tiny_server: str, tiny_judge_path: Path) -> None:
    judge = CalibratedJudge.from_pretrained(tiny_judge_path)
    for seed, n in [(0, 1), (1, 7), (2, 30)]:
        batch = items(n, seed)
        got = httpx.post(tiny_server + "/v1/compare", json={"items": batch}, timeout=60)
        assert got.status_code == 200, got.text
        assert got.json() == local(judge, batch)  # one request alone, one call: the same floats, statuses


def test_merged_requests_equal_in_process_within_float_rounding(tiny_judge_path: Path) -> None:
    """Concurrent requests merged into one judge call are padded to the whole call's longest text, so
    their floats may differ from the request judged alone in the last bits (docs/serving.md gives the
    measured bound, scripts/server_merge_bound.py): statuses equal, p within 1e-6, the logit within 1e-5 relative (float32)."""
    with serve(tiny_judge_path, "server.max_wait_ms=200") as (url, _):
        batches = [items(3 + k % 4, seed=500 + k) for k in range(8)]

        async def all_at_once() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=url, timeout=120) as http:
                return await asyncio.gather(*(http.post("/v1/compare", json={"items": b}) for b in batches))

        answers = asyncio.run(all_at_once())
        stats = httpx.get(url + "/v1/info").json()["stats"]
    assert stats["requests"] == 8 and stats["judge_calls"] < 8  # merged
    judge = CalibratedJudge.from_pretrained(tiny_judge_path)  # its own cache: each request alone
    for batch, got in zip(batches, answers):
        assert got.status_code == 200, got.text
        want = local(judge, batch)
        assert got.json()["status"] == want["status"]
        np.testing.assert_allclose(got.json()["p"], want["p"], rtol=0, atol=1e-6)
        np.testing.assert_allclose(got.json()["logit"], want["logit"], rtol=1e-5, atol=1e-6)  # float32 logits


def test_a_body_without_json_content_type_is_read_as_json(tiny_server: str, tiny_judge_path: Path) -> None:
    """``curl URL -d '{...}'`` declares a form body; the server reads it as the JSON it is."""
    import json

    batch = items(2, seed=3)
    for content_type in ("application/x-www-form-urlencoded", None):
        headers = {"content-type": content_type} if content_type else {}
        got = httpx.post(tiny_server + "/v1/compare", content=json.dumps({"items": batch}), headers=headers)
        assert got.status_code == 200, got.text
        assert got.json() == local(CalibratedJudge.from_pretrained(tiny_judge_path), batch)


def test_info_names_judge_and_held_out_figures(tiny_server: str, tiny_judge_path: Path) -> None:
    info = httpx.get(tiny_server + "/v1/info").json()
    judge = CalibratedJudge.from_pretrained(tiny_judge_path)
    assert info["calibrator"] == "platt" and info["judge"]["model"] == "judgeloop-tiny/encoder"
    assert info["card"]["held_out"] == judge.card["held_out"]
    assert info["server"]["host"] == "127.0.0.1" and "api_key_env" not in info["server"]


def test_judge_cache_is_shared_across_requests(tiny_server: str) -> None:
    batch = items(5, seed=77)
    first = httpx.get(tiny_server + "/v1/info").json()["stats"]
    assert httpx.post(tiny_server + "/v1/compare", json={"items": batch}, timeout=60).status_code == 200
    second = httpx.get(tiny_server + "/v1/info").json()["stats"]
    again = httpx.post(tiny_server + "/v1/compare", json={"items": batch}, timeout=60)  # another request
    third = httpx.get(tiny_server + "/v1/info").json()["stats"]
    assert again.status_code == 200
    distinct = len({(x["prompt"], x["a"], x["b"]) for x in batch})
    assert second["judge_cache_misses"] - first["judge_cache_misses"] <= distinct
    assert third["judge_cache_hits"] - second["judge_cache_hits"] == len(batch)
    assert third["judge_cache_misses"] == second["judge_cache_misses"]


def test_rewards_equal_score_groups(tiny_server: str, tiny_judge_path: Path) -> None:
    judge = CalibratedJudge.from_pretrained(tiny_judge_path)
    groups = [
        Group(ARTICLES[0], SUMMARIES[:3]),
        Group(ARTICLES[1], [SUMMARIES[3], SUMMARIES[4], SUMMARIES[3]]),
    ]
    body = {"groups": [{"prompt": g.source, "completions": g.completions} for g in groups]}
    for settings in [{}, {"scheme": "round_robin", "m": 1, "aggregate": "bradley_terry"}]:
        got = httpx.post(tiny_server + "/v1/rewards", json={**body, **settings}, timeout=60)
        assert got.status_code == 200, got.text
        assert got.json()["rewards"] == score_groups(judge, groups, RewardConfig(**settings)).rewards


# --- the peers' own protocols --------------------------------------------------------------------
async def openrlhf_post(url: str, data: dict) -> dict:
    """OpenRLHF's client, as ``SingleTurnAgentExecutor._fetch_rewards_via_http`` posts (openrlhf/utils/agent.py):
    aiohttp, ``session.post(url, json=data)``, ``raise_for_status``, ``response.json()``."""
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=180)
    async with aiohttp.ClientSession(timeout=timeout) as session, session.post(url, json=data) as response:
        response.raise_for_status()
        return await response.json()


def test_openrlhf_batched_request_groups_by_prompt(tiny_server: str, tiny_judge_path: Path) -> None:
    judge = CalibratedJudge.from_pretrained(tiny_judge_path)
    prompts = [ARTICLES[0]] * 3 + [ARTICLES[1]] * 2
    completions = [SUMMARIES[0], SUMMARIES[1], SUMMARIES[2], SUMMARIES[3], SUMMARIES[4]]
    query = [p + c + "<|im_end|>" for p, c in zip(prompts, completions)]
    data = {"query": query, "prompts": prompts, "labels": [None] * 5}
    got = asyncio.run(openrlhf_post(tiny_server + "/openrlhf/get_reward", data))
    want = score_groups(
        judge, [Group(ARTICLES[0], completions[:3]), Group(ARTICLES[1], completions[3:])]
    ).rewards
    assert got["rewards"] == want[0] + want[1]
    assert got["scores"] == got["rewards"] and got["extra_logs"]["judge_reward"] == got["rewards"]


def test_openrlhf_per_sample_requests_form_one_group(length_server: str, length_judge_path: Path) -> None:
    """OpenRLHF 0.11 posts each sample alone; n_samples_per_prompt=4 gathers a prompt's four."""
    judge = CalibratedJudge.from_pretrained(length_judge_path)
    prompt = "<|im_start|>user\nSummarize: " + ARTICLES[2] + "<|im_end|>\n<|im_start|>assistant\n"
    completions = SUMMARIES[:4]

    async def four() -> list[dict]:
        url = length_server + "/openrlhf/get_reward?api_key=s3cret"
        one = [
            {"query": [prompt + c + "<|im_end|>"], "prompts": [prompt], "labels": [""]} for c in completions
        ]
        return await asyncio.gather(*(openrlhf_post(url, d) for d in one))

    before = httpx.get(length_server + "/v1/info", headers=AUTH).json()["stats"]
    got = [r["rewards"][0] for r in asyncio.run(four())]
    assert got == score_groups(judge, [Group(prompt, completions)]).rewards[0]
    after = httpx.get(length_server + "/v1/info", headers=AUTH).json()["stats"]
    # stats.requests counts the four posts; the batcher judged them as one group, one job
    assert after["requests"] - before["requests"] == 4
    assert after["judge_jobs"] - before["judge_jobs"] == 1
    assert after["openrlhf_groups"] - before["openrlhf_groups"] == 1


def test_a_short_group_is_answered_after_group_idle_s(length_judge_path: Path) -> None:
    """Two samples of a prompt when the server expects four (an eval run with fewer samples per prompt):
    OpenRLHF's own client (``SingleTurnAgentExecutor._fetch_rewards_via_http``) gets both rewards about
    ``group_idle_s`` after the second post, not after ``group_wait_s``; the group is counted partial."""
    from openrlhf.utils.agent import SingleTurnAgentExecutor

    judge = CalibratedJudge.from_pretrained(length_judge_path)
    prompt = "<|im_start|>user\nSummarize: " + ARTICLES[0] + "<|im_end|>\n<|im_start|>assistant\n"
    completions = SUMMARIES[:2]
    with serve(
        length_judge_path,
        "openrlhf.n_samples_per_prompt=4",
        "openrlhf.group_wait_s=120",
        "openrlhf.group_idle_s=1.5",
    ) as (url, _):
        executor = SingleTurnAgentExecutor(url + "/openrlhf/get_reward")

        async def two() -> list[list[dict]]:
            return await asyncio.gather(
                *(
                    executor._fetch_rewards_via_http([prompt + c + "<|im_end|>"], [prompt], [None])
                    for c in completions
                )
            )

        t0 = time.monotonic()
        got = asyncio.run(two())
        took = time.monotonic() - t0
        stats = httpx.get(url + "/v1/info").json()["stats"]
    assert 1.5 <= took < 30, (
        f"answered after {took:.1f} s"
    )  # group_wait_s=120 would outlast the client's 180 s
    assert [r[0]["rewards"][0] for r in got] == score_groups(judge, [Group(prompt, completions)]).rewards[0]
    assert stats["openrlhf_partial_groups"] == 1 and stats["openrlhf_groups"] == 1
    assert stats["requests"] == 2 and stats["judge_jobs"] == 1


@pytest.mark.parametrize(
    "override, message",
    [
        ("openrlhf.group_idle_s=0", "openrlhf.group_idle_s=0.0 must be in (0, 60]"),
        ("openrlhf.group_idle_s=90", "at most openrlhf.group_wait_s=60"),
    ],
)
def test_group_idle_s_is_range_checked(length_judge_path: Path, override: str, message: str) -> None:
    from judgeloop.config import ConfigError, load_config
    from judgeloop.serving.config import ServeConfig

    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(ServeConfig, CONFIG, [f"judge_path={length_judge_path}", override])


def test_openrlhf_empty_completion_gets_the_lowest_reward(tiny_server: str, tiny_judge_path: Path) -> None:
    """An empty completion is answered 200 (a 4xx would stop OpenRLHF's run): it loses to each non-empty
    completion of its group without a judge call, so its win rate is 0.0, and extra_logs flags it."""
    judge = CalibratedJudge.from_pretrained(tiny_judge_path)
    url = tiny_server + "/openrlhf/get_reward"
    before = httpx.get(tiny_server + "/v1/info").json()["stats"]
    prompt = ARTICLES[0]
    completions = [SUMMARIES[0], " ", SUMMARIES[1]]  # the middle one: whitespace, then <|im_end|>
    data = {
        "query": [prompt + c + "<|im_end|>" for c in completions],
        "prompts": [prompt] * 3,
        "labels": None,
    }
    got = asyncio.run(openrlhf_post(url, data))
    p = float(judge.compare([prompt], [SUMMARIES[0]], [SUMMARIES[1]]).p[0])  # P(0 beats 1)
    want = [(p + 1.0) / 2, 0.0, (1.0 - p + 1.0) / 2]  # each non-empty one also beats the empty one
    assert got["rewards"] == pytest.approx(want, abs=1e-12) and got["rewards"][1] == 0.0
    assert got["rewards"][1] < min(got["rewards"][0], got["rewards"][2])
    assert got["extra_logs"]["judge_empty"] == [0.0, 1.0, 0.0]
    assert set(got["extra_logs"]) == {"judge_reward", "judge_empty"}  # the same keys in every answer
    # a group of empty completions only: they tie (no judge call), still an answer for every sample
    both = {"query": [prompt + "<|im_end|>", prompt + "  <|im_end|>"], "prompts": [prompt] * 2}
    tie = asyncio.run(openrlhf_post(url, both))
    assert tie["rewards"] == [0.5, 0.5] and tie["extra_logs"]["judge_empty"] == [1.0, 1.0]
    after = httpx.get(tiny_server + "/v1/info").json()["stats"]
    assert after["openrlhf_empty_completions"] - before["openrlhf_empty_completions"] == 3
    assert after["comparisons"] - before["comparisons"] == 1  # only the two non-empty ones were judged


def test_openrlhf_empty_completion_per_sample(length_server: str, length_judge_path: Path) -> None:
    """The same when each sample comes alone and the group forms across requests."""
    judge = CalibratedJudge.from_pretrained(length_judge_path)
    prompt = "Summarize: " + ARTICLES[1] + "\n"
    completions = [SUMMARIES[3], "", SUMMARIES[4], SUMMARIES[3] + " Researchers said so."]

    async def four() -> list[dict]:
        url = length_server + "/openrlhf/get_reward?api_key=s3cret"
        one = [{"query": [prompt + c + "</s>"], "prompts": [prompt], "labels": [None]} for c in completions]
        return await asyncio.gather(*(openrlhf_post(url, d) for d in one))

    got = asyncio.run(four())
    rewards = [r["rewards"][0] for r in got]
    judged = score_groups(judge, [Group(prompt, [completions[0], completions[2], completions[3]])]).rewards[0]
    assert rewards[1] == 0.0 and [r["extra_logs"]["judge_empty"][0] for r in got] == [0.0, 1.0, 0.0, 0.0]
    # with the empty one beaten by all three, each win rate is (2 x its win rate among the three + 1) / 3
    assert [rewards[0], rewards[2], rewards[3]] == pytest.approx(
        [(2 * r + 1) / 3 for r in judged if r is not None], abs=1e-12
    )


# --- bad requests ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "body, status, reason",
    [
        (b'{"items": [', 400, "malformed JSON"),
        ({"items": [{"prompt": "x", "a": "y"}]}, 422, "items.0.b: Field required"),
        ({"items": [{"prompt": "x", "a": "y", "b": 3}]}, 422, "items.0.b"),
        ({"items": [], "colour": 1}, 422, "colour"),
        ({"items": [{"prompt": "x", "a": " ", "b": "y"}]}, 422, "items[0].a is empty"),
        ({"groups": [{"prompt": "x", "completions": []}]}, 422, "completions is empty"),
        ({"groups": [{"prompt": "x", "completions": ["a", ""]}]}, 422, "completions[1] is empty"),
        (
            {"groups": [{"prompt": "x", "completions": ["a", "b"]}], "scheme": "pairs"},
            422,
            "scheme' must be one of",
        ),
        ({"groups": [{"prompt": "x", "completions": ["a", "b"]}], "scheme": "anchor"}, 422, "anchor"),
        ({"items": [{"prompt": "x", "a": "y", "b": "z"}] * 51}, 413, "max_items_per_request=50"),
        ({"items": [{"prompt": "x" * 5001, "a": "y", "b": "z"}]}, 413, "max_chars_per_text=5000"),
        ({"items": [{"prompt": "x" * 4000, "a": "y", "b": "z"}] * 50}, 413, "max_body_bytes=200000"),
        ({"query": ["p a"], "prompts": ["p "], "labels": [None]}, 422, "no valid comparison"),
        ({"query": ["p a", "p b"], "prompts": ["p "], "labels": None}, 422, "must match"),
    ],
)
def test_bad_requests_get_their_code(tiny_server: str, body: object, status: int, reason: str) -> None:
    route = (
        "/v1/rewards"
        if "groups" in str(body)
        else "/openrlhf/get_reward"
        if "query" in str(body)
        else "/v1/compare"
    )
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    got = httpx.post(tiny_server + route, timeout=60, headers={"content-type": "application/json"}, **kwargs)  # type: ignore[arg-type]
    assert got.status_code == status, got.text
    assert reason in got.json()["error"] and "\n" not in got.json()["error"]
    assert httpx.get(tiny_server + "/health").status_code == 200  # still up


def test_bearer_token(length_server: str) -> None:
    body = {"items": items(2, 0)}
    assert httpx.post(length_server + "/v1/compare", json=body).status_code == 401
    wrong = httpx.post(length_server + "/v1/compare", json=body, headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and "bearer token" in wrong.json()["error"]
    assert httpx.post(length_server + "/v1/compare", json=body, headers=AUTH).status_code == 200
    assert httpx.get(length_server + "/health").status_code == 200  # health needs no token


def test_num_threads_reaches_the_judge_thread(length_server: str) -> None:
    """torch's thread count is per thread: server.num_threads must be set where the judge runs."""
    info = httpx.get(length_server + "/v1/info", headers=AUTH).json()
    assert info["judge_threads"] == 3 and info["server"]["num_threads"] == 3


@pytest.mark.slow
def test_not_a_judge_fails_before_binding(tmp_path: Path) -> None:
    port = free_port()
    done = subprocess.run(
        [JUDGELOOP, "serve-judge", "--config", CONFIG, f"judge_path={tmp_path}", f"server.port={port}"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and "is not a calibrated judge" in done.stderr
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))  # the port was never taken


def test_a_port_in_use_is_refused_before_serving() -> None:
    from judgeloop.commands.serve_judge import check_port
    from judgeloop.config import ConfigError

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(ConfigError, match=f"server.port={port} cannot be listened on"):
            check_port("127.0.0.1", port)


# --- load: 16 clients x 25 requests ----------------------------------------------------------------
def test_concurrent_clients_lose_nothing(length_server: str, length_judge_path: Path) -> None:
    judge = CalibratedJudge.from_pretrained(length_judge_path)
    before = httpx.get(length_server + "/v1/info", headers=AUTH).json()["stats"]

    async def client(k: int) -> list[tuple[list[dict], dict]]:
        out = []
        async with httpx.AsyncClient(base_url=length_server, headers=AUTH, timeout=60) as http:
            for r in range(25):
                batch = items(1 + (k + r) % 6, seed=1000 * k + r)
                got = await http.post("/v1/compare", json={"items": batch})
                assert got.status_code == 200, got.text
                out.append((batch, got.json()))
        return out

    async def all_clients() -> list[list[tuple[list[dict], dict]]]:
        return await asyncio.gather(*(client(k) for k in range(16)))

    results = [r for c in asyncio.run(all_clients()) for r in c]
    assert len(results) == 400
    for batch, got in results:
        assert got == local(judge, batch)  # each caller got its own answers, in order
    after = httpx.get(length_server + "/v1/info", headers=AUTH).json()["stats"]
    assert after["requests"] - before["requests"] == 400
    assert after["judge_calls"] - before["judge_calls"] < 400  # requests were merged


# --- a judge failure, SIGTERM ----------------------------------------------------------------------
def test_judge_failure_is_a_500_and_the_server_stays_up(length_judge_path: Path) -> None:
    """A judge that raises on one text (injected into a real CalibratedJudge): that request gets a 500
    body; a request merged into the same call, and later ones, are answered."""
    import uvicorn

    from judgeloop.config import load_config
    from judgeloop.serving.app import build_app
    from judgeloop.serving.config import ServeConfig

    judge = CalibratedJudge.from_pretrained(length_judge_path)
    inner = judge.judge
    assert inner is not None

    def breaking(articles, a, b, references=None):  # type: ignore[no-untyped-def]
        if "BOOM" in a:
            raise RuntimeError("the model ran out of memory")
        return inner(articles, a, b, references)

    judge.judge = breaking  # type: ignore[assignment]
    judge.judge.position_debias = False  # type: ignore[attr-defined]
    port = free_port()
    cfg = load_config(ServeConfig, CONFIG, [f"judge_path={length_judge_path}", "server.max_wait_ms=200"])
    server = uvicorn.Server(
        uvicorn.Config(build_app(judge, cfg), host="127.0.0.1", port=port, log_level="error")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    while not server.started:
        time.sleep(0.05)

    async def two() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            bad = {"items": [{"prompt": "x", "a": "BOOM", "b": "y"}]}
            good = {"items": items(3, 5)}
            return await asyncio.gather(
                http.post("/v1/compare", json=bad), http.post("/v1/compare", json=good)
            )

    bad, good = asyncio.run(two())
    assert bad.status_code == 500 and "ran out of memory" in bad.json()["error"]
    assert good.status_code == 200 and len(good.json()["p"]) == 3
    assert httpx.get(url + "/health").status_code == 200
    server.should_exit = True
    thread.join(timeout=10)


def test_sigterm_drains_in_flight_requests_and_exits_0(length_judge_path: Path) -> None:
    """SIGTERM with slow requests in flight (three /v1/compare requests parked in the batcher for 3 s,
    two OpenRLHF samples of a group of 4 that would wait 120 s): each gets its answer, the process exits
    0 (not -15) soon after, and the port is free again."""
    with serve(
        length_judge_path,
        "server.max_wait_ms=3000",
        "openrlhf.n_samples_per_prompt=4",
        "openrlhf.group_wait_s=120",
        "openrlhf.group_idle_s=120",
    ) as (url, proc):
        port = int(url.rsplit(":", 1)[1])
        answers: dict[str, httpx.Response] = {}

        def post(name: str, route: str, body: dict) -> None:
            answers[name] = httpx.post(url + route, json=body, timeout=60)

        prompt = "Summarize: " + ARTICLES[2] + "\n"
        calls: list[tuple[str, str, dict]] = [
            (f"compare{k}", "/v1/compare", {"items": items(3, 20 + k)}) for k in range(3)
        ]
        calls += [
            (f"sample{k}", "/openrlhf/get_reward", {"query": [prompt + s], "prompts": [prompt]})
            for k, s in enumerate(SUMMARIES[5:7])
        ]
        threads = [threading.Thread(target=post, args=c) for c in calls]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while True:  # all five in flight: three in the batcher, one open group of two
            stats = httpx.get(url + "/v1/info").json()["stats"]
            # five posts in flight; the batcher holds the three compare jobs, the group is not submitted yet
            if (
                stats["in_flight_requests"] == 5
                and stats["in_flight_jobs"] == 3
                and stats["openrlhf_open_groups"] == 1
            ):
                break
            assert time.monotonic() < deadline, stats
            time.sleep(0.05)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(timeout=60)
        status = proc.wait(timeout=60)
        took = time.monotonic() - t0
        log = proc.stdout.read() if proc.stdout else ""
        assert status == 0, log
        assert took < 30, f"drained in {took:.1f} s: the open group waited for its timer"
        for name, _, body in calls:
            got = answers[name]
            assert got.status_code == 200, (name, got.text)
            n = len(body.get("items", body.get("query", [])))
            assert len(got.json()["p" if "items" in body else "rewards"]) == n
        assert "stopped on SIGTERM after judging" in log
        with pytest.raises(httpx.ConnectError):
            httpx.get(url + "/health")
        from judgeloop.commands.serve_judge import check_port

        check_port("127.0.0.1", port)  # released: a restart passes the check that refuses a taken port


# --- a judge that reads references (issue 39: a judge states what it reads) ----------------------------
@pytest.fixture(scope="module")
def rouge_judge_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """ROUGE-L against the references as the judge (``judge.signal=rouge``): it reads references."""
    path = tmp_path_factory.mktemp("rouge_judge") / "judge"
    platt = PlattCalibrator().load_state_dict(
        {
            "method": "platt",
            "symmetric": True,
            "min_points": 10,
            "n_fit_": 100,
            "params": {"a_": 0.7, "b_": 0.0, "fit_intercept": False, "target_smoothing": False},
        }
    )
    CalibratedJudge(JudgeConfig(type="objective", signal="rouge", scale=5.0), platt).save_pretrained(path)
    return path


@pytest.mark.slow
@pytest.mark.parametrize(
    "routes, named, fix",
    [
        (
            (),
            "routes.openrlhf=true (/openrlhf/get_reward) and routes.verl=true (/verl/reward)",
            "set routes.openrlhf=false routes.verl=false",
        ),
        (
            ("routes.openrlhf=false",),
            "which routes.verl=true (/verl/reward) cannot",
            "set routes.verl=false to",
        ),
        (
            ("routes.verl=false",),
            "which routes.openrlhf=true (/openrlhf/get_reward) cannot",
            "set routes.openrlhf=false to",
        ),
    ],
)
def test_a_route_that_cannot_carry_references_is_refused_at_start(
    rouge_judge_path: Path, routes: tuple[str, ...], named: str, fix: str
) -> None:
    port = free_port()
    done = subprocess.run(
        [
            JUDGELOOP,
            "serve-judge",
            "--config",
            CONFIG,
            f"judge_path={rouge_judge_path}",
            f"server.port={port}",
            *routes,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    err = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(err) == 1, done.stderr
    assert "reads references (judge.signal=rouge)" in err[0] and named in err[0] and fix in err[0]
    assert "calibrate with judge.signal=length" in err[0]
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))  # the port was never taken


def test_a_references_judge_is_served_without_the_trainer_routes(rouge_judge_path: Path) -> None:
    """With both trainer routes off: /v1/compare and /v1/rewards answer a request without references with a
    422 naming the field (never a 500), and one with them equal to the in-process judge."""
    judge = CalibratedJudge.from_pretrained(rouge_judge_path)
    refs = ["The council expands buses to the northern suburbs.", "Walking lowers blood pressure."]
    with serve(rouge_judge_path, "routes.openrlhf=false", "routes.verl=false") as (url, _):
        info = httpx.get(url + "/v1/info").json()
        assert info["needs"] == {"references": "neutral", "setting": "judge.signal=rouge"}
        assert info["card"]["needs"] == info["needs"]

        batch = items(4, seed=11)
        got = httpx.post(url + "/v1/compare", json={"items": batch}, timeout=60)
        assert got.status_code == 422, got.text
        assert "4 of 4 have none (first: items[0].references)" in got.json()["error"]
        assert "send each one's reference summaries in items[i].references" in got.json()["error"]
        partial = [{**x, "references": refs} for x in batch[:3]] + batch[3:]
        got = httpx.post(url + "/v1/compare", json={"items": partial}, timeout=60)
        assert (
            got.status_code == 422 and "1 of 4 have none (first: items[3].references)" in got.json()["error"]
        )

        full = [{**x, "references": refs} for x in batch]
        got = httpx.post(url + "/v1/compare", json={"items": full}, timeout=60)
        assert got.status_code == 200, got.text
        want = judge.compare(
            [x["prompt"] for x in batch],
            [x["a"] for x in batch],
            [x["b"] for x in batch],
            [refs] * len(batch),
        )
        assert got.json()["p"] == [float(v) for v in want.p]

        groups = [{"prompt": ARTICLES[0], "completions": SUMMARIES[:3]}]
        got = httpx.post(url + "/v1/rewards", json={"groups": groups}, timeout=60)
        assert got.status_code == 422, got.text
        assert "in groups[i].references" in got.json()["error"]
        got = httpx.post(
            url + "/v1/rewards", json={"groups": [{**groups[0], "references": refs}]}, timeout=60
        )
        assert got.status_code == 200, got.text
        assert got.json()["rewards"] == [group_rewards_of(judge, ARTICLES[0], SUMMARIES[:3], refs)]

        for route in ("/openrlhf/get_reward", "/verl/reward"):  # off: not served at all
            assert httpx.post(url + route, json={}).status_code == 404
        assert httpx.get(url + "/v1/info").json()["stats"]["failed_calls"] == 0  # nothing reached the judge


def group_rewards_of(judge: CalibratedJudge, prompt: str, completions: list[str], refs: list[str]) -> list:
    return score_groups(judge, [Group(prompt, completions, references=tuple(refs))]).rewards[0]


# --- client errors (issue 40): every one is {"error": "<one line>"}, a 4xx, and the server stays up ----
@pytest.fixture(scope="module")
def strict_server(length_judge_path: Path) -> Iterator[str]:
    with serve(length_judge_path, "server.max_chars_per_text=50", "server.read_timeout_s=1") as (url, _):
        yield url


LONG = "r" * 51
SURROGATE = b'"p\\ud800"'  # valid JSON, no Unicode text: it was a 500 from the judge


@pytest.mark.parametrize(
    "method, route, body, status, reason",
    [
        ("GET", "/no/such/route", None, 404, "Not Found"),
        ("GET", "/v1/compare", None, 405, "Method Not Allowed"),
        ("DELETE", "/health", None, 405, "Method Not Allowed"),
        (
            "POST",
            "/v1/compare",
            b'{"items": [{"prompt": "p", "a": "\xff", "b": "x"}]}',
            400,
            "request body is not UTF-8: byte 0xff at offset 33; send UTF-8 JSON",
        ),
        (
            "POST",
            "/v1/compare",
            b'{"items": [{"prompt": ' + SURROGATE + b', "a": "a", "b": "bb"}]}',
            400,
            "items[0].prompt holds \\ud800 at character 1, a lone surrogate, which is no Unicode character",
        ),
        (
            "POST",
            "/v1/rewards",
            b'{"groups": [{"prompt": "p", "completions": ["a", ' + SURROGATE + b"]}]}",
            400,
            "groups[0].completions[1] holds \\ud800",
        ),
        (
            "POST",
            "/openrlhf/get_reward",
            b'{"query": [' + SURROGATE + b'], "prompts": ["p"]}',
            400,
            "query[0] holds \\ud800",
        ),
        (
            "POST",
            "/verl/reward",
            b'{"prompt": ' + SURROGATE + b', "completion": "a", "group_size": 2}',
            400,
            "prompt holds \\ud800",
        ),
        (
            "POST",
            "/v1/compare",
            {"items": [{"prompt": "p", "a": "a", "b": "bb", "references": ["r", LONG]}]},
            413,
            "items[0].references[1] has 51 characters; the limit is server.max_chars_per_text=50",
        ),
        (
            "POST",
            "/v1/rewards",
            {"groups": [{"prompt": "p", "completions": ["a", "bb"], "references": [LONG]}]},
            413,
            "groups[0].references[0] has 51 characters",
        ),
        (
            "POST",
            "/openrlhf/get_reward",
            {"query": ["p a"], "prompts": ["p"], "labels": [LONG]},
            413,
            "labels[0] has 51 characters",
        ),
        (
            "POST",
            "/verl/reward",
            {"prompt": "p", "completion": "a", "anchor": LONG, "group_size": 2},
            413,
            "anchor has 51 characters",
        ),
        (
            "POST",
            "/verl/reward",
            {"prompt": "p", "completion": "a", "group_size": 1},
            422,
            "group_size=1 (validation with val_kwargs.n=1): a response alone is judged against its anchor",
        ),
    ],
)
def test_every_client_error_has_the_documented_body(
    strict_server: str, method: str, route: str, body: object, status: int, reason: str
) -> None:
    kwargs = {"content": body} if isinstance(body, bytes) else {} if body is None else {"json": body}
    got = httpx.request(method, strict_server + route, timeout=60, **kwargs)  # type: ignore[arg-type]
    assert got.status_code == status, got.text
    assert list(got.json()) == ["error"] and reason in got.json()["error"], got.text
    assert "\n" not in got.json()["error"]
    if status == 405:
        assert got.headers["allow"]  # what Starlette sends with it, kept
    assert httpx.get(strict_server + "/health").status_code == 200  # still up


def _raw_request(url: str, head: bytes, body: bytes) -> tuple[bytes, float]:
    """Send ``head`` and ``body`` on a raw socket, then stop: everything the server sends until it
    closes the connection (read for at most 20 s), and the seconds that took."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as s:
        s.sendall(head + body)
        s.settimeout(20)
        t0, got = time.monotonic(), b""
        while chunk := s.recv(65536):  # b"": the server closed the connection
            got += chunk
        return got, time.monotonic() - t0


@pytest.mark.parametrize("chunked", [False, True])
def test_a_half_sent_body_is_answered_408_and_closed(strict_server: str, chunked: bool) -> None:
    """A client that declares a body and sends part of it held the connection open with no timeout."""
    if chunked:
        head = b"POST /v1/compare HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        part = b'8\r\n{"items"\r\n'  # one chunk, never the last
    else:
        head = b"POST /v1/compare HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n"
        part = b'{"items"'
    got, seconds = _raw_request(strict_server, head, part)
    status_line, _, rest = got.partition(b"\r\n")
    assert status_line == b"HTTP/1.1 408 Request Timeout", got
    assert b"connection: close" in rest.lower()
    assert b'{"error": "the request body did not arrive within server.read_timeout_s=1 (8 bytes came)' in rest
    assert 0.9 < seconds < 10  # answered at the timeout, then closed (the loop above ended)
    assert httpx.get(strict_server + "/health").status_code == 200  # still up
    good = {"items": [{"prompt": "p", "a": "a", "b": "bb"}]}
    assert httpx.post(strict_server + "/v1/compare", json=good, timeout=60).status_code == 200


@pytest.mark.slow
def test_read_timeout_s_is_range_checked(length_judge_path: Path) -> None:
    done = subprocess.run(
        [
            JUDGELOOP,
            "serve-judge",
            "--config",
            CONFIG,
            f"judge_path={length_judge_path}",
            "server.read_timeout_s=0",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and "server.read_timeout_s=0.0 must be > 0" in done.stderr, done.stderr
