"""SQuAD answer scoring: normalized exact match and token F1, max over the gold answers.

Normalization follows the official SQuAD v2.0 evaluation script (Rajpurkar et al. 2018): lower-case,
drop punctuation and the articles a/an/the, collapse whitespace. For unanswerable questions the gold
answer is the empty string, so only an empty prediction scores 1.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Sequence

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = set(string.punctuation)


def normalize_answer(text: str) -> str:
    """SQuAD answer normalization: lower case, no punctuation, articles or extra spaces."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCT)
    return " ".join(_ARTICLES.sub(" ", text).split())


def _f1(pred: str, gold: str) -> float:
    p, g = normalize_answer(pred).split(), normalize_answer(gold).split()
    if not p or not g:
        return float(p == g)
    common = sum((Counter(p) & Counter(g)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(p), common / len(g)
    return 2 * precision * recall / (precision + recall)


def exact_match(pred: str, golds: str | Sequence[str]) -> float:
    """1.0 if ``pred`` equals any gold answer after normalization (empty ``golds`` = unanswerable)."""
    golds = _golds(golds)
    return float(max(normalize_answer(pred) == normalize_answer(g) for g in golds))


def _golds(golds: str | Sequence[str]) -> list[str]:
    return [golds] if isinstance(golds, str) else (list(golds) or [""])


def token_f1(pred: str, golds: str | Sequence[str]) -> float:
    """Bag-of-tokens F1 against the best-matching gold answer (one string or several)."""
    golds = _golds(golds)
    return max(_f1(pred, g) for g in golds)
