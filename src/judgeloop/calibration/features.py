"""The style features of a pair that the feature-aware calibrators read, built here and nowhere else.

Each feature is a difference "a minus b" (``FEATURE_NAMES``), so swapping the two summaries negates it
exactly; :func:`both_orientations` stacks a matrix with its swapped copy. Every caller (the loop's
calibration pairs, the calibrated judge, the panel, the probe, the calibration lab) takes its matrix
from :func:`feature_matrix` or :func:`features_for`, so the columns, their order and the dtype are the
same everywhere a calibrator is fitted or applied.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from judgeloop.metrics.text import copy_rate, tokens

FEATURE_NAMES = ("log_length_ratio", "copy_rate_diff")


class ReadsFeatures(Protocol):
    """A calibrator, as far as this module asks (``calibrators.py`` imports this module, not the reverse)."""

    uses_features: bool


class PairText(Protocol):
    """Anything with the article and the two summaries of a pair (a judge ``Pair``, a ``LabeledPair``)."""

    article: str
    a: str
    b: str


def pair_features(article: str, a: str, b: str) -> np.ndarray:
    """Antisymmetric style features of a pair: log(len a / len b) in words, copy-rate(a) - copy-rate(b)."""
    la, lb = max(len(tokens(a)), 1), max(len(tokens(b)), 1)
    # log(la) - log(lb), not log(la / lb): swapping a and b negates every feature exactly
    return np.array([math.log(la) - math.log(lb), copy_rate(a, article) - copy_rate(b, article)], dtype=float)


def feature_matrix(
    articles: Sequence[str], a: Sequence[str], b: Sequence[str], *, valid: Any = None
) -> np.ndarray:
    """The style features of each pair ``(articles[i], a[i], b[i])``: ``(N, F)`` float64, ``FEATURE_NAMES``
    columns.

    Args:
        valid: optional ``(N,)`` bool mask; a row whose pair is not valid (a failed judgement) is left at
            zero and not computed. Callers that want the valid rows only index the result with the mask.
    """
    out = np.zeros((len(articles), len(FEATURE_NAMES)))
    keep = np.ones(len(articles), dtype=bool) if valid is None else np.asarray(valid, dtype=bool)
    for i, (x, y, z) in enumerate(zip(articles, a, b)):
        if keep[i]:
            out[i] = pair_features(x, y, z)
    return out


def pair_feature_matrix(pairs: Sequence[PairText], *, valid: Any = None) -> np.ndarray:
    """:func:`feature_matrix` of pair objects (``.article``, ``.a``, ``.b``): ``(N, F)``."""
    return feature_matrix([p.article for p in pairs], [p.a for p in pairs], [p.b for p in pairs], valid=valid)


def features_for(
    calibrator: ReadsFeatures,
    articles: Sequence[str],
    a: Sequence[str],
    b: Sequence[str],
    *,
    valid: Any = None,
) -> np.ndarray | None:
    """The pair features ``calibrator`` reads (:func:`feature_matrix`), or None for one that reads none."""
    if not calibrator.uses_features:
        return None
    return feature_matrix(articles, a, b, valid=valid)


def both_orientations(features: np.ndarray) -> np.ndarray:
    """``(N, F)`` features of the pairs (a, b) -> ``(2N, F)``: those rows, then the rows of (b, a), negated."""
    return np.concatenate([features, -features])
