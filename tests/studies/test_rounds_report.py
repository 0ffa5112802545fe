"""The ablation's per-round table under mode: rounds (judgeloop.studies.rounds_report): means and paired
differences per round, from hand-written per-article rows, and their section of results.md."""

from __future__ import annotations

import json

import pytest

from judgeloop.config import load_config
from judgeloop.studies.ablation_config import AblateConfig
from judgeloop.studies.rounds_report import rounds_lines, rounds_results


def _write(folder, rows):
    folder.mkdir(parents=True)
    (folder / "per_article.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def _row(step, i, r1n, r1e, copy):
    return {"step": step, "id": i, "rouge_1_neutral": r1n, "rouge_1_extractive": r1e, "copy_rate": copy}


def test_each_round_has_each_arms_means_and_the_paired_difference_from_the_baseline(tmp_path):
    cfg = load_config(
        AblateConfig,
        None,
        ["mode=rounds", f"output_dir={tmp_path}", "ablation.arms=[raw,platt]", "ablation.seeds=[0]"],
    )
    # round 0 is the shared start; in round 1 raw copies more, platt writes closer to the neutral reference
    start = [_row(0, "a", 0.2, 0.3, 0.1), _row(0, "b", 0.4, 0.5, 0.2)]
    _write(tmp_path / "raw" / "seed0", start + [_row(1, "a", 0.2, 0.6, 0.5), _row(1, "b", 0.4, 0.8, 0.6)])
    _write(tmp_path / "platt" / "seed0", start + [_row(1, "a", 0.3, 0.4, 0.2), _row(1, "b", 0.5, 0.4, 0.2)])
    res = rounds_results(cfg)
    assert res["rounds"] == [0, 1]
    raw1, platt1 = res["arms"]["raw"]["1"], res["arms"]["platt"]["1"]
    assert raw1["rouge_1_extractive"]["delta"] == pytest.approx(0.7)
    assert platt1["rouge_1_neutral"]["delta"] == pytest.approx(0.4)
    diff = res["vs_baseline"]["platt"]["1"]
    assert diff["rouge_1_neutral"]["delta"] == pytest.approx(
        0.1
    )  # both articles +0.1: the interval is a point
    assert diff["rouge_1_neutral"]["ci95"] == pytest.approx([0.1, 0.1])
    assert diff["rouge_1_extractive"]["delta"] == pytest.approx(-0.3)  # -0.2 and -0.4
    assert res["vs_baseline"]["platt"]["0"]["copy_rate"]["delta"] == pytest.approx(0.0)
    text = "\n".join(rounds_lines(res))
    assert "| 1 | raw | 0.300 [0.200, 0.400] | 0.700 [0.600, 0.800] | 0.550 [0.500, 0.600] |" in text
    assert "**platt - raw**, paired:" in text
    assert (
        "raw extractive 0.32 -> 0.48, neutral 0.35 -> 0.37; calibrated extractive 0.38, neutral 0.42" in text
    )
