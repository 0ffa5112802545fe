"""Saved calibrated judges: what ``judgeloop calibrate`` writes, ``from_pretrained`` loads and
reproduces; bad folders are one-line errors."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from judgeloop import CalibratedJudge
from judgeloop.config import ConfigError, load_config
from judgeloop.data import load_examples
from judgeloop.studies.calibration_lab import CalibrateConfig

METHODS = ("raw", "platt", "isotonic", "temperature", "feature_platt")


def test_calibrate_writes_judges_that_reproduce_the_test_predictions_exactly(tiny_calibration):
    report = json.loads((tiny_calibration / "report.json").read_text())
    rows = [json.loads(line) for line in (tiny_calibration / "predictions.jsonl").read_text().splitlines()]
    assert {"article_id", "orientation", "a", "b"} <= set(rows[0])
    cfg = load_config(CalibrateConfig, tiny_calibration / "config.yaml")
    articles = {e.id: e.article for e in load_examples(cfg.data)}
    for method in METHODS:
        folder = tiny_calibration / "calibrated_judge" / method
        assert {p.name for p in folder.iterdir()} == {
            "judge.yaml",
            "calibrator.json",
            "calibrated_judge.json",
            "README.md",
        }
        judge = CalibratedJudge.from_pretrained(folder)
        card = judge.card
        assert card["method"] == method and card["fit"]["pairs"] == report["n_fit"]
        assert card["held_out"]["ece"] == report["methods"][method]["ece"]
        out = judge.compare(
            [articles[r["article_id"]] for r in rows], [r["a"] for r in rows], [r["b"] for r in rows]
        )
        assert out.status == ["ok"] * len(rows) or set(out.status) <= {"ok", "truncated"}
        np.testing.assert_array_equal(out.logit, [r["score"] for r in rows])
        np.testing.assert_array_equal(out.p, [r[f"p_{method}"] for r in rows])


def test_save_and_load_round_trip_and_failed_items_stay_failures(tiny_calibration, tmp_path):
    judge = CalibratedJudge.from_pretrained(tiny_calibration / "calibrated_judge" / "platt", ["batch_size=4"])
    judge.save_pretrained(tmp_path / "copy")
    again = CalibratedJudge.from_pretrained(tmp_path / "copy")
    assert again.config.batch_size == 4 and again.calibrator.state_dict() == judge.calibrator.state_dict()
    out = again.compare(
        ["an article about rain", "an article about rain"], ["rain falls", ""], ["sun", "sun"]
    )
    assert out.status[1] == "empty_summary" and np.isnan(out.p[1]) and np.isnan(out.logit[1])
    assert 0 < out.p[0] < 1 and out.valid.tolist() == [True, False]


def test_bad_folders_are_one_line_errors_naming_the_file(tiny_calibration, tmp_path):
    with pytest.raises(ConfigError, match=r"is not a calibrated judge \(no calibrated_judge.json\)"):
        CalibratedJudge.from_pretrained(tmp_path)
    other = tmp_path / "other"
    shutil.copytree(tiny_calibration / "calibrated_judge" / "platt", other)
    card = json.loads((other / "calibrated_judge.json").read_text())
    (other / "calibrated_judge.json").write_text(
        json.dumps({**card, "format_version": 99, "judgeloop_version": "9.0"})
    )
    with pytest.raises(
        ConfigError, match=r"calibrated_judge.json: format .* version 99 \(written by judgeloop 9.0\)"
    ):
        CalibratedJudge.from_pretrained(other)
    (other / "calibrated_judge.json").write_text(json.dumps(card))
    with pytest.raises(ConfigError, match=r"judge.yaml: judge.model='/nowhere/model' is not a directory"):
        CalibratedJudge.from_pretrained(other, ["model=/nowhere/model"])
    with pytest.raises(ConfigError, match=r"overrides change \['scale'\]"):
        CalibratedJudge.from_pretrained(other, ["scale=3"])
    (other / "calibrator.json").unlink()
    with pytest.raises(ConfigError, match="calibrator.json is missing"):
        CalibratedJudge.from_pretrained(other)


# --- a judge states what it reads (issue 39) ------------------------------------------------------
def test_the_card_opens_with_agreement_raw_beside_calibrated_and_what_a_call_needs(tiny_calibration):
    report = json.loads((tiny_calibration / "report.json").read_text())
    raw, platt = report["methods"]["raw"], report["methods"]["platt"]
    lines = (tiny_calibration / "calibrated_judge" / "platt" / "README.md").read_text().splitlines()
    assert lines[2].startswith("**Agrees with** ROUGE-L labels")
    assert f"{report['n_eval_pairs']} held-out pairs ({report['n_eval']} predictions" in lines[2]
    assert f"on {platt['accuracy']:.1%} of them" in lines[2]
    assert lines[4] == "| held out | raw (sigmoid of the logit) | `platt` (these probabilities) |"
    table = {line.split(" | ")[0].strip("| "): line.split(" | ")[1:] for line in lines[6:11]}
    for key, name in [
        ("accuracy", "accuracy (higher is better)"),
        ("ece", "ECE (lower is better)"),
        ("brier", "Brier (lower is better)"),
        ("auc", "AUC (higher is better)"),
    ]:
        assert [c.strip(" |") for c in table[name]] == [f"{raw[key]:.4f}", f"{platt[key]:.4f}"]
    needs = next(i for i, line in enumerate(lines) if line.startswith("**Each call needs**"))
    assert "no references" in lines[needs] and needs < lines.index(
        "Load it with `CalibratedJudge.from_pretrained(path)` (`from judgeloop import CalibratedJudge`)."
    )
    card = json.loads((tiny_calibration / "calibrated_judge" / "platt" / "calibrated_judge.json").read_text())
    assert card["needs"] == {"references": None, "setting": None}
    assert card["held_out_raw"]["ece"] == raw["ece"] and card["held_out"]["pairs"] == report["n_eval_pairs"]


def _platt():
    from judgeloop.calibration import PlattCalibrator

    return PlattCalibrator().load_state_dict(
        {
            "method": "platt",
            "symmetric": True,
            "min_points": 10,
            "n_fit_": 100,
            "params": {"a_": 0.7, "b_": 0.0, "fit_intercept": False, "target_smoothing": False},
        }
    )


def test_a_judge_that_reads_references_says_so_and_compare_checks_it_first(tmp_path):
    """The README's SummEval judge (embedding, ``embedding_target: references``), on the tiny encoder."""
    from judgeloop.judges import JudgeConfig, JudgeNeeds
    from judgeloop.judges.calibrated import MissingReferences

    cfg = JudgeConfig(type="embedding", model="judgeloop-tiny/encoder", embedding_target="references")
    CalibratedJudge(cfg, _platt()).save_pretrained(tmp_path / "refs")
    assert CalibratedJudge.needs_of(tmp_path / "refs") == JudgeNeeds(
        "neutral", "judge.embedding_target=references"
    )
    judge = CalibratedJudge.from_pretrained(tmp_path / "refs")
    assert judge.reads_references and judge.card["needs"]["setting"] == "judge.embedding_target=references"
    card = (tmp_path / "refs" / "README.md").read_text()
    assert "**Each call needs** the source text, the two summaries and each item's neutral reference" in card
    articles, a, b = ["rain in spain", "sun in rome"], ["rain falls", "sun shines"], ["snow", "fog"]
    with pytest.raises(
        MissingReferences,
        match=r"reads references \(judge.embedding_target=references\) but 2 "
        r"of 2 have none \(first: item 0\); pass references= to compare",
    ):
        judge.compare(articles, a, b)
    with pytest.raises(MissingReferences, match=r"1 of 2 have none \(first: item 1\)"):
        judge.compare(articles, a, b, [["rain falls in spain"], [" "]])
    assert judge.calls == 0  # refused before any judging
    out = judge.compare(articles, a, b, [["rain falls in spain"], ["the sun shines in rome"]])
    assert out.valid.all()

    extractive = JudgeConfig(type="embedding", model="judgeloop-tiny/encoder", embedding_target="extractive")
    from judgeloop.judges import PanelConfig, judge_needs

    members = [JudgeConfig(type="objective", signal="length"), JudgeConfig(type="objective", signal="rouge")]
    panel = JudgeConfig(type="panel", panel=PanelConfig(members=members))
    assert judge_needs(extractive) == JudgeNeeds("extractive", "judge.embedding_target=extractive")
    assert judge_needs(panel) == JudgeNeeds("neutral", "judge.panel.members[1].signal=rouge")
    assert not judge_needs(JudgeConfig(type="embedding", model="judgeloop-tiny/encoder")).reads_references


def test_the_fix_the_error_suggests_gives_a_judge_that_reads_no_references(repo, tiny_calibration):
    """The error names a setting to calibrate with; applied to the README's SummEval calibrate config, it
    gives a judge that reads none (``from_pretrained`` rightly refuses it as an override: the calibrator
    was fit on the other target, and the message says to calibrate instead)."""
    from judgeloop.judges import judge_needs

    summeval = repo / "configs/calibrate/summeval_embedding.yaml"
    needs = judge_needs(load_config(CalibrateConfig, summeval).judge)
    assert needs.reads_references and needs.alternative == "judge.embedding_target=article"
    assert not judge_needs(load_config(CalibrateConfig, summeval, [needs.alternative]).judge).reads_references
    with pytest.raises(
        ConfigError, match=r"overrides change \['embedding_target'\].*calibrate the changed judge"
    ):
        CalibratedJudge.from_pretrained(
            tiny_calibration / "calibrated_judge" / "platt", ["embedding_target=article"]
        )
