"""Iterated batch DPO (``mode: rounds``, judgeloop.loop.dpo.batch_dpo_update, loop/rounds.py): a resume at a
round boundary equals the uninterrupted run, each round trains on the labeled pairs of its own generations,
a bad rounds setting is one line and exit 2."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from judgeloop.config import load_config
from judgeloop.loop.config import FeedbackLoopConfig
from loop_common import FAST, TINY, same_row

# two rounds of 4 articles, two passes in minibatches of 2: 4 optimizer steps per round; small refits
SCHEDULES = ("max_steps", "eval_every", "calibration.recalibrate", "calibration.num_articles")
ROUNDS = [o for o in FAST if not o.startswith(SCHEDULES)] + [
    "mode=rounds",
    "max_steps=2",
    "eval_every_n_steps=1",
    "calibration.recalibrate_every_n_steps=1",
    "calibration.num_articles=12",
    "calibration.pairs_per_article=2",
    "calibration.extra_rounds=0",
    "rounds.prompts_per_round=4",
    "rounds.dpo_epochs=2",
    "batch_size=2",
]


def _pairs(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.slow
def test_rounds_resume_at_a_round_boundary_and_train_on_each_rounds_own_pairs(tmp_path, monkeypatch):
    import judgeloop.loop.dpo as dpo
    from judgeloop.recipes import train

    calls: list[tuple[list[str], list[str], list[float], list[float]]] = []
    real = dpo.dpo_update

    def watched(learner, roll, targets, mask, weights, kl_coef):  # the real update, its inputs recorded
        calls.append((list(roll.a_text), list(roll.b_text), targets.tolist(), mask.tolist()))
        return real(learner, roll, targets, mask, weights, kl_coef)

    monkeypatch.setattr(dpo, "dpo_update", watched)
    full = train(load_config(FeedbackLoopConfig, TINY, [*ROUNDS, f"output_dir={tmp_path / 'full'}"]))
    monkeypatch.setattr(dpo, "dpo_update", real)

    # each round's optimizer steps took exactly that round's labeled pairs, each once per pass, with the
    # soft target its row records (P(a better than b) = p_chosen's side)
    assert [t["optimizer_steps"] for t in full["train_log"]] == [4.0, 4.0]
    seen_articles: list[set[str]] = []
    for r in (1, 2):
        rows = _pairs(tmp_path / "full" / "rounds" / f"round_{r}.jsonl")
        assert len(rows) == 4 and {x["round"] for x in rows} == {r}
        labeled = Counter()
        for x in rows:
            labeled[(x["chosen"], x["rejected"], round(x["target"], 6))] += 2  # dpo_epochs=2
        trained = Counter()
        for a, b, t, m in calls[4 * (r - 1) : 4 * r]:
            for ai, bi, ti, mi in zip(a, b, t, m):
                assert mi == 1.0
                key = (ai, bi, round(ti, 6)) if ti >= 0.5 else (bi, ai, round(1 - ti, 6))
                trained[key] += 1
        assert trained == labeled
        seen_articles.append({x["article_id"] for x in rows})
    assert not seen_articles[0] & seen_articles[1]  # round 2 generated on its own articles

    # killed at the round boundary (a checkpoint after round 1), then the same command again
    cut_cfg = [*ROUNDS, f"output_dir={tmp_path / 'cut'}"]
    part = train(load_config(FeedbackLoopConfig, TINY, [*cut_cfg, "stop_after_n_steps=1"]))
    assert part["interrupted"] and part["step"] == 1
    resumed = train(load_config(FeedbackLoopConfig, TINY, [*cut_cfg, "resume_from=auto"]))
    assert resumed["steps_run"] == full["steps_run"] == 2
    same_row(resumed["final"], full["final"])
    for a, b in zip(resumed["train_log"], full["train_log"], strict=True):
        same_row(a, b)
    for a, b in zip(resumed["refits"], full["refits"], strict=True):
        same_row(a, b)
    assert json.dumps(resumed["rounds"], sort_keys=True) == json.dumps(full["rounds"], sort_keys=True)
    for r in (1, 2):
        name = f"round_{r}.jsonl"
        assert _pairs(tmp_path / "cut" / "rounds" / name) == _pairs(tmp_path / "full" / "rounds" / name)
    # the report's rounds table: rounds 0..2, with intervals, and rounds.md
    assert [row["round"] for row in full["rounds"]] == [0, 1, 2]
    assert {"rouge_1_neutral", "rouge_1_extractive", "copy_rate"} <= set(full["rounds"][0])
    assert "rouge_1_extractive_change" in full["rounds"][2]
    assert "| 2 |" in (tmp_path / "full" / "rounds.md").read_text()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["rounds.dpo_epochs=2"],
            "rounds.dpo_epochs=2 is read under mode=rounds only (iterated batch DPO); set mode=rounds or "
            "leave rounds.dpo_epochs unset",
        ),
        (
            ["mode=rounds", "loss.type=grpo"],
            "mode=rounds is iterated batch DPO; loss.type=grpo is online only: set loss.type=dpo or mode=online",
        ),
        (
            ["mode=rounds", "rounds.prompts_per_round=0"],
            "config key 'rounds.prompts_per_round'=0 must be >= 1 (training articles per round, per process)",
        ),
    ],
)
def test_a_bad_rounds_setting_is_one_line_and_exit_2(tmp_path, capsys, overrides, message):
    from judgeloop.cli import main

    rc = main(["train", "--config", str(TINY), f"output_dir={tmp_path}", *overrides])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1
    assert message in err[0]


def test_a_round_larger_than_the_train_split_is_refused_before_any_model_loads(tmp_path, capsys):
    from judgeloop.cli import main

    rc = main(
        [
            "train",
            "--config",
            str(TINY),
            f"output_dir={tmp_path}",
            "mode=rounds",
            "rounds.prompts_per_round=5000",
        ]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1
    assert "fewer than rounds.prompts_per_round=5000; lower rounds.prompts_per_round" in err[0]


def test_rounds_mode_sets_the_schedules_it_counts_in_rounds():
    cfg = load_config(
        FeedbackLoopConfig,
        None,
        ["mode=rounds", "max_steps=3", "rounds.prompts_per_round=10", "rounds.dpo_epochs=2", "batch_size=4"],
    )
    assert (cfg.eval_every_n_steps, cfg.save_every_n_steps, cfg.calibration.recalibrate_every_n_steps) == (
        1,
        1,
        1,
    )
    assert cfg.articles_per_step == 10
    assert cfg.optimizer_steps == 3 * 2 * 3  # rounds x passes x ceil(10 / 4) minibatches
