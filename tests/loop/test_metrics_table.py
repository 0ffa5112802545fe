"""The metrics table (loop/metrics_table.py): every output's list read from it, in the order each output
has always had, and an evaluation's means computed as each row's aggregate says."""

from __future__ import annotations

import math

import numpy as np
import pytest

from judgeloop.data import SummExample
from judgeloop.judges.hacking import HACK_KINDS
from judgeloop.loop.evaluation import aggregate_metric, text_metrics
from judgeloop.loop.metrics_table import AGGREGATES, METRICS, OUTPUTS, evaluated, keys, metric, shown_in


@pytest.mark.parametrize("output", OUTPUTS)
def test_each_output_numbers_its_metrics_one_to_n(output):
    positions = sorted(getattr(m, output) for m in METRICS if getattr(m, output))
    assert positions == list(range(1, len(positions) + 1)), (output, positions)


def test_names_are_unique_and_every_aggregate_is_described():
    names = [m.name for m in METRICS]
    assert len(names) == len(set(names))
    assert {m.aggregate for m in METRICS} <= set(AGGREGATES)
    with pytest.raises(ValueError, match="output='cards' is not an output"):
        keys("cards")
    with pytest.raises(ValueError, match="no metric 'rouge'"):
        metric("rouge")


def test_the_outputs_read_the_lists_they_always_had():
    """The lists as they were spelled before the table (issue 51), pinned: their order is in report.json,
    results.json, results.md and the model card."""
    from judgeloop.loop.curve import ROW_KEYS
    from judgeloop.loop.model_card import CARD_METRICS
    from judgeloop.studies import ablation_report as rep
    from judgeloop.studies.ablation_config import STYLE_METRICS
    from judgeloop.studies.stats import PREMISE_METRICS

    # rouge_1_extractive joined the evaluation's means with mode: rounds (issue 52), after rouge_l_extractive
    text = (
        "rouge_1_neutral",
        "rouge_2_neutral",
        "rouge_l_neutral",
        "rouge_l_extractive",
        "rouge_1_extractive",
        "copy_rate",
    )
    assert keys("rounds") == ("rouge_1_neutral", "rouge_1_extractive", "copy_rate")
    assert [m.name for m in evaluated()] == [
        *text,
        "novel_bigram_rate",
        "length",
        "kl",
        *(f"hack_{k}_rate" for k in (*HACK_KINDS, "any")),
        "win_rate",
        "judge_failures",
        "ece",
        "ece_pairs",
    ]
    assert keys("validation") == ("rouge_l_neutral", "rouge_l_extractive", "copy_rate", "length")
    assert ROW_KEYS == (
        "rouge_l_neutral",
        "rouge_l_extractive",
        "copy_rate",
        "length",
        "sampled_rouge_l_neutral",
        "kl",
    )
    assert [k for k, _ in CARD_METRICS] == [
        "rouge_l_neutral",
        "rouge_1_neutral",
        "rouge_l_extractive",
        "copy_rate",
        "length",
        "win",
        "kl",
    ]
    assert rep.FINAL_METRICS == (
        "rouge_l_neutral",
        "rouge_1_neutral",
        "rouge_2_neutral",
        "rouge_l_extractive",
        "copy_rate",
        "novel_bigram_rate",
        "length",
        "kl",
        "win_rate",
        "ece",
    )
    assert (*(m for m in rep.FINAL_METRICS if m not in ("win_rate", "ece")), "win") == rep.PAIRED_METRICS
    assert {**{m: m for m in rep.PAIRED_METRICS if m != "win"}, "win_rate": "win"} == rep.ARTICLE_KEY
    assert rep.TABLE_METRICS == (
        "rouge_l_neutral",
        "rouge_l_extractive",
        "copy_rate",
        "length",
        "kl",
        "win_rate",
        "ece",
    )
    assert rep.DELTA_TABLE == (
        "rouge_l_neutral",
        "rouge_l_extractive",
        "copy_rate",
        "novel_bigram_rate",
        "length",
        "win",
    )
    assert rep.CURVE_METRICS == (
        "rouge_l_neutral",
        "rouge_l_extractive",
        "copy_rate",
        "kl",
        "ece",
        "win_rate",
    )
    assert PREMISE_METRICS == (
        "copy_rate",
        "rouge_l_extractive",
        "length",
        "novel_bigram_rate",
        "rouge_l_neutral",
    )
    assert STYLE_METRICS == ("copy_rate", "rouge_l_extractive", "length", "novel_bigram_rate")
    assert rep.RECOVERED_METRIC == "rouge_l_neutral"
    assert rep.glossary() == (
        "rouge_l_neutral: the task's real target; rouge_l_extractive / copy_rate: the judge's style; "
        "kl: KL(pi || pi_ref) per summary; win: the judge's preference for the policy over the reference "
        "policy; ece: the arm's calibrator on fresh (greedy, sampled) pairs."
    )


def test_every_shown_metric_exists_where_its_output_reads_it():
    """The text metrics are text_metrics' keys; the ablation's figures plot curves it keeps; the curve's
    gains are of its own per-article values; the premise and the deltas compare per-article values."""
    ex = SummExample(
        "a", "The council approved the bridge on Monday.", {"neutral": ["A bridge."], "extractive": ["x"]}
    )
    computed = list(text_metrics(ex, "The council approved a bridge."))
    text_rows = [m.per_article for m in METRICS if m.per_article in computed]
    assert text_rows == computed  # the same keys, in text_metrics' order
    assert set(keys("figure")) <= set(keys("curves"))
    assert set(keys("gain", per_article=True)) <= set(keys("curve", per_article=True))
    assert all(m.per_article for m in (*shown_in("premise"), *shown_in("delta"), *shown_in("card")))
    assert all(m.title for m in shown_in("figure")) and all(m.gloss for m in shown_in("legend"))
    assert all(m.style_word for m in shown_in("premise"))


def test_each_aggregate_by_hand():
    rows = [
        {"rouge_l_neutral": 0.2, "hack_empty": 1.0, "win": 1.0},
        {"rouge_l_neutral": float("nan"), "hack_empty": 0.0, "win": None},
        {"rouge_l_neutral": 0.4, "hack_empty": 0.0, "win": 0.5},
    ]
    assert aggregate_metric(metric("rouge_l_neutral"), rows) == pytest.approx(0.3)  # NaN left out
    assert aggregate_metric(metric("hack_empty_rate"), rows) == pytest.approx(1 / 3)
    assert aggregate_metric(metric("win_rate"), rows) == pytest.approx(0.75)  # the failed one left out
    assert aggregate_metric(metric("judge_failures"), rows) == 1.0
    assert math.isnan(aggregate_metric(metric("rouge_l_neutral"), [{"rouge_l_neutral": np.nan}]))
    assert math.isnan(aggregate_metric(metric("hack_empty_rate"), []))
    assert math.isnan(aggregate_metric(metric("win_rate"), [{"win": None}]))
