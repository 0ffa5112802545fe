"""Text helpers shared across components."""

from __future__ import annotations

import math
from typing import Any

# Function words that carry no topic: the base of the stop lists the RAFT builder (quote selection)
# and the weak-retrieval gate (query-term coverage) each extend for their own texts.
STOPWORDS = frozenset(
    [
        "a",
        "an",
        "and",
        "are",
        "as",
        "at",
        "be",
        "by",
        "for",
        "from",
        "has",
        "have",
        "in",
        "is",
        "it",
        "its",
        "not",
        "of",
        "on",
        "or",
        "than",
        "that",
        "the",
        "their",
        "these",
        "this",
        "those",
        "to",
        "was",
        "were",
        "which",
        "with",
    ]
)


def text_key(text: str) -> str:
    """A text up to case and white space: the key that finds duplicate questions, queries or articles and
    text that leaks from one split into another."""
    return " ".join(text.split()).lower()


def fmt_number(x: Any, nd: int = 3, none: str = "n/a") -> str:
    """A report cell: floats with ``nd`` decimals, NaN as ``n/a``, infinities as ``inf`` / ``-inf``,
    ``None`` as ``none`` (``"inf"`` where None stands for an infinite threshold), anything else as text."""
    if x is None:
        return none
    if isinstance(x, float):
        if math.isnan(x):
            return "n/a"
        if math.isinf(x):
            return "inf" if x > 0 else "-inf"
        return f"{x:.{nd}f}"
    return str(x)
