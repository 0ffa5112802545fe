"""Every command that takes a judge takes a served one: ``train``, ``ablate``, ``label-pairs`` and
``serve-judge`` with ``judge.type: served`` against a real HTTP server on a loopback port
(``judgeloop.serving.openai_compat`` over the tiny Llama)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from judgeloop.cli import main as cli
from judgeloop.judges.base import VALID_STATUSES
from judgeloop.judges.calibrated import CalibratedJudge
from judgeloop.serving.openai_compat import LocalModel, make_server

ROOT = Path(__file__).resolve().parents[2]
TINY = "judgeloop-tiny/causal-lm"
LOOP = ROOT / "configs" / "feedback_loop" / "tiny.yaml"
JUDGELOOP = str(Path(sys.executable).parent / "judgeloop")
ARTICLES = ["The cat sat on the mat today. It was warm and the sun was out."] * 3 + ["Rain fell all day."]
A = ["A cat sat.", "The mat was warm.", "Cat.", "It rained."]
B = ["It was warm.", "A cat.", "The cat sat on the mat.", "Sun all day."]


@pytest.fixture(scope="module")
def server():
    srv = make_server(LocalModel(TINY))
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv, f"http://127.0.0.1:{srv.server_port}"
    srv.shutdown()
    srv.server_close()


def _served(url: str) -> list[str]:
    return ["judge.type=served", f"judge.model={TINY}", f"judge.server.base_url={url}",
            f"judge.server.model={TINY}", "judge.max_length=256", "judge.batch_size=16"]  # fmt: skip


# the tiny loop, shortened (as tests/studies/test_ablation.py does): 2 steps, few calibration pairs
FAST = [
    "policy.sft_steps=20", "max_steps=2", "eval_every_n_steps=2", "calibration.recalibrate_every_n_steps=2",
    "calibration.num_articles=16", "calibration.pairs_per_article=4", "calibration.min_points=4",
    "num_eval_articles=4", "num_validation_articles=4", "progress_bar=false", "log_with=[jsonl]",
    "data.embedded_size=80", "generation.max_new_tokens=8", "save_final_policy=false", "judge_prefetch=false",
]  # fmt: skip


@pytest.mark.slow
def test_train_with_a_served_judge(server, tmp_path):
    srv, url = server
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
def test_ablate_an_arm_that_uses_the_served_judge(server, tmp_path):
    srv, url = server
    before = srv.requests
    out = tmp_path / "ablate"
    args = ["ablate", "--config", str(LOOP), *FAST, *_served(url), "ablation.arms=[raw,platt]",
            "ablation.seeds=[0]", "ablation.bootstrap_samples=1000", f"output_dir={out}"]  # fmt: skip
    with contextlib.redirect_stdout(io.StringIO()):
        assert cli([*args, "--job", "platt:0"]) == 0
    report = json.loads((out / "platt" / "seed0" / "report.json").read_text())
    assert report["arm"] == "platt" and report["steps_run"] == 2
    assert sum(report["judge_stats"]["status"].get(s, 0) for s in VALID_STATUSES) > 0
    assert srv.requests > before


@pytest.fixture(scope="module")
def served_judge_path(server, tmp_path_factory):
    """``judgeloop calibrate`` on the served tiny judge: the saved platt judge's folder."""
    _, url = server
    out = tmp_path_factory.mktemp("served_cal") / "run"
    rc = cli(["calibrate", "--config", str(ROOT / "configs/calibrate/summeval_served.yaml"),
              "data.format=embedded", "data.path=null", "data.embedded_size=40", "labels.type=rouge",
              f"judge.model={TINY}", f"judge.server.model={TINY}", f"judge.server.base_url={url}",
              "judge.server.cache_path=", "max_pairs_per_article=3", f"output_dir={out}"])  # fmt: skip
    assert rc == 0
    return out / "calibrated_judge" / "platt"


def test_label_pairs_with_a_served_judge(server, served_judge_path, tmp_path):
    srv, _ = server
    data = tmp_path / "pairs.jsonl"
    rows = [{"prompt": a[:40], "article": a, "chosen": x, "rejected": y} for a, x, y in zip(ARTICLES, A, B)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    before = srv.requests
    out = tmp_path / "out"
    rc = cli(["label-pairs", "--config", str(ROOT / "configs/label_pairs/summeval.yaml"),
              f"judge_path={served_judge_path}", f"data.path={data}", "data.fields.references=null",
              "min_confidence=0.5", f"output_dir={out}"])  # fmt: skip
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
def test_serve_judge_serves_a_saved_served_judge(server, served_judge_path):
    port_sock = __import__("socket").socket()
    port_sock.bind(("127.0.0.1", 0))
    port = port_sock.getsockname()[1]
    port_sock.close()
    proc = subprocess.Popen(
        [JUDGELOOP, "serve-judge", "--config", str(ROOT / "configs/serve/judge.yaml"),
         f"judge_path={served_judge_path}", f"server.port={port}", "server.num_threads=1"],
        env={**os.environ}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
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
        items = [{"prompt": p, "a": a, "b": b} for p, a, b in zip(ARTICLES, A, B)]
        got = httpx.post(url + "/v1/compare", json={"items": items}, timeout=120)
        assert got.status_code == 200, got.text
        local = CalibratedJudge.from_pretrained(served_judge_path).compare(ARTICLES, A, B)
        body = got.json()
        assert body["status"] == local.status == ["ok"] * 4
        np.testing.assert_allclose(body["p"], local.p, atol=1e-6)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
