"""A judge whose bias is a dial: any judge's logit plus ``style_weight * d(pair)``.

``d`` is an antisymmetric style feature of the pair (swapping a and b negates it):

* ``copy_rate``: copy-rate(a) - copy-rate(b) (3-grams copied from the article);
* ``log_length_ratio``: log(len a / len b) in words;
* ``novel_bigram``: novel-bigram-rate(a) - novel-bigram-rate(b) (a negative weight rewards copying).

So ``s'(a, b) = s(a, b) + w * d(a, b)`` and, with position debiasing, each order is shifted by its own
``d``, which keeps ``s'(a, b) = -s'(b, a)`` for a pointwise base judge. A positive weight on
``copy_rate`` is a judge that likes copying, with the strength of the bias a number in the config;
``style_weight: 0`` is the base judge unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from judgeloop.judges.base import Judge, JudgeOutput, JudgeStats, Pair
from judgeloop.metrics.text import copy_rate, novel_ngram_rate, tokens

STYLE_FEATURES = ("copy_rate", "log_length_ratio", "novel_bigram")


def style_feature(name: str, article: str, a: str, b: str) -> float:
    """The antisymmetric pair feature ``name`` (see the module docstring)."""
    if name == "copy_rate":
        return copy_rate(a, article) - copy_rate(b, article)
    if name == "log_length_ratio":
        return math.log(max(len(tokens(a)), 1) / max(len(tokens(b)), 1))
    if name == "novel_bigram":
        return novel_ngram_rate(a, article, 2) - novel_ngram_rate(b, article, 2)
    raise ValueError(f"style feature {name!r} is unknown; use one of {list(STYLE_FEATURES)}")


class StyledJudge(Judge):
    """Wraps ``base``: every valid score moves by exactly ``weight * style_feature(feature, pair)``."""

    def __init__(self, base: Judge, weight: float, feature: str = "copy_rate"):
        if feature not in STYLE_FEATURES:
            raise ValueError(f"judge.style_feature={feature!r}; use one of {list(STYLE_FEATURES)}")
        super().__init__(
            name=f"styled({base.name}, {feature} x {weight})",
            position_debias=base.position_debias,
            batch_size=base.batch_size,
            cache_size=0,
        )
        self.base = base
        self.weight = float(weight)
        self.feature = feature
        self.reference_style = getattr(base, "reference_style", "neutral")
        self.device = getattr(base, "device", "cpu")

    @property
    def stats(self) -> JudgeStats:  # type: ignore[override]
        return self.base.stats

    @stats.setter
    def stats(
        self, value: JudgeStats
    ) -> None:  # the base class sets it once; the base judge's counts are ours
        pass

    @property
    def can_prepare(self) -> bool:
        return self.base.can_prepare

    def prepare(self, articles: Sequence[str], references: Sequence[Sequence[str]] | None = None) -> None:
        self.base.prepare(articles, references)

    def style_terms(self, pairs: Sequence[Pair]) -> np.ndarray:
        return np.array(
            [self.weight * style_feature(self.feature, p.article, p.a, p.b) for p in pairs], dtype=float
        )

    def score(self, pairs: Sequence[Pair]) -> JudgeOutput:
        pairs = list(pairs)
        out = self.base.score(pairs)
        d = self.style_terms(pairs)
        scores = out.scores + d  # NaN (failed items) stays NaN
        forward = out.forward + d
        reverse = None if out.reverse is None else out.reverse - d  # d(b, a) = -d(a, b)
        return JudgeOutput(scores=scores, status=list(out.status), forward=forward, reverse=reverse)
