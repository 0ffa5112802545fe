"""Summary text metrics: ROUGE (rouge-score package), copy rate and novel n-grams, length."""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from typing import Any

_TOKEN_RE = re.compile(r"\w+", re.UNICODE)


@functools.lru_cache(maxsize=1)
def rouge_scorer() -> Any:
    """A ``rouge_score`` scorer for ROUGE-1/2/L with stemming."""
    from rouge_score import rouge_scorer as rs

    return rs.RougeScorer(["rouge1", "rouge2", "rougeL"], use_stemmer=True)


def rouge_max(candidate: str, references: Sequence[str]) -> dict[str, float]:
    """ROUGE-1/2/L F1 of ``candidate`` against the best-matching reference (per metric)."""
    if not references:
        raise ValueError("rouge_max needs at least one reference")
    scorer = rouge_scorer()
    scores = [scorer.score(ref, candidate) for ref in references]
    return {k: max(s[k].fmeasure for s in scores) for k in ("rouge1", "rouge2", "rougeL")}


def rouge_metric() -> Any:
    """The same ROUGE as a Hugging Face ``evaluate`` metric (``.compute(predictions=, references=)``),
    loaded offline from the module shipped in this package (``evaluate.load("rouge")`` needs the hub).

    The loop and the reports call :func:`rouge_max` directly: they need per-article scores, and
    ``evaluate`` costs about 10 s of imports per process; this is the interface for users who evaluate
    their own summaries with the library's ROUGE.
    """
    from pathlib import Path

    import evaluate

    return evaluate.load(str(Path(__file__).parent / "judgeloop_rouge"))


def tokens(text: str) -> list[str]:
    """Lower-cased word tokens of ``text`` (for copy and novel n-gram rates)."""
    return _TOKEN_RE.findall(text.lower())


def novel_ngram_rate(summary: str, article: str, n: int = 2) -> float:
    """Fraction of the summary's n-grams that do not occur in the article (0 = fully copied)."""
    s, a = tokens(summary), tokens(article)
    grams = [tuple(s[i : i + n]) for i in range(len(s) - n + 1)]
    if not grams:
        return 0.0
    source = {tuple(a[i : i + n]) for i in range(len(a) - n + 1)}
    return sum(g not in source for g in grams) / len(grams)


def copy_rate(summary: str, article: str, n: int = 3) -> float:
    """Fraction of the summary's n-grams copied from the article (1 - novel n-gram rate)."""
    if len(tokens(summary)) < n:
        return 0.0
    return 1.0 - novel_ngram_rate(summary, article, n)
