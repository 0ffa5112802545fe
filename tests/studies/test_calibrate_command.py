"""End-to-end `judgeloop calibrate` with a tiny encoder (fast) and, on real data, MiniLM on SummEval."""

from __future__ import annotations

import json

import numpy as np
import pytest

from judgeloop.calibration import LabelConfig, build_labeled_pairs, ece, rouge_label
from judgeloop.cli import main
from judgeloop.data import DataConfig, load_examples


def test_rouge_labels_and_synthetic_candidates():
    assert rouge_label("the cat sat on the mat", "dogs bark", ["the cat sat on a mat"]) == 1
    assert rouge_label("dogs bark", "the cat sat on the mat", ["the cat sat on a mat"]) == 0
    assert rouge_label("same words", "same words", ["same words here"]) is None
    ex = load_examples(DataConfig(embedded_size=20))
    pairs, stats = build_labeled_pairs(ex, LabelConfig(type="rouge"), seed=0, max_pairs_per_article=5)
    assert 0 < len(pairs) <= 100 and stats.pairs_considered >= len(pairs)
    assert all(p.a != p.b and p.a not in ex[0].neutral for p in pairs)
    labels = np.array([p.label for p in pairs])
    assert 0.2 < labels.mean() < 0.8  # random orientation gives both classes


def test_calibrate_end_to_end_tiny(repo, tmp_path):
    out = tmp_path / "run"
    rc = main(
        [
            "calibrate",
            "--config",
            str(repo / "configs/calibrate/embedded_embedding.yaml"),
            "judge.model=judgeloop-tiny/encoder",
            "data.embedded_size=120",
            "max_pairs_per_article=6",
            f"output_dir={out}",
        ]
    )
    assert rc == 0
    report = json.loads((out / "report.json").read_text())
    for key in ("n_fit", "n_eval", "methods"):
        assert key in report
    assert set(report["methods"]) >= {"raw", "platt", "isotonic"}
    for m in report["methods"].values():
        assert set(m) >= {"ece", "brier", "nll", "auc", "accuracy"}
    rows = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    assert len(rows) == report["n_eval"]
    assert set(rows[0]) >= {"article_id", "score", "label", "p_raw", "p_platt", "p_isotonic"}
    # the report's numbers can be recomputed from predictions.jsonl
    p = np.array([r["p_platt"] for r in rows])
    y = np.array([r["label"] for r in rows])
    assert ece(p, y, 15) == pytest.approx(report["methods"]["platt"]["ece"])
    assert (out / "reliability.png").stat().st_size > 1000
    assert (out / "calibrators" / "platt.json").is_file()
    assert "| platt |" in (out / "report.md").read_text()
    # calibration and test articles are disjoint
    assert report["articles"]["calibration"] > 0 and report["articles"]["test"] > 0


def test_calibrate_empty_split_error(repo, tmp_path, capsys):
    rc = main(
        [
            "calibrate",
            "--config",
            str(repo / "configs/calibrate/embedded_embedding.yaml"),
            "judge.model=judgeloop-tiny/encoder",
            "data.embedded_size=20",
            "data.split.test=0.0",
            f"output_dir={tmp_path / 'x'}",
        ]
    )
    assert rc == 2
    assert "the 'test' split is empty" in capsys.readouterr().err
    assert not (tmp_path / "x" / "report.json").exists()


def test_calibrate_unknown_method_error(repo, capsys):
    rc = main(
        ["calibrate", "--config", str(repo / "configs/calibrate/embedded_embedding.yaml"), "methods=[plat]"]
    )
    assert rc == 2
    assert "unknown calibrator(s) ['plat']" in capsys.readouterr().err


@pytest.mark.slow
def test_summeval_embedding_meets_targets(repo, shared_data, tmp_path):
    """The shipped SummEval config: calibrated ECE small, and calibration costs no decisions."""
    out = tmp_path / "summeval"
    rc = main(
        [
            "calibrate",
            "--config",
            str(repo / "configs/calibrate/summeval_embedding.yaml"),
            "data.format=summeval",
            f"data.path={shared_data / 'summeval/summeval_dev.jsonl'}",
            f"output_dir={out}",
        ]
    )
    assert rc == 0
    m = json.loads((out / "report.json").read_text())["methods"]
    assert m["platt"]["ece"] <= 0.05
    assert m["isotonic"]["ece"] <= 0.06
    for name in ("platt", "isotonic"):
        assert m[name]["brier"] <= m["raw"]["brier"] + 1e-9
        assert m[name]["nll"] <= m["raw"]["nll"] + 1e-9
        assert abs(m[name]["accuracy"] - m["raw"]["accuracy"]) <= 0.01
