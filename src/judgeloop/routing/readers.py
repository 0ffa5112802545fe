"""QA readers: the SQuAD 2.0 sample and PubMedQA, as questions plus a pool of passages to retrieve from.

Both files live in ``../shared/data`` (see its README). A question's gold passage is kept in the pool
but never handed to the model directly: the router must retrieve it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from judgeloop.data import pubmedqa
from judgeloop.io import DataError, read_jsonl


@dataclass
class QAExample:
    """A question with its gold answers and gold passages."""

    id: str
    question: str
    answers: list[str]  # empty = unanswerable
    gold_passages: list[str] = field(default_factory=list)


def read_squad2(path: str | Path, answerable_only: bool = True) -> list[QAExample]:
    """SQuAD 2.0 rows ``{id, question, context, answers[], is_impossible}``.

    Args:
        answerable_only: drop unanswerable questions (their gold is the empty answer, which a
            generative model rarely produces; keep them to measure abstention).
    """
    rows = read_jsonl(
        path,
        required=["id", "question", "context", "answers", "is_impossible"],
        kinds={
            "id": "id",
            "question": "text",
            "context": "text",
            "answers": "strings",
            "is_impossible": "bool",
        },
    )
    out = []
    for r in rows:
        if answerable_only and r["is_impossible"]:
            continue
        answers = list(r["answers"]) if not r["is_impossible"] else []
        if not r["is_impossible"] and not answers:
            raise DataError(f"{path}: answerable question '{r['id']}' has no answers; fix the file")
        out.append(QAExample(str(r["id"]), str(r["question"]), answers, [str(r["context"])]))
    if not out:
        raise DataError(f"{path}: no questions left (answerable_only={answerable_only})")
    return out


def read_pubmedqa(path: str | Path) -> list[QAExample]:
    """PubMedQA rows (:func:`judgeloop.data.pubmedqa.read_pubmedqa`); the answer is yes / no / maybe.

    The passage pool is the union of all abstracts' context paragraphs (one passage per abstract,
    paragraphs joined), so retrieval has to find the right abstract among all questions' abstracts.
    """
    return [
        QAExample(item.id, item.question, [item.decision], [item.abstract])
        for item in pubmedqa.read_pubmedqa(path)
    ]


def passage_pool(examples: Sequence[QAExample]) -> list[str]:
    """Distinct gold passages of all examples, in first-seen order (the retrieval corpus)."""
    seen: dict[str, None] = {}
    for ex in examples:
        for p in ex.gold_passages:
            seen.setdefault(p, None)
    return list(seen)
