"""The answer step: risk-coverage by hand, the target-risk threshold, the calibrated confidence, refusal
reasons, the conformal file tied to its corpus, and the command's bad inputs."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from judgeloop.config import ConfigError, load_config
from judgeloop.routing.abstention import (
    REASONS,
    AnswerConfidence,
    RiskThreshold,
    aurc,
    refusal_reasons,
    risk_coverage,
    selective_risk,
)

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "routing" / "squad2_abstain.yaml"


def test_risk_coverage_and_aurc_by_hand():
    conf = np.array([0.9, 0.1, 0.5, 0.7])
    loss = np.array([0.0, 1.0, 1.0, 0.0])
    cov, risk = risk_coverage(conf, loss)
    # order 0.9, 0.7, 0.5, 0.1 -> losses 0, 0, 1, 1 -> running means 0, 0, 1/3, 1/2
    assert cov.tolist() == [0.25, 0.5, 0.75, 1.0]
    assert risk.tolist() == pytest.approx([0.0, 0.0, 1 / 3, 0.5])
    assert aurc(conf, loss) == pytest.approx((0 + 0 + 1 / 3 + 0.5) / 4)
    assert selective_risk(conf, loss, 0.5) == 0.0 and selective_risk(conf, loss, 0.6) == pytest.approx(1 / 3)
    # a NaN confidence is answered last
    assert risk_coverage(np.array([np.nan, 0.2]), np.array([1.0, 0.0]))[1].tolist() == [0.0, 0.5]
    with pytest.raises(ValueError, match="coverage=0"):
        selective_risk(conf, loss, 0.0)
    with pytest.raises(ValueError, match="loss has NaN"):
        risk_coverage(conf, np.array([0.0, np.nan, 0.0, 0.0]))


def test_risk_threshold_meets_the_target_with_the_most_coverage():
    conf = np.array([0.9, 0.8, 0.7, 0.6, 0.5, 0.4])
    loss = np.array([0.0, 0.0, 1.0, 0.0, 1.0, 1.0])
    # answering {c >= t}: t=.9 -> 0; .8 -> 0; .7 -> 1/3; .6 -> 1/4; .5 -> 2/5; .4 -> 1/2
    thr = RiskThreshold(0.25).fit(conf, loss)
    assert thr.threshold_ == 0.6 and thr.coverage_ == pytest.approx(4 / 6) and thr.risk_ == 0.25 and thr.met_
    assert thr.predict(np.array([0.65, 0.55, np.nan])).tolist() == [True, False, False]
    never = RiskThreshold(0.01).fit(np.array([0.5, 0.4]), np.array([1.0, 1.0]))
    assert not never.met_ and math.isinf(never.threshold_) and not never.predict(np.array([1.0])).any()
    back = RiskThreshold(0.5).load_state_dict(json.loads(json.dumps(thr.state_dict())))
    assert back.threshold_ == 0.6
    for bad in (0.0, 1.0, 1.5):
        with pytest.raises(ValueError, match=f"target_risk={bad} must be in \\(0, 1\\)"):
            RiskThreshold(bad)


def test_answer_confidence_is_calibrated_and_matches_sklearn_logistic():
    from sklearn.linear_model import LogisticRegression

    rng = np.random.default_rng(0)
    x = rng.normal(size=(4000, 2))
    p = 1 / (1 + np.exp(-(1.5 * x[:, 0] - 0.8 * x[:, 1] + 0.3)))
    y = rng.random(4000) < p
    model = AnswerConfidence(["a", "b"], l2=1e-6).fit({"a": x[:, 0], "b": x[:, 1]}, y)
    ref = LogisticRegression(C=1e6).fit(x, y).predict_proba(x)[:, 1]
    got = model.predict({"a": x[:, 0], "b": x[:, 1]})
    assert np.abs(got - ref).max() < 1e-3
    # calibrated: in each decile of predicted p the observed rate is close
    bins = np.quantile(got, np.linspace(0, 1, 11))
    for lo, hi in zip(bins[:-1], bins[1:]):
        m = (got >= lo) & (got <= hi)
        assert abs(y[m].mean() - got[m].mean()) < 0.06
    back = AnswerConfidence(["a", "b"]).load_state_dict(json.loads(json.dumps(model.state_dict())))
    assert np.allclose(back.predict(x), got)
    # soft targets (an F1 in [0, 1]): the confidence estimates their mean
    soft = AnswerConfidence(["a", "b"], l2=1e-6).fit({"a": x[:, 0], "b": x[:, 1]}, p)
    assert np.abs(soft.predict({"a": x[:, 0], "b": x[:, 1]}) - p).max() < 1e-3
    with pytest.raises(ValueError, match=r"targets must lie in \[0, 1\]"):
        AnswerConfidence(["a"]).fit({"a": x[:, 0]}, 2 * p)
    from judgeloop.calibration import CalibrationError

    with pytest.raises(CalibrationError, match="20 questions whose targets are all 0.0"):
        AnswerConfidence(["a"]).fit({"a": x[:20, 0]}, np.zeros(20, bool))
    with pytest.raises(ValueError, match=r"features \['b'\] are missing"):
        model.predict({"a": x[:, 0]})


def test_refusal_reasons_take_the_first_flag_in_order():
    flags = {k: np.zeros(4, bool) for k in REASONS[:-1]}
    flags["conformal_set_empty"][[1, 2]] = True
    flags["passages_disagree"][[2, 3]] = True
    got = refusal_reasons(flags, np.array([True, True, True, False]))
    assert got == ["low_confidence", "conformal_set_empty", "conformal_set_empty", None]
    with pytest.raises(ValueError, match="refusal flags"):
        refusal_reasons({"no_passage_above_gate": np.zeros(1, bool)}, np.array([True]))


def test_conformal_levels_pvalues_and_the_file_tied_to_its_corpus(tmp_path):
    from judgeloop.retrieval.conformal import (
        ConformalRetriever,
        conformal_quantile,
        corpus_fingerprint,
        load_conformal_file,
        save_conformal_file,
    )

    # ten calibration queries of one relevant candidate each, scores .50 .. .95: nonconformity .05 .. .50
    s = np.linspace(0.5, 0.95, 10)[:, None]
    model = ConformalRetriever(alpha=0.2).fit(s, np.ones((10, 1), bool), np.zeros(10, int))
    assert model.threshold_at(0.8) == pytest.approx(
        conformal_quantile(1 - s.ravel(), 0.2)
    )  # the 9th smallest
    cand = np.array([0.9, 0.55, 0.2])
    # (1 + #{S_i >= 1 - s}) / 11: 0.9 -> the nine from .10 up; 0.55 -> .45 and .50 (a tie counts); 0.2 -> none
    assert model.pvalue(cand).tolist() == pytest.approx([10 / 11, 3 / 11, 1 / 11])
    lv = model.levels(cand, [0.8, 0.5])
    assert lv[0] == 0.5 and lv[1] == 0.8 and math.isnan(lv[2])  # tightest set that holds it; none
    corpus = corpus_fingerprint(["a", "b"], ["text a", "text b"])
    assert corpus == corpus_fingerprint(["b", "a"], ["text b", "text a"])  # order-free
    scorer = {"encoder": "m", "score_map": "affine"}
    save_conformal_file(tmp_path / "c.json", model, corpus, scorer)
    back = load_conformal_file(tmp_path / "c.json", corpus, scorer, "abstain.conformal_path")
    assert back.threshold_ == model.threshold_ and np.array_equal(back.scores_, model.scores_)
    other = corpus_fingerprint(["a", "b"], ["text a", "another text"])
    with pytest.raises(
        ValueError, match=r"abstain.conformal_path=.*c.json was fitted on another corpus \(2 documents"
    ):
        load_conformal_file(tmp_path / "c.json", other, scorer, "abstain.conformal_path")
    with pytest.raises(ValueError, match="fitted with other scores \\(encoder: 'm' in the file, 'x' here\\)"):
        load_conformal_file(tmp_path / "c.json", corpus, {**scorer, "encoder": "x"}, "k")
    with pytest.raises(ValueError, match="does not exist"):
        load_conformal_file(tmp_path / "none.json", corpus, scorer, "k")


@pytest.mark.parametrize("value", ["0", "1", "1.5", "-0.1"])
def test_target_risk_outside_0_1_is_a_config_error(value):
    from judgeloop.commands.answer import AnswerConfig

    with pytest.raises(ConfigError, match=f"abstain.target_risk={float(value)} must be in \\(0, 1\\)"):
        load_config(AnswerConfig, CONFIG, [f"abstain.target_risk={value}"])


def _squad(tmp_path: Path) -> Path:
    rows = []
    for i in range(12):
        ctx = f"Paragraph {i}: the river town number {i} was founded by settler {i} in the year {1000 + i}."
        rows.append(
            {
                "id": f"q{i}",
                "title": "t",
                "paragraph_index": i,
                "context": ctx,
                "question": f"Who founded river town number {i}?",
                "answers": [] if i % 3 == 0 else [f"settler {i}"],
                "is_impossible": i % 3 == 0,
            }
        )
    path = tmp_path / "squad.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_a_conformal_file_for_another_pool_is_one_line_before_any_model_loads(tmp_path, capsys):
    from judgeloop.cli import main
    from judgeloop.retrieval.conformal import ConformalRetriever, corpus_fingerprint, save_conformal_file

    model = ConformalRetriever(0.2).fit(np.full((5, 1), 0.8), np.ones((5, 1), bool), np.zeros(5, int))
    scorer = {
        "encoder": "sentence-transformers/all-MiniLM-L6-v2",
        "pooling": "mean",
        "max_length": 256,
        "score_map": "affine",
    }
    save_conformal_file(
        tmp_path / "conformal.json", model, corpus_fingerprint(["0"], ["another pool"]), scorer
    )
    rc = main(
        [
            "answer",
            "--config",
            str(CONFIG),
            f"data.path={_squad(tmp_path)}",
            f"abstain.conformal_path={tmp_path / 'conformal.json'}",
            f"output_dir={tmp_path / 'out'}",
        ]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert "abstain.conformal_path=" in err[0] and "was fitted on another corpus (1 documents" in err[0]
    assert "than this run's (12 documents" in err[0]
    assert not (tmp_path / "out").exists()


def test_the_reader_model_missing_is_one_line(tmp_path, capsys):
    from judgeloop.cli import main

    rc = main(
        [
            "answer",
            "--config",
            str(CONFIG),
            f"data.path={_squad(tmp_path)}",
            "model.name=no-such-org/no-such-model",
            f"output_dir={tmp_path / 'out'}",
        ]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "model.name='no-such-org/no-such-model'" in err[0]


def test_answer_command_on_a_tiny_reader_reports_a_calibration_split_without_correct_answers(
    tmp_path, capsys
):
    """The whole pipeline runs with the tiny random reader; its answers are noise, so no calibration answer
    is correct and the confidence cannot be fitted: one line that says so, nothing written."""
    import logging

    from judgeloop.cli import main

    logging.getLogger(
        "judgeloop"
    ).handlers.clear()  # log to this test's captured stderr, not an earlier one's
    rc = main(
        [
            "answer",
            "--config",
            str(CONFIG),
            f"data.path={_squad(tmp_path)}",
            "model.name=judgeloop-tiny/causal-lm",
            "model.max_new_tokens=3",
            "retriever.encoder.name=judgeloop-tiny/encoder",
            "cache_dir=null",
            f"output_dir={tmp_path / 'out'}",
        ]
    )
    err = [x for x in capsys.readouterr().err.strip().splitlines() if x.startswith("judgeloop")]
    assert (
        rc == 2 and len(err) == 1 and "answer confidence: the calibration split has 6 questions" in err[0]
    ), err
    assert not (tmp_path / "out" / "report.json").exists()


def test_answer_command_end_to_end_with_a_tiny_reader_whose_answers_are_made_gold(tmp_path):
    """The tiny random reader's answers are noise, so the test makes them right: a first pass reads its
    (greedy, seeded) answers, and the data set written for the second pass takes them as the gold answers of
    two thirds of the answerable questions. The prompts hold no gold answer, so the reader answers the same."""
    from judgeloop.commands.answer import AnswerConfig, run
    from judgeloop.studies.answer import load_reader, read_answers, retrieve_all
    from judgeloop.studies.routing import load_questions

    rows = []
    for i in range(30):
        ctx = f"Paragraph {i}: the river town number {i} was founded by settler {i} in the year {1000 + i}."
        rows.append(
            {
                "id": f"q{i}",
                "title": "t",
                "paragraph_index": i,
                "context": ctx,
                "question": f"Who founded river town number {i}?",
                "answers": [] if i % 3 == 0 else ["x"],
                "is_impossible": i % 3 == 0,
            }
        )
    path = tmp_path / "squad.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    overrides = [
        f"data.path={path}",
        "model.name=judgeloop-tiny/causal-lm",
        "model.max_new_tokens=3",
        "retriever.encoder.name=judgeloop-tiny/encoder",
        f"cache_dir={tmp_path / 'cache'}",
        "abstain.num_bootstrap=50",
        "abstain.target_risk=0.6",
        f"output_dir={tmp_path / 'out'}",
    ]
    cfg = load_config(AnswerConfig, CONFIG, overrides)
    examples, pool = load_questions(cfg.data)
    r = retrieve_all(cfg, examples, pool)
    shown = [[pool[j] for j in row] for row in r.top]
    first = read_answers(cfg, load_reader(cfg), examples, shown)["answers"]
    for i, row in enumerate(rows):
        if not row["is_impossible"] and i % 3 != 2 and first[i].strip():
            row["answers"] = [first[i]]
    path.write_text("\n".join(json.dumps(x) for x in rows) + "\n")

    report = run(load_config(AnswerConfig, CONFIG, overrides))
    out = tmp_path / "out"
    assert report["data"]["num_questions"] == 30 and report["data"]["num_unanswerable"] == 10
    rc = report["risk_coverage"]
    assert len(rc) == report["data"]["n_test"] and rc[-1]["coverage"] == 1.0
    assert rc[-1]["risk"] == pytest.approx(1 - report["always_answer_f1_test"])
    for c in ("0.8", "0.9"):
        s = report["selective_f1"][c]
        assert s["always_answer"]["f1"] == pytest.approx(report["always_answer_f1_test"])
        d = s["system_minus_always"]
        assert d["delta"] == pytest.approx(s["system"]["f1"] - s["always_answer"]["f1"])
        assert d["ci95"][0] <= d["delta"] + 1e-12 and d["delta"] - 1e-12 <= d["ci95"][1]
    answers = [json.loads(x) for x in (out / "answers.jsonl").read_text().splitlines()]
    test_rows = [x for x in answers if x["split"] == "test"]
    refused = [x for x in test_rows if not x["answered"]]
    assert all(x["reason"] in REASONS for x in refused) and all(
        x["reason"] is None for x in test_rows if x["answered"]
    )
    assert sum(v["count"] for v in report["refusals"].values()) == len(refused)
    assert report["threshold"]["test"]["coverage"] == pytest.approx(1 - len(refused) / len(test_rows))
    for name in ("report.md", "risk_coverage.png", "conformal.json", "abstention.json", "config.yaml"):
        assert (out / name).is_file(), name
    # the saved conformal file is reused on the same pool, and its test figures are the same
    again = run(
        load_config(
            AnswerConfig,
            CONFIG,
            overrides[:-1]
            + [f"abstain.conformal_path={out / 'conformal.json'}", f"output_dir={tmp_path / 'again'}"],
        )
    )
    assert again["conformal"]["loaded"] and again["selective_f1"] == report["selective_f1"]
    assert len(list((tmp_path / "cache").glob("reader-*.json"))) == 1  # the reader ran once for all three
