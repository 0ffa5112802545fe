"""The served judge's ``likelihood`` extractor (``judge.extractor: likelihood``) against a real HTTP server on a
loopback port (judgeloop's ``testing/openai_compat.py`` over the tiny Llama): its scores equal the in-process
``likelihood`` judge's on both prompt-log-probability routes, the server answers in vLLM's and SGLang's own
shapes, a server without prompt log-probabilities is refused in one line, and ``judgeloop calibrate`` fits,
saves and reloads it."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import numpy as np
import pytest

from judgeloop.judges import JudgeConfig, ServerConfig, build_judge
from judgeloop.judges.likelihood import LikelihoodJudge
from judgeloop.judges.served import ServedLikelihoodJudge
from judgeloop.testing.openai_compat import Handler
from served_common import ARTICLES, TINY, A, B, calibrate_served_tiny, start_server, stop_server

ROOT = Path(__file__).resolve().parents[2]
# fp32 on both sides; the server runs each sequence unpadded, the in-process judge a left-padded batch:
# measured up to 5.3e-7 on these pairs
ATOL = 1e-5


@pytest.fixture(scope="module")
def reference():
    return LikelihoodJudge(TINY, device="cpu")(ARTICLES, A, B)


def _likelihood(url, **server):
    cfg = JudgeConfig(
        type="served",
        model=TINY,
        extractor="likelihood",
        server=ServerConfig(base_url=url, model=TINY, **server),
    )
    return build_judge(cfg)


@pytest.mark.parametrize(
    ("route", "prompt_format"),
    [("auto", "auto"), ("vllm", "ids"), ("sglang", "ids"), ("vllm", "text"), ("sglang", "text")],
)
def test_scores_equal_the_in_process_likelihood_judge(tiny_server, reference, route, prompt_format):
    judge = _likelihood(tiny_server, route=route, prompt_format=prompt_format)
    assert isinstance(judge, ServedLikelihoodJudge) and not judge.position_debias
    assert judge.route == ("vllm" if route == "auto" else route)
    out = judge(ARTICLES, A, B)
    assert out.status == ["ok"] * 4
    np.testing.assert_allclose(out.scores, reference.scores, atol=ATOL, rtol=0)
    # pointwise: the swapped pairs are the exact negatives, with no new call
    calls = judge.client.calls
    np.testing.assert_array_equal(judge(ARTICLES, B, A).scores, -out.scores)
    assert judge.client.calls == calls
    assert judge.describe()["extractor"] == "likelihood" and judge.describe()["verdict_token_ids"] == []


def test_a_truncated_article_is_scored_as_the_in_process_judge_cuts_it(tiny_server):
    long = [" ".join(["The cat sat on the mat and it was warm."] * 60)] * 2
    ref = LikelihoodJudge(TINY, device="cpu", max_length=256)(long, A[:2], B[:2])
    cfg = JudgeConfig(
        type="served",
        model=TINY,
        extractor="likelihood",
        max_length=256,
        server=ServerConfig(base_url=tiny_server, model=TINY, route="sglang"),
    )
    got = build_judge(cfg)(long, A[:2], B[:2])
    assert got.status == ref.status == ["truncated", "truncated"]
    np.testing.assert_allclose(got.scores, ref.scores, atol=ATOL, rtol=0)


def test_the_loopback_server_answers_as_vllm_and_sglang_shape_prompt_logprobs(tiny_server, tiny_lm):
    ids = tiny_lm.tokenizer.encode("The cat sat on the mat.", add_special_tokens=False)
    rows = tiny_lm.prompt_logprobs(ids)  # (T - 1, V)
    body = {"model": TINY, "prompt": ids, "max_tokens": 1, "prompt_logprobs": 2}
    vllm = httpx.post(f"{tiny_server}/v1/completions", json=body, timeout=30).json()["choices"][0][
        "prompt_logprobs"
    ]
    assert len(vllm) == len(ids) and vllm[0] is None  # nothing predicts the first token
    for t in range(1, len(ids)):
        entry = vllm[t][str(ids[t])]
        assert set(entry) == {"logprob", "rank", "decoded_token"}
        assert entry["logprob"] == pytest.approx(float(rows[t - 1, ids[t]]), abs=1e-6)
        assert entry["rank"] == int((rows[t - 1] > rows[t - 1, ids[t]]).sum()) + 1
        assert len(vllm[t]) == (2 if entry["rank"] <= 2 else 3)  # the prompt token and the top 2
    body = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": 1},
        "return_logprob": True,
        "logprob_start_len": 2,
    }
    meta = httpx.post(f"{tiny_server}/generate", json=body, timeout=30).json()["meta_info"]
    sglang = meta["input_token_logprobs"]
    assert [e[1] for e in sglang] == ids[2:] and sglang[0][0] is None  # SGLang pads the first with None
    np.testing.assert_allclose(
        [e[0] for e in sglang[1:]], [float(rows[t - 1, ids[t]]) for t in range(3, len(ids))]
    )
    assert len(meta["output_token_logprobs"]) == 1


def test_a_server_without_prompt_logprobs_is_refused_in_one_line(tiny_lm):
    srv, url = start_server(tiny_lm, logprobs=False)
    try:
        for route in ("auto", "vllm"):
            with pytest.raises(
                ValueError, match=r"judge.extractor=likelihood needs prompt log-probabilities"
            ) as err:
                _likelihood(url, route=route)
            assert "\n" not in str(err.value) and "vLLM" in str(err.value) and "SGLang" in str(err.value)
    finally:
        stop_server(srv)
    srv, url = start_server(
        tiny_lm, routes=("completions",)
    )  # no /generate: auto finds vllm, sglang is refused
    try:
        assert _likelihood(url).route == "vllm"
        with pytest.raises(ValueError, match=r"on route \['sglang'\] \(HTTP 404") as err:
            _likelihood(url, route="sglang")
        assert "\n" not in str(err.value)
    finally:
        stop_server(srv)


class _AddsBos(Handler):
    """Reads a text prompt with a BOS token in front, as vLLM does by default (``add_special_tokens``)."""

    def _ids(self, prompt):
        ids = super()._ids(prompt)
        return [self.server.lm.tokenizer.bos_token_id or 0, *ids] if isinstance(prompt, str) else ids


def test_a_server_that_tokenizes_the_prompt_otherwise_is_refused(tiny_lm):
    srv, url = start_server(tiny_lm, handler=_AddsBos)
    try:
        for route in ("vllm", "sglang"):
            judge = _likelihood(url, route=route, prompt_format="ids")
            assert judge(ARTICLES[:2], A[:2], B[:2]).status == ["ok", "ok"]
            # the probe itself is refused: the ids come back shifted
            with pytest.raises(ValueError, match="prompt tokens differ from the ids sent"):
                _likelihood(url, route=route, prompt_format="text")
    finally:
        stop_server(srv)


def test_a_dead_server_masks_the_pairs_and_asks_again_next_time(tiny_lm, caplog):
    srv, url = start_server(tiny_lm)
    judge = _likelihood(url, route="vllm", max_retries=0, timeout_s=2)
    stop_server(srv)
    out = judge(ARTICLES[:2], A[:2], B[:2])
    assert out.status == ["failed", "failed"] and np.isnan(out.scores).all() and not out.valid.any()
    assert "2 of 2 pairs failed" in caplog.text
    assert not [v for v in judge._values.values() if v[1] == "failed"]  # never remembered


def test_the_sqlite_cache_serves_a_second_run_without_calls(tiny_server, tmp_path):
    db = str(tmp_path / "j.sqlite")
    first = _likelihood(tiny_server, route="sglang", cache_path=db)
    s1 = first(ARTICLES, A, B).scores
    again = _likelihood(tiny_server, route="sglang", cache_path=db)
    s2 = again(ARTICLES, A, B).scores
    assert again.client.calls == 1 and again.client.cache_hits == 8  # the start-up probe only
    np.testing.assert_array_equal(s1, s2)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"position_debias": True}, "extractor=likelihood: each summary is scored alone"),
        (
            {"server": ServerConfig(base_url="http://x", model="m", route="top_logprobs")},
            "only the vllm and sglang",
        ),
        ({"type": "likelihood", "server": ServerConfig()}, "read by the served judge only"),
    ],
)
def test_bad_likelihood_settings_are_one_line(overrides, message):
    base = {
        "type": "served",
        "model": TINY,
        "extractor": "likelihood",
        "server": ServerConfig(base_url="http://x", model="m"),
    }
    with pytest.raises(ValueError, match=message) as err:
        JudgeConfig(**{**base, **overrides})
    assert "\n" not in str(err.value)


def test_calibrate_fits_and_saves_the_served_likelihood_judge(tiny_server, reference, tmp_path):
    from judgeloop.judges.calibrated import CalibratedJudge

    out = tmp_path / "run"
    rc = calibrate_served_tiny(
        tiny_server,
        out,
        "judge.extractor=likelihood",
        "judge.position_debias=null",
        f"judge.server.cache_path={out / 'judgements.sqlite'}",
    )
    assert rc == 0
    report = json.loads((out / "report.json").read_text())
    served = report["judge"]["served"]
    assert served["route"] == "vllm" and served["extractor"] == "likelihood" and served["model"] == TINY
    assert set(report["judge"]["status"]["test"]) <= {"ok", "truncated"}
    judge = CalibratedJudge.from_pretrained(out / "calibrated_judge" / "platt")
    assert isinstance(judge.judge, ServedLikelihoodJudge)
    readme = (out / "calibrated_judge" / "platt" / "README.md").read_text()
    assert "route `vllm`, extractor `likelihood`; the server reports version" in readme
    comp = judge.compare(ARTICLES, A, B)
    assert comp.status == ["ok"] * 4 and np.isfinite(comp.p).all()
    np.testing.assert_allclose(judge.compare(ARTICLES, B, A).logit, -comp.logit)
    # the calibrator maps the very logits the in-process likelihood judge gives
    np.testing.assert_allclose(judge.judge(ARTICLES, A, B).scores, reference.scores, atol=ATOL, rtol=0)
