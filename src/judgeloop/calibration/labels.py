"""Ground-truth labels for preference pairs and candidate pairs to label (their style features: ``features.py``).

* ``rouge`` labels (a neutral proxy): y = 1 if ROUGE-L F1 of ``a`` against the neutral references
  beats ``b``'s; exact ties are dropped and counted.
* ``human`` labels: candidates' mean ratings on one dimension (e.g. SummEval ``expert_relevance``);
  pairs whose ratings differ by no more than ``min_gap`` are dropped and counted.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from judgeloop.config import bounded, check_fields
from judgeloop.data.summarization import Candidate, SummExample, split_sentences
from judgeloop.metrics.text import rouge_max


@dataclass
class LabelConfig:
    """How pairs get their ground-truth label."""

    type: Literal["rouge", "human"] = "rouge"
    dimension: str = "expert_relevance"
    min_gap: float = bounded(0.0, ge=0, message="{key} must be >= 0, got {value}")

    def __post_init__(self) -> None:
        check_fields("labels", self)


@dataclass
class LabeledPair:
    """Two candidate summaries of one article with a 0/1 label (1 = ``a`` is better)."""

    article_id: str
    article: str
    a: str
    b: str
    label: int
    references: tuple[str, ...] = ()
    meta: dict[str, object] = field(default_factory=dict)
    extractive: tuple[str, ...] = ()


@dataclass
class LabelStats:
    """What labeling kept and dropped (ties, unrated pairs) on one split."""

    pairs_considered: int = 0
    ties_dropped: int = 0
    unrated_dropped: int = 0

    def as_dict(self) -> dict[str, int]:
        return {
            "pairs_considered": self.pairs_considered,
            "ties_dropped": self.ties_dropped,
            "unrated_dropped": self.unrated_dropped,
        }


def rouge_label(a: str, b: str, references: Sequence[str]) -> int | None:
    """1 if ``a`` has the higher ROUGE-L F1 against the references, 0 if ``b``; None on a tie."""
    ra = rouge_max(a, references)["rougeL"]
    rb = rouge_max(b, references)["rougeL"]
    if math.isclose(ra, rb, abs_tol=1e-12):
        return None
    return int(ra > rb)


def synthetic_candidates(
    ex: SummExample, others: Sequence[SummExample], rng: random.Random
) -> list[Candidate]:
    """Candidate summaries of varied quality for an example that has none of its own.

    Leads of 1-3 sentences, a single random sentence, the last sentence, a truncated reference and a
    reference with one number swapped in from another article (a hallucination). The untouched
    reference is never a candidate, so labels against it are not trivial.
    """
    sents = split_sentences(ex.article)
    cands = [Candidate(" ".join(sents[:k]), f"lead{k}") for k in (1, 2, 3) if len(sents) >= k]
    if len(sents) > 2:
        cands.append(Candidate(sents[rng.randrange(1, len(sents))], "random_sentence"))
        cands.append(Candidate(sents[-1], "last_sentence"))
    for ref in ex.neutral[:1]:
        words = ref.split()
        if len(words) > 6:
            cands.append(Candidate(" ".join(words[: max(3, len(words) // 2)]), "truncated_reference"))
        if others:
            donor = rng.choice(others)
            donor_words = [w for w in " ".join(donor.neutral[:1]).split() if w != ex.id]
            if donor_words and len(words) > 3:
                mutated = list(words)
                pos = rng.randrange(len(mutated))
                mutated[pos] = rng.choice(donor_words)
                cands.append(Candidate(" ".join(mutated), "corrupted_reference"))
    unique: dict[str, Candidate] = {}
    for c in cands:
        if c.text.strip() and c.text not in unique and c.text not in ex.neutral:
            unique[c.text] = c
    return list(unique.values())


def build_labeled_pairs(
    examples: Sequence[SummExample],
    cfg: LabelConfig,
    seed: int = 0,
    max_pairs_per_article: int | None = None,
) -> tuple[list[LabeledPair], LabelStats]:
    """All labeled candidate pairs of ``examples``, each in one random orientation.

    Examples with their own candidates (SummEval) use them; others get :func:`synthetic_candidates`.
    """
    rng = random.Random(seed)
    stats = LabelStats()
    out: list[LabeledPair] = []
    for ex in examples:
        cands = ex.candidates or synthetic_candidates(ex, examples, rng)
        combos = list(itertools.combinations(range(len(cands)), 2))
        rng.shuffle(combos)
        kept = 0
        for i, j in combos:
            if max_pairs_per_article is not None and kept >= max_pairs_per_article:
                break
            if rng.random() < 0.5:
                i, j = j, i
            a, b = cands[i], cands[j]
            stats.pairs_considered += 1
            label: int | None
            if cfg.type == "human":
                if cfg.dimension not in a.ratings or cfg.dimension not in b.ratings:
                    stats.unrated_dropped += 1
                    continue
                gap = a.ratings[cfg.dimension] - b.ratings[cfg.dimension]
                label = None if abs(gap) <= cfg.min_gap else int(gap > 0)
            else:
                if not ex.neutral:
                    stats.unrated_dropped += 1
                    continue
                label = rouge_label(a.text, b.text, ex.neutral)
            if label is None:
                stats.ties_dropped += 1
                continue
            out.append(
                LabeledPair(
                    ex.id,
                    ex.article,
                    a.text,
                    b.text,
                    label,
                    tuple(ex.neutral),
                    {"system_a": a.system, "system_b": b.system},
                    tuple(ex.extractive),
                )
            )
            kept += 1
    return out, stats
