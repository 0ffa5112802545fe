"""Text helpers shared across components."""

from __future__ import annotations

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
