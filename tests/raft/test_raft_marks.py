"""Evidence marks: the conformal retriever fitted on the train split, marks in meta and prompts, the build
unchanged without in_prompt, eval-raft's paired comparison, and a conformal file for another corpus."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
from test_raft import TINY, _cfg, _synthetic  # noqa: I001  (tests/ is on sys.path under pytest)

from judgeloop.raft.builder import build_raft, save_raft
from judgeloop.raft.marks import MarksConfig, mark_text
from judgeloop.raft.targets import render_user

ENCODER = "judgeloop-tiny/encoder"


def _marks(**kw) -> MarksConfig:
    return MarksConfig(enabled=True, encoder=ENCODER, batch_size=16, **kw)


@pytest.fixture(scope="module")
def marked(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("raft_marks")
    path = _synthetic(tmp / "qa.jsonl", 40)
    plain = build_raft(_cfg(path, tmp))
    cfg = replace(_cfg(path, tmp), marks=_marks())
    build = build_raft(cfg)
    out = save_raft(build, tmp / "marked", cfg)
    return tmp, plain, build, out


def test_mark_text_and_render_user():
    levels = [0.8, 0.95]
    assert mark_text(0.8, 0.62, levels) == "in the 80% set, p=0.62: likely relevant"
    assert mark_text(0.95, 0.091, levels) == "in the 95% set only, p=0.09: uncertain"
    assert mark_text(None, 0.01, levels) == "outside the 95% set, p=0.01: likely irrelevant"
    assert mark_text(math.nan, 0.01, levels).startswith("outside")
    got = render_user(
        "Q?",
        "free",
        [("a#0", "A text"), ("b#0", "B text")],
        {"a#0": "in the 80% set, p=0.50: likely relevant"},
    )
    assert got.startswith(
        '<DOCUMENT id="a#0" retrieval="in the 80% set, p=0.50: likely relevant">\nA text\n</DOCUMENT>'
    )
    assert '<DOCUMENT id="b#0">\nB text\n</DOCUMENT>' in got  # no mark, no attribute
    assert render_user("Q?", "free", [("a#0", "A")]) == render_user("Q?", "free", [("a#0", "A")], {})
    with pytest.raises(ValueError, match=r"marks.levels=\[0.8, 1.2\] must be distinct coverages"):
        MarksConfig(levels=[0.8, 1.2])
    with pytest.raises(ValueError, match="marks.in_prompt=true needs marks.enabled=true"):
        MarksConfig(in_prompt=True)


def test_marks_go_to_meta_and_the_prompts_stay_as_they_were(marked):
    tmp, plain, build, out = marked
    for split in ("train", "eval"):
        for a, b in zip(plain.rows[split], build.rows[split]):
            assert a["messages"] == b["messages"]  # in_prompt=false: the build's prompts are unchanged
            marks = b["meta"]["doc_marks"]
            assert set(b["meta"]["doc_order"]) <= set(marks)
            for m in marks.values():
                assert 0.0 < m["pvalue"] <= 1.0 and m["level"] in (None, 0.8, 0.95)
                assert m["text"] == mark_text(m["level"], m["pvalue"], [0.8, 0.95])
    st = build.stats["marks"]
    assert st["n_cal"] == build.stats["num_train"] and st["thresholds"]["0.8"] <= st["thresholds"]["0.95"]
    # the train oracles are the calibration points: about 80% of them fall in the 80% set
    oracle = [r["meta"]["doc_marks"][r["meta"]["oracle_chunk_id"]]["level"] for r in build.rows["train"]]
    assert sum(x == 0.8 for x in oracle) / len(oracle) >= 0.8
    saved = json.loads((out / "conformal.json").read_text())
    assert saved["corpus"] == build.stats["corpus"] == json.loads((out / "stats.json").read_text())["corpus"]
    assert saved["scorer"]["encoder"] == ENCODER


def test_in_prompt_writes_the_marks_into_the_user_turn(marked, tmp_path):
    tmp, plain, _, _ = marked
    cfg = replace(_cfg(tmp / "qa.jsonl", tmp_path), marks=_marks(in_prompt=True))
    build = build_raft(cfg)
    row = build.rows["train"][0]
    user = row["messages"][1]["content"]
    for d in row["meta"]["doc_order"]:
        assert f'<DOCUMENT id="{d}" retrieval="{row["meta"]["doc_marks"][d]["text"]}">' in user
    assert row["messages"][2] == plain.rows["train"][0]["messages"][2]  # the target is the same


def test_eval_raft_compares_with_and_without_marks(marked, tmp_path):
    from judgeloop.commands.eval_raft import run
    from judgeloop.raft.evaluation import EvalRaftConfig
    from judgeloop.raft.marks import EvalMarksConfig

    _, _, _, out = marked
    cfg = EvalRaftConfig(
        data_dir=str(out),
        base_model=TINY,
        adapter_dir=None,
        max_questions=6,
        settings=["oracle_distractors", "distractors_only"],
        num_generations=2,
        max_new_tokens=6,
        marks=EvalMarksConfig(compare=True, num_bootstrap=50),
        output_dir=str(tmp_path / "ev"),
    )
    report = run(cfg)
    m = report["marks"]["base"]
    for setting in cfg.settings:
        d = m["accuracy"][setting]
        assert d["without"] == report["models"]["base"]["settings"][setting]["accuracy"]
        assert d["with"] == report["models_marked"]["base"]["settings"][setting]["accuracy"]
        assert d["delta"] == pytest.approx(d["with"] - d["without"]) and d["n"] == 6
        assert d["ci95"][0] <= d["delta"] + 1e-12 <= d["ci95"][1] + 2e-12
    assert m["quote_validity"]["n"] == 2
    assert "retrieval=" in next(iter(report["marks"]["example"].values())) or report["marks"]["example"]
    assert "## Evidence marks" in (tmp_path / "ev" / "eval_report.md").read_text()


def test_a_conformal_file_for_another_corpus_is_one_line_before_any_model_loads(marked, tmp_path, capsys):
    from judgeloop.cli import main

    tmp, _, _, out = marked
    other_path = _synthetic(tmp_path / "other.jsonl", 30, seed=7)
    other_cfg = replace(_cfg(other_path, tmp_path), marks=_marks())
    save_raft(build_raft(other_cfg), tmp_path / "other", other_cfg)
    rc = main(
        [
            "eval-raft",
            "--config",
            "configs/raft/eval_pubmedqa_marked.yaml",
            f"data_dir={out}",
            f"marks.conformal_path={tmp_path / 'other' / 'conformal.json'}",
            "adapter_dir=null",
            "base_model=no-such-org/not-loaded-first",
            f"output_dir={tmp_path / 'ev'}",
        ]
    )
    err = [x for x in capsys.readouterr().err.strip().splitlines() if x.startswith("judgeloop")]
    assert rc == 2 and len(err) == 1, err
    assert "marks.conformal_path=" in err[0] and "was fitted on another corpus" in err[0]
    assert not (tmp_path / "ev").exists()
