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
