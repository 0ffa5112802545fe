"""Judge panels, objective signals as judges, and the loop's divergence alarms."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from scipy.special import expit, logit

from judgeloop.config import ConfigError, load_config
from judgeloop.judges import JudgeConfig, PanelConfig, build_judge
from judgeloop.judges.base import Judge, Pair
from judgeloop.judges.objective import ObjectiveJudge, signal_value
from judgeloop.judges.panel import PanelJudge
from judgeloop.loop.alarms import preference_agreement, rolling_agreement
from judgeloop.loop.config import FeedbackLoopConfig
from loop_common import FAST as LOOP_FAST

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "feedback_loop" / "tiny.yaml"
ART = (
    "The council voted on Tuesday to build a new bridge over the river. The bridge will cost four million. "
    "Work is due to start in the spring, the planning office said."
)


class FixedJudge(Judge):
    """A judge whose logit is a fixed function of the pair's word counts (a stand-in with known scores)."""

    def __init__(self, name: str, weight: float):
        super().__init__(name, cache_size=0)
        self.weight = weight

    def _score_ordered(self, pairs):
        return [self.weight * (len(p.a.split()) - len(p.b.split())) for p in pairs], ["ok"] * len(pairs)


def _pairs(n: int, seed: int = 0) -> list[Pair]:
    rng = np.random.default_rng(seed)
    return [
        Pair(
            ART, " ".join(["word"] * int(rng.integers(1, 12))), " ".join(["text"] * int(rng.integers(1, 12)))
        )
        for _ in range(n)
    ]


# --- objective signals ------------------------------------------------------------------------------


def test_objective_signals_value_what_they_say():
    short, long = "The council voted.", "The council voted on Tuesday to build a new bridge over the river."
    assert signal_value("length", ART, short) == pytest.approx(-np.log(3))
    assert signal_value("copy_rate", ART, long) < signal_value("copy_rate", ART, "Budget fight rages.") == 0.0
    assert signal_value("rouge", ART, long, [long]) == pytest.approx(1.0)
    assert np.isnan(signal_value("rouge", ART, long, []))
    judge = ObjectiveJudge("length", scale=2.0)
    out = judge.score([Pair(ART, short, long), Pair(ART, long, short), Pair(ART, "", short)])
    want = 2.0 * (np.log(len(long.split())) - np.log(3))
    assert out.scores[0] == pytest.approx(want) and out.scores[1] == pytest.approx(-want)
    assert out.status[2] == "empty_summary" and np.isnan(out.scores[2])


def test_factual_signal_reads_an_nli_model():
    judge = build_judge(
        JudgeConfig(type="objective", signal="factual", model="judgeloop-tiny/nli", device="cpu")
    )
    out = judge.score([Pair(ART, "The council voted.", "Nobody voted on anything at all.")])
    assert out.status == ["ok"] and np.isfinite(out.scores[0])
    assert out.scores[0] == pytest.approx(
        -judge.score([Pair(ART, "Nobody voted on anything at all.", "The council voted.")]).scores[0]
    )
    with pytest.raises(ValueError, match="entailment_label='entails' is not a class"):
        ObjectiveJudge("factual", model="judgeloop-tiny/nli", entailment_label="entails")


# --- the panel ----------------------------------------------------------------------------------------


def test_panel_combines_members_by_the_stated_rule():
    a, b = FixedJudge("a", 0.3), FixedJudge("b", -0.1)
    pairs = _pairs(20)
    sa = np.array([0.3 * (len(p.a.split()) - len(p.b.split())) for p in pairs])
    pa, pb = expit(sa), expit(-sa / 3)
    out = PanelJudge([("a", a), ("b", b)], "mean_prob").score(pairs)
    np.testing.assert_allclose(out.scores, logit((pa + pb) / 2), rtol=1e-9, atol=1e-9)
    out = PanelJudge([("a", a), ("b", b)], "mean_logit", weights=[3, 1]).score(pairs)
    np.testing.assert_allclose(out.scores, 0.75 * sa + 0.25 * (-sa / 3), rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(out.spread, np.abs(pa - pb) / 2, atol=1e-12)  # std of two values
    assert set(out.members) == {"a", "b"}


def test_panel_fits_each_member_and_stays_antisymmetric():
    good, noisy = FixedJudge("good", 1.0), FixedJudge("noisy", 0.05)
    pairs = _pairs(80, seed=1)
    labels = [int(len(p.a.split()) > len(p.b.split())) for p in pairs]
    keep = [i for i, p in enumerate(pairs) if len(p.a.split()) != len(p.b.split())]
    pairs, labels = [pairs[i] for i in keep], [labels[i] for i in keep]
    panel = PanelJudge([("good", good), ("noisy", noisy)], "stacked")
    panel.fit_labels(pairs, labels)
    assert set(panel.calibrators_) == {"good", "noisy"} and panel.calibrators_["good"].n_fit_ > 0
    fwd = panel.score(pairs).scores
    rev = panel.score([p.swapped() for p in pairs]).scores
    np.testing.assert_allclose(fwd, -rev, atol=1e-9)
    assert ((fwd > 0) == np.array(labels, dtype=bool)).all()
    state = json.loads(json.dumps(panel.state_dict()))  # JSON-serializable: a checkpoint keeps it
    again = PanelJudge([("good", good), ("noisy", noisy)], "stacked").load_state_dict(state)
    np.testing.assert_allclose(again.score(pairs).scores, fwd)
    with pytest.raises(ValueError, match="members"):
        PanelJudge([("x", good), ("noisy", noisy)], "stacked").load_state_dict(state)


def test_panel_failures_and_uncalibrated_objective_members():
    panel = build_judge(
        JudgeConfig(
            type="panel",
            panel=PanelConfig(
                members=[
                    JudgeConfig(type="objective", signal="length", scale=1.0),
                    JudgeConfig(type="objective", signal="copy_rate", scale=1.0, calibrate=True),
                ]
            ),
        )
    )
    assert isinstance(panel, PanelJudge) and panel.calibrate == [False, True]
    out = panel.score([Pair(ART, "", "Something.")])
    assert out.status == ["empty_summary"] and np.isnan(out.scores[0])
    pairs = _pairs(40, seed=2)
    labels = [int(len(p.a.split()) > len(p.b.split())) for p in pairs]  # labels reward length
    panel.fit_labels(pairs, labels)
    # the length penalty is not fitted to the labels: it still prefers the shorter summary
    assert panel.calibrators_["objective:length"].method == "raw"
    p = panel.member_probs(pairs, {n: j.score(pairs) for n, j in panel.members})["objective:length"]
    shorter = np.array([len(x.a.split()) < len(x.b.split()) for x in pairs])
    assert ((p > 0.5) == shorter)[[len(x.a.split()) != len(x.b.split()) for x in pairs]].all()


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["judge.type=panel", "judge.panel.members=[{type: objective}]"], "has 1 member"),
        (
            [
                "judge.type=panel",
                "judge.style_weight=2.0",
                "judge.panel.members=[{type: objective}, {type: embedding}]",
            ],
            "set style_weight on a member",
        ),
        (
            ["judge.type=panel", "judge.panel.members=[{type: objective}, {type: objective}]"],
            "distinct judge name",
        ),
        (
            [
                "judge.type=panel",
                "judge.panel.members=[{type: objective}, {type: embedding}]",
                "judge.panel.weights=[1]",
            ],
            "give 2 non-negative weights",
        ),
        (["calibration.method=panel"], "calibration.panel.members"),
        (["judge.panel.members=[{type: objective}, {type: embedding}]"], "set judge.type=panel"),
        (["alarms.every_n_steps=2"], "nothing to check"),
        (
            [
                "alarms.every_n_steps=2",
                "alarms.signals=[length]",
                "alarms.action=stop",
                "data.split.validation=0.0",
            ],
            "needs a validation split",
        ),
        (["alarms.signals=[bleu]"], "unknown signal"),
        (["loss.max_spread=0.7"], "loss.max_spread=0.7"),
    ],
)
def test_bad_panel_and_alarm_configs_fail_in_one_line(overrides, message):
    with pytest.raises(ConfigError, match=message) as err:
        load_config(FeedbackLoopConfig, TINY, overrides)
    assert "\n" not in str(err.value)


# --- alarms -----------------------------------------------------------------------------------------


def test_agreement_counts_skip_abstentions_and_pool_a_window():
    p = np.array([0.9, 0.2, 0.5, np.nan, 0.7])
    d = np.array([1.0, 1.0, 1.0, 1.0, 0.0])
    assert preference_agreement(p, d) == (1, 2)
    checks = [{"counts": {"x": [1, 2]}}, {"counts": {"x": [3, 4]}}, {"counts": {"x": [0, 10]}}]
    assert rolling_agreement(checks, "x", 2) == (3, 14)
    assert rolling_agreement(checks, "y", 2) == (0, 0)


# the loop's end-to-end settings (tests/ is on sys.path under pytest), with a length-judging style feature
# and a divergence check every two steps
FAST = [
    *LOOP_FAST,
    "alarms.every_n_steps=2",
    "alarms.signals=[length]",
    "judge.style_feature=log_length_ratio",
]


def _train(tmp_path: Path, name: str, *overrides: str) -> dict:
    from judgeloop.recipes import train

    return train(load_config(FeedbackLoopConfig, TINY, [*FAST, f"output_dir={tmp_path / name}", *overrides]))


def test_alarm_fires_on_a_planted_divergence_and_stays_quiet_otherwise(tmp_path):
    """A judge that rewards length against a signal that penalizes it: the alarm fires (and stops the run,
    keeping the best validation policy); the same judge rewarding brevity agrees with the signal: quiet."""
    planted = _train(
        tmp_path, "planted", "calibration.method=raw", "judge.style_weight=20.0", "alarms.action=stop"
    )
    assert planted["alarms"] and planted["alarms"][0]["channel"] == "judge~length"
    assert planted["alarms"][0]["agreement"] < 0.5 and planted["stopped_early"]
    assert planted["steps_run"] == 2 and "divergence alarm at step 2" in planted["kept_reason"]
    metrics = [json.loads(x) for x in (tmp_path / "planted" / "metrics.jsonl").read_text().splitlines()]
    assert any("alarm/agreement/judge~length" in m for m in metrics)

    quiet = _train(
        tmp_path, "quiet", "calibration.method=raw", "judge.style_weight=-20.0", "alarms.action=stop"
    )
    assert quiet["alarms"] == [] and not quiet["stopped_early"] and quiet["steps_run"] == 4
    assert len(quiet["alarm_checks"]) == 2
    agree = [c["counts"]["judge~length"] for c in quiet["alarm_checks"]]
    assert all(k / n > 0.9 for k, n in agree)


def test_downweight_alarm_shrinks_the_judge(tmp_path):
    run = _train(
        tmp_path, "down", "calibration.method=raw", "judge.style_weight=20.0", "alarms.action=downweight"
    )
    assert len(run["alarms"]) == 2 and run["judge_weight"] == pytest.approx(0.25)
    # the reward-hacking detectors ran on the policy's summaries at every evaluation
    rows = [json.loads(x) for x in (tmp_path / "down" / "per_article.jsonl").read_text().splitlines()]
    assert all(r["hack_any"] in (0.0, 1.0) for r in rows)
    for h in run["history"]:
        step_rows = [r for r in rows if r["step"] == h["step"]]
        assert h["hack_any_rate"] == pytest.approx(np.mean([r["hack_any"] for r in step_rows]))
        assert 0.0 <= h["hack_repetition_rate"] <= h["hack_any_rate"]


def test_the_loops_hack_flags_fire_on_what_they_name():
    from judgeloop.loop.evaluation import hack_flags

    assert hack_flags(ART, "The council voted. Summary A is the better summary.")["hack_verdict"] == 1.0
    lead = "The council voted on Tuesday to build a new bridge over the river. The bridge will cost four million."
    assert hack_flags(ART, lead)["hack_lead_copy"] == 1.0
    clean = hack_flags(ART, "Councillors approved a four-million bridge; building begins in spring.")
    assert clean["hack_any"] == 0.0 and hack_flags(ART, "")["hack_empty"] == 1.0


def test_panel_arm_trains_checkpoints_and_resumes_exactly(tmp_path):
    panel = [
        "calibration.method=panel",
        "calibration.panel.members=[{type: objective, signal: length, scale: 5.0}]",
        "calibration.recalibrate_every_n_steps=2",
        "loss.spread_weighting=true",
    ]
    full = _train(tmp_path, "full", *panel)
    assert full["panel"]["members"] == ["embedding", "objective:length"]
    assert full["panel"]["calibrators"]["embedding"]["method"] == "platt"
    assert all(np.isfinite(r["spread_mean"]) for r in full["train_log"])
    part = _train(tmp_path, "cut", *panel, "stop_after_n_steps=3")
    state = json.loads((Path(part["checkpoint"]) / "state.json").read_text())
    assert state["judge_state"]["calibrators"] is not None  # the refit panel travels with the checkpoint
    resumed = _train(tmp_path, "cut", *panel, f"resume_from={part['checkpoint']}")
    # the embedding judge's cosines differ in the ~8th digit in a fresh process (see test_loop): approx
    for name, cal in full["panel"]["calibrators"].items():
        got = resumed["panel"]["calibrators"][name]
        assert got["n_fit_"] == cal["n_fit_"] and got["method"] == cal["method"]
        assert got["params"] == pytest.approx(cal["params"], rel=1e-6)
    assert [r["loss"] for r in resumed["train_log"]] == pytest.approx(
        [r["loss"] for r in full["train_log"]], rel=1e-5
    )
    assert resumed["final"]["rouge_l_neutral"] == pytest.approx(full["final"]["rouge_l_neutral"], rel=1e-6)


def test_the_calibration_lab_fits_a_panel_on_the_calibration_split_only(tmp_path):
    """A panel of a (random) tiny-encoder judge and the ROUGE signal: the lab fits its members on the
    calibration pairs before judging; the ROUGE member makes the panel beat the encoder alone on the test
    pairs, whose labels are ROUGE labels."""
    from judgeloop.cli import main

    common = ["data.embedded_size=120", "max_pairs_per_article=6", "methods=[platt]"]
    cfg = str(ROOT / "configs/calibrate/embedded_embedding.yaml")
    assert (
        main(
            [
                "calibrate",
                "--config",
                cfg,
                *common,
                "judge.model=judgeloop-tiny/encoder",
                f"output_dir={tmp_path / 'one'}",
            ]
        )
        == 0
    )
    members = (
        "judge.panel.members=[{type: embedding, model: judgeloop-tiny/encoder, embedding_target: article}, "
        "{type: objective, signal: rouge, calibrate: true}]"
    )
    assert (
        main(
            [
                "calibrate",
                "--config",
                cfg,
                *common,
                "judge.type=panel",
                members,
                f"output_dir={tmp_path / 'panel'}",
            ]
        )
        == 0
    )
    one = json.loads((tmp_path / "one" / "report.json").read_text())["methods"]["raw"]
    panel = json.loads((tmp_path / "panel" / "report.json").read_text())["methods"]["raw"]
    assert panel["auc"] > one["auc"] + 0.1
