"""The loop's metrics, one row each: what a metric is called, what it means, how an evaluation averages
it over the articles, and in which outputs it appears (and where in each).

Every list of metrics in the evaluation (:mod:`judgeloop.loop.evaluation`), the validation curve
(:mod:`judgeloop.loop.curve`), the model card (:mod:`judgeloop.loop.model_card`) and the ablation's report
(:mod:`judgeloop.studies.ablation_report`, :mod:`judgeloop.studies.stats`) is read from :data:`METRICS`
with :func:`keys`, so a new metric is one row here (and its per-article computation, for a text metric
:func:`judgeloop.loop.evaluation.text_metrics`).

The rows are in the order of an evaluation's means (``report.json``'s ``history`` and ``final``, the
trackers' ``eval/*``). The other outputs order their metrics as they always have, which is not one order
(the ablation's ``final`` leads with the task's target, an evaluation with ROUGE-1): each output is a
column holding the metric's position in it, 0 where the output does not show it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from judgeloop.judges.hacking import HACK_KINDS

#: how an evaluation averages a metric over its articles (:func:`judgeloop.loop.evaluation.evaluation_metrics`)
AGGREGATES = {
    "nanmean": "mean of the articles' finite values (NaN when none is finite)",
    "mean": "mean over the articles (a detector's 0/1 flag: the share it flags; NaN with no article)",
    "judged": "mean over the judged articles (a failed judgement, None, is left out, never a loss)",
    "failures": "the number of articles whose judgement failed (per-article value None)",
    "pairs": "the calibrator's ECE on the evaluation's (greedy, sampled) pairs labeled by neutral ROUGE-L",
    "pair_count": "the number of those pairs",
    "": "not in an evaluation's means",
}

#: the outputs that show metrics, each a position column of :class:`Metric`
OUTPUTS = {
    "validation": "an evaluation's ``val_*`` means over the validation articles (early stopping reads one)",
    "curve": "a validation curve point's per-article values and means (``curve.md``, ``curve/*``)",
    "gain": "a validation curve point's paired gains from step 0 (``KEY_gain``)",
    "card": "the exported policy's model card (``policy/README.md``), with a bootstrap interval each",
    "final": "the ablation's per-arm final metrics (``results.json``); the per-article ones are paired",
    "table": "the columns of the ablation's table of absolute values (``results.md``)",
    "delta": "the columns of the ablation's tables of paired differences (``results.md``)",
    "curves": "the ablation's per-step curves of each run (``results.json`` ``curves``)",
    "figure": "the panels of the ablation's figures (``curves.png``, ``deltas.png``)",
    "legend": "the glossary under the ablation's table of absolute values (``results.md``)",
    "premise": "the premise check: the baseline arm's change from step 0 (``results.json``, ``results.md``)",
    "rounds": "the rounds table of ``mode: rounds`` (the run's ``rounds.md`` and ``report.json`` ``rounds``, "
    "the ablation's ``results.md``): per round, with intervals",
}


@dataclass(frozen=True)
class Metric:
    """One metric of the loop.

    ``name``: its key among an evaluation's means (``report.json`` ``history`` / ``final``, the ablation's
    ``final``). ``per_article``: its key in a per-article row (``per_article.jsonl``, the curve's rows), or
    "" for a metric of the whole evaluation (ECE). ``label``: what it is, in words (the model card's line).
    ``title``: its figures' panel title. ``gloss``: what it tells, for the report's glossary (metrics with
    the same gloss side by side share one entry). ``style_word``: what a drift in it means, for the premise
    sentence. ``aggregate``: a key of :data:`AGGREGATES`. The remaining fields are the columns of
    :data:`OUTPUTS`: the metric's position (from 1) in that output, 0 where it is not shown.
    """

    name: str
    per_article: str
    label: str
    aggregate: str
    title: str = ""
    gloss: str = ""
    style_word: str = ""
    validation: int = 0
    curve: int = 0
    gain: int = 0
    card: int = 0
    final: int = 0
    table: int = 0
    delta: int = 0
    curves: int = 0
    figure: int = 0
    legend: int = 0
    premise: int = 0
    rounds: int = 0


def _text(name: str, label: str, **columns: Any) -> Metric:
    """A per-article text metric of the greedy summary, averaged over its finite values."""
    return Metric(name, name, label, "nanmean", **columns)


_NEUTRAL = "against the neutral references"

#: the task's real target: the premise check's last metric (every other is a style a judge may reward),
#: the ablation's recovered fraction
TARGET = "rouge_l_neutral"

METRICS: tuple[Metric, ...] = (
    _text("rouge_1_neutral", f"ROUGE-1 {_NEUTRAL}", title="neutral ROUGE-1", card=2, final=2, rounds=1),
    _text("rouge_2_neutral", f"ROUGE-2 {_NEUTRAL}", final=3),
    _text(
        "rouge_l_neutral",
        f"ROUGE-L {_NEUTRAL}",
        title="neutral ROUGE-L (task target)",
        gloss="the task's real target",
        style_word="the neutral references",
        validation=1,
        curve=1,
        gain=1,
        card=1,
        final=1,
        table=1,
        delta=1,
        curves=1,
        figure=1,
        legend=1,
        premise=5,
    ),
    _text(
        "rouge_l_extractive",
        "ROUGE-L against the extractive references (the judge's style)",
        title="extractive ROUGE-L (judge's style)",
        gloss="the judge's style",
        style_word="the extractive references",
        validation=2,
        curve=2,
        card=3,
        final=4,
        table=2,
        delta=2,
        curves=2,
        figure=2,
        legend=2,
        premise=2,
    ),
    _text(
        "rouge_1_extractive",
        "ROUGE-1 against the extractive references (the article's lead: the account's extractive score)",
        title="extractive ROUGE-1",
        rounds=2,
    ),
    _text(
        "copy_rate",
        "copy rate (3-grams copied from the article)",
        title="copy rate",
        gloss="the judge's style",
        style_word="copying",
        validation=3,
        curve=3,
        card=4,
        final=5,
        table=3,
        delta=3,
        curves=3,
        figure=3,
        legend=3,
        premise=1,
        rounds=3,
    ),
    _text(
        "novel_bigram_rate",
        "novel bigram rate (bigrams not in the article)",
        style_word="novel wording",
        final=6,
        delta=4,
        premise=4,
    ),
    _text(
        "length",
        "length in words",
        style_word="longer summaries",
        validation=4,
        curve=4,
        card=5,
        final=7,
        table=4,
        delta=5,
        premise=3,
    ),
    Metric(
        "sampled_rouge_l_neutral",
        "sampled_rouge_l_neutral",
        f"ROUGE-L of one sampled summary {_NEUTRAL}",
        "",
        curve=5,
        gain=2,
    ),
    _text(
        "kl",
        "KL(pi || pi_ref), k1 on one sample",
        title="KL(pi || pi_ref)",
        gloss="KL(pi || pi_ref) per summary",
        curve=6,
        card=7,
        final=8,
        table=5,
        curves=4,
        legend=4,
    ),
    *(
        Metric(f"hack_{kind}_rate", f"hack_{kind}", f"share of summaries the {kind} detector flags", "mean")
        for kind in HACK_KINDS
    ),
    Metric("hack_any_rate", "hack_any", "share of summaries any reward-hacking detector flags", "mean"),
    Metric(
        "win_rate",
        "win",
        "judge's win rate against the reference policy",
        "judged",
        gloss="the judge's preference for the policy over the reference policy",
        card=6,
        final=9,
        table=6,
        delta=6,
        curves=6,
        legend=5,
    ),
    Metric("judge_failures", "win", "judgements of the policy's summary that failed", "failures"),
    Metric(
        "ece",
        "",
        "the calibrator's ECE on (greedy, sampled) pairs labeled by neutral ROUGE-L",
        "pairs",
        gloss="the arm's calibrator on fresh (greedy, sampled) pairs",
        final=10,
        table=7,
        curves=5,
        legend=6,
    ),
    Metric("ece_pairs", "", "the number of pairs ECE was measured on", "pair_count"),
)


def shown_in(output: str) -> tuple[Metric, ...]:
    """The metrics ``output`` (a key of :data:`OUTPUTS`) shows, in its order."""
    if output not in OUTPUTS:
        raise ValueError(
            f"output={output!r} is not an output of the metrics table; choose from {list(OUTPUTS)}"
        )
    return tuple(sorted((m for m in METRICS if getattr(m, output)), key=lambda m: getattr(m, output)))


def keys(output: str, per_article: bool = False) -> tuple[str, ...]:
    """The names (``per_article``: the per-article keys) of the metrics ``output`` shows, in its order."""
    return tuple(m.per_article if per_article else m.name for m in shown_in(output))


def evaluated() -> tuple[Metric, ...]:
    """The metrics of an evaluation's means, in their order."""
    return tuple(m for m in METRICS if m.aggregate)


def metric(name: str) -> Metric:
    """The row of the metric called ``name``."""
    found = [m for m in METRICS if m.name == name]
    if not found:
        raise ValueError(f"no metric {name!r} in the metrics table; choose from {[m.name for m in METRICS]}")
    return found[0]
