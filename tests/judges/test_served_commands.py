"""Every command that takes a judge takes a served one: ``train``, ``ablate``, ``label-pairs`` and
``serve-judge`` with ``judge.type: served`` against a real HTTP server on a loopback port
(``judgeloop.testing.openai_compat`` over the tiny Llama); and through each of them (and TRL's
``GRPOTrainer``), a server that fails some requests: status ``failed``, masked, counted, never a tie or a
loss, or the run stopped in one line under ``judge.server.on_failure=stop``."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from judgeloop.cli import main as cli
from judgeloop.judges.base import VALID_STATUSES
from judgeloop.judges.calibrated import CalibratedJudge
from judgeloop.testing.openai_compat import Handler, make_server
from served_common import ARTICLES, TINY, A, B, calibrate_served_tiny, grpo_trl_tiny, serve, stop_server

ROOT = Path(__file__).resolve().parents[2]
LOOP = ROOT / "configs" / "feedback_loop" / "tiny.yaml"
JUDGELOOP = str(Path(sys.executable).parent / "judgeloop")


class _Failing(Handler):
    """The real server, answering HTTP 500 to some requests as an overloaded one does: every
    ``server.fail_every``-th POST (counted from its start, the route probe included), and every POST whose
    prompt contains ``server.fail_marker``. Under ``judge.server.max_retries=0`` each is one ``failed``
    judgement."""

    def do_POST(self) -> None:  # noqa: N802 - the stdlib's name
        raw = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.rfile = io.BytesIO(raw)  # the real handler reads the body again
        body = json.loads(raw or b"{}")
        prompt = body.get("prompt", body.get("input_ids", body.get("text", "")))
        text = prompt if isinstance(prompt, str) else self.server.lm.tokenizer.decode(prompt)
        srv = self.server
        with srv.count_lock:
            srv.posts += 1
            fail = (srv.fail_every and srv.posts % srv.fail_every == 0) or (
                srv.fail_marker and srv.fail_marker in text
            )
            srv.failed += bool(fail)
        if fail:
            self._send(500, {"error": "overloaded (scripted)"})
            return
        super().do_POST()


@contextlib.contextmanager
def _failing_server(lm, every: int = 0, marker: str = ""):
    srv = make_server(lm, handler=_Failing)
    srv.posts, srv.failed, srv.fail_every, srv.fail_marker = 0, 0, every, marker
    srv, url = serve(srv)
    try:
        yield srv, url
    finally:
        stop_server(srv)


@contextlib.contextmanager
def _judgeloop_log():
    """The messages the ``judgeloop`` logger emits meanwhile (its handler does not propagate to pytest's)."""
    lines: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("judgeloop").addHandler(handler)
    try:
        yield lines
    finally:
        logging.getLogger("judgeloop").removeHandler(handler)


def _served(url: str) -> list[str]:
    return [
        "judge.type=served",
        f"judge.model={TINY}",
        f"judge.server.base_url={url}",
        f"judge.server.model={TINY}",
        "judge.max_length=256",
        "judge.batch_size=16",
    ]


# the tiny loop, shortened (as tests/studies/test_ablation.py does): 2 steps, few calibration pairs
FAST = [
    "policy.sft_steps=20",
    "max_steps=2",
    "eval_every_n_steps=2",
    "calibration.recalibrate_every_n_steps=2",
    "calibration.num_articles=16",
    "calibration.pairs_per_article=4",
    "calibration.min_points=4",
    "num_eval_articles=4",
    "num_validation_articles=4",
    "progress_bar=false",
    "log_with=[jsonl]",
    "data.embedded_size=80",
    "generation.max_new_tokens=8",
    "save_final_policy=false",
    "judge_prefetch=false",
]


@pytest.mark.slow
def test_train_with_a_served_judge(tiny_served, tmp_path):
    srv, url = tiny_served
    before = srv.requests
    out = tmp_path / "run"
    assert cli(["train", "--config", str(LOOP), *FAST, *_served(url), f"output_dir={out}"]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["steps_run"] == 2
    status = report["judge_stats"]["status"]
    # judge.max_length=256 cuts the articles: valid, 'truncated'
    assert sum(status.get(s, 0) for s in VALID_STATUSES) > 0 and not status.get("failed"), status
    assert srv.requests > before  # the judge's logits came from the server


@pytest.mark.slow
def test_ablate_an_arm_that_uses_the_served_judge(tiny_served, tmp_path):
    srv, url = tiny_served
    before = srv.requests
    out = tmp_path / "ablate"
    args = [
        "ablate",
        "--config",
        str(LOOP),
        *FAST,
        *_served(url),
        "ablation.arms=[raw,platt]",
        "ablation.seeds=[0]",
        "ablation.bootstrap_samples=1000",
        f"output_dir={out}",
    ]
    with contextlib.redirect_stdout(io.StringIO()):
        assert cli([*args, "--job", "platt:0"]) == 0
    report = json.loads((out / "platt" / "seed0" / "report.json").read_text())
    assert report["arm"] == "platt" and report["steps_run"] == 2
    assert sum(report["judge_stats"]["status"].get(s, 0) for s in VALID_STATUSES) > 0
    assert srv.requests > before


@pytest.fixture(scope="module")
def served_judge_path(tiny_served, tmp_path_factory):
    """``judgeloop calibrate`` on the served tiny judge: the saved platt judge's folder."""
    _, url = tiny_served
    out = tmp_path_factory.mktemp("served_cal") / "run"
    rc = calibrate_served_tiny(url, out, "judge.server.cache_path=")
    assert rc == 0
    return out / "calibrated_judge" / "platt"


def test_label_pairs_with_a_served_judge(tiny_served, served_judge_path, tmp_path):
    srv, _ = tiny_served
    data = tmp_path / "pairs.jsonl"
    rows = [{"prompt": a[:40], "article": a, "chosen": x, "rejected": y} for a, x, y in zip(ARTICLES, A, B)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    before = srv.requests
    out = tmp_path / "out"
    rc = cli(
        [
            "label-pairs",
            "--config",
            str(ROOT / "configs/label_pairs/summeval.yaml"),
            f"judge_path={served_judge_path}",
            f"data.path={data}",
            "data.fields.references=null",
            "min_confidence=0.5",
            f"output_dir={out}",
        ]
    )
    assert rc == 0
    # both orders of each pair from the server, plus one probe when the loaded judge's route is auto
    assert srv.requests - before in (2 * len(rows), 2 * len(rows) + 1)
    report = json.loads((out / "report.json").read_text())
    assert report["pairs"] == len(rows)
    local = CalibratedJudge.from_pretrained(served_judge_path).compare(ARTICLES, A, B)
    labeled = [json.loads(line) for line in (out / "labeled.jsonl").read_text().splitlines()]
    assert len(labeled) == report["labeled"] == len(rows)
    # each row's p_chosen is the served judge's calibrated p of the pair, oriented to the judge's pick
    np.testing.assert_allclose([r["p_chosen"] for r in labeled], np.maximum(local.p, 1 - local.p), atol=1e-6)


@pytest.mark.slow
@contextlib.contextmanager
def _serve_judge(judge_path, *overrides):
    """``judgeloop serve-judge`` over ``judge_path`` on a free loopback port, up and healthy within 90 s;
    its base URL. Stopped with SIGTERM (killed after 30 s) on leaving."""
    port_sock = __import__("socket").socket()
    port_sock.bind(("127.0.0.1", 0))
    port = port_sock.getsockname()[1]
    port_sock.close()
    proc = subprocess.Popen(
        [
            JUDGELOOP,
            "serve-judge",
            "--config",
            str(ROOT / "configs/serve/judge.yaml"),
            f"judge_path={judge_path}",
            f"server.port={port}",
            "server.num_threads=1",
            *overrides,
        ],
        env={**os.environ},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            assert time.monotonic() < deadline, "serve-judge did not come up in 90 s"
            time.sleep(0.2)
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_serve_judge_serves_a_saved_served_judge(tiny_served, served_judge_path):
    with _serve_judge(served_judge_path) as url:
        items = [{"prompt": p, "a": a, "b": b} for p, a, b in zip(ARTICLES, A, B)]
        got = httpx.post(url + "/v1/compare", json={"items": items}, timeout=120)
        assert got.status_code == 200, got.text
        local = CalibratedJudge.from_pretrained(served_judge_path).compare(ARTICLES, A, B)
        body = got.json()
        assert body["status"] == local.status == ["ok"] * 4
        np.testing.assert_allclose(body["p"], local.p, atol=1e-6)


# --- a server that fails some requests: masked everywhere, never a tie or a loss -------------------------
NO_RETRY = ["judge.server.route=vllm", "judge.server.max_retries=0"]
MARKED = "Nobody came."  # the pair whose summary holds this fails at the marker server (both orders)


@pytest.mark.parametrize("loss", ["dpo", "grpo"])
def test_train_drops_the_pairs_a_failing_server_did_not_judge(tiny_lm, tmp_path, loss):
    out = tmp_path / "run"
    grpo = ["loss.type=grpo"] if loss == "grpo" else []  # k=2: one comparison per article's group
    with _failing_server(tiny_lm, every=4) as (srv, url), _judgeloop_log() as lines:
        rc = cli(
            ["train", "--config", str(LOOP), *FAST, *_served(url), *NO_RETRY, *grpo, f"output_dir={out}"]
        )
    assert rc == 0 and srv.failed > 0
    report = json.loads((out / "report.json").read_text())
    assert report["judge_stats"]["status"].get("failed", 0) > 0, report["judge_stats"]
    log = report["train_log"]
    assert [r["step"] for r in log] == [1, 2] and sum(r["judge_failures"] for r in log) > 0
    for row in log:
        # a failed pair (dpo) or group comparison (grpo: both samples) is out of the loss: no target of
        # 0.5, no reward, no advantage; the batch has 4 articles
        assert row["kept_fraction"] == pytest.approx(1 - row["judge_failures"] / 4), row
        assert np.isfinite(row["loss"]), row
    assert any("pairs failed at" in line and "masked" in line for line in lines), lines


def test_on_failure_stop_stops_the_run_in_one_line(tiny_lm, tmp_path, capsys):
    out = tmp_path / "run"
    with _failing_server(tiny_lm, every=2) as (_, url):
        rc = cli(
            [
                "train",
                "--config",
                str(LOOP),
                *FAST,
                *_served(url),
                *NO_RETRY,
                "judge.server.on_failure=stop",
                f"output_dir={out}",
            ]
        )
    err = capsys.readouterr().err.strip().splitlines()
    assert rc != 0
    assert err[-1].startswith("judgeloop train: error: served judge: ") and "on_failure=stop" in err[-1], err
    assert "HTTP 500" in err[-1] and not any("Traceback" in line for line in err)


def _marked_rows():
    """The four pairs, then one whose rejected summary the marker server fails (last: the route probe of a
    loaded ``route: auto`` judge asks the first pair)."""
    return list(zip(ARTICLES + ["Rain fell all day."], A + ["It rained."], B + [MARKED]))


def test_label_pairs_counts_failed_pairs_as_dropped(tiny_lm, served_judge_path, tmp_path):
    data = tmp_path / "pairs.jsonl"
    rows = [{"prompt": a[:40], "article": a, "chosen": x, "rejected": y} for a, x, y in _marked_rows()]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    with _failing_server(tiny_lm, marker=MARKED) as (srv, url):
        rc = cli(
            [
                "label-pairs",
                "--config",
                str(ROOT / "configs/label_pairs/summeval.yaml"),
                f"judge_path={served_judge_path}",
                f"data.path={data}",
                "data.fields.references=null",
                f"judge_overrides=['server.base_url={url}', server.max_retries=0]",
                "min_confidence=0.5",
                f"output_dir={out}",
            ]
        )
    assert rc == 0 and srv.failed == 2  # both orders of the marked pair
    report = json.loads((out / "report.json").read_text())
    assert report["pairs"] == len(rows) and report["dropped"]["failed"] == 1
    labeled = [json.loads(line) for line in (out / "labeled.jsonl").read_text().splitlines()]
    assert report["labeled"] == len(labeled) == len(rows) - 1
    assert MARKED not in {r[k] for r in labeled for k in ("chosen", "rejected")}


def test_serve_judge_answers_failed_with_p_null(tiny_lm, served_judge_path):
    with _failing_server(tiny_lm, marker=MARKED) as (_, failing):
        overrides = f"judge_overrides=['server.base_url={failing}', server.max_retries=0]"
        with _serve_judge(served_judge_path, overrides) as url:
            items = [{"prompt": p, "a": a, "b": b} for p, a, b in _marked_rows()]
            got = httpx.post(url + "/v1/compare", json={"items": items}, timeout=120)
            assert got.status_code == 200, got.text
            body = got.json()
            assert body["status"] == ["ok"] * 4 + ["failed"]
            assert body["p"][-1] is None and body["logit"][-1] is None
            assert all(0 < p < 1 for p in body["p"][:4])


def test_trl_grpo_gives_no_reward_to_what_a_failing_server_did_not_judge(
    tiny_lm, served_judge_path, tmp_path
):
    with _failing_server(tiny_lm, every=3) as (srv, url):
        overrides = f"judge_overrides=['server.base_url={url}', server.max_retries=0]"
        out = grpo_trl_tiny(served_judge_path, tmp_path / "grpo", overrides, "grpo.num_generations=2")
    assert out["report"]["steps"] == 2 and srv.failed > 0
    groups = [
        call["rewards"][i : i + 2]
        for call in out["reward"].history
        for i in range(0, len(call["rewards"]), 2)
    ]
    # two completions, one comparison: it failed (both None: no reward, so TRL gives no advantage) or not
    assert any(g == [None, None] for g in groups), groups
    assert all(g == [None, None] or all(r is not None and np.isfinite(r) for r in g) for g in groups), groups
