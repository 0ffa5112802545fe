"""PubMedQA-L rows ``{id, question, contexts[], final_decision, long_answer}`` (``../shared/data/pubmedqa``):
the one reader. The RAFT builder (:func:`judgeloop.raft.readers.read_pubmedqa`) and the routing study
(:func:`judgeloop.routing.readers.read_pubmedqa`) turn its items into their own examples.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from judgeloop.io import DataError, first_of_each_id, read_jsonl

DECISIONS = ("yes", "no", "maybe")


@dataclass
class PubMedQAItem:
    """One PubMedQA question with its abstract and answer."""

    id: str
    question: str  # stripped
    abstract: str  # the context paragraphs, each stripped, empty ones dropped, joined by a space ("" if none)
    decision: str  # yes / no / maybe
    long_answer: str | None = None  # the abstract's conclusion, stripped (None where the row has none)


def read_pubmedqa(path: str | Path, require_long_answer: bool = False) -> list[PubMedQAItem]:
    """The questions of a PubMedQA file, the first row of each id (a repeated id with another question is
    named in a warning).

    Args:
        require_long_answer: a row without ``long_answer`` is a :class:`DataError` (the RAFT targets
            quote it as the reasoning).

    Raises:
        DataError: a missing field, a field of the wrong type, or a ``final_decision`` that is not
            yes / no / maybe, naming the file (and the line or id).
    """
    required = ["id", "question", "contexts", "final_decision"]
    rows = read_jsonl(
        path,
        required=required + (["long_answer"] if require_long_answer else []),
        kinds={
            "id": "id",
            "question": "text",
            "contexts": "texts",
            "long_answer": "text",
            "final_decision": "text",
        },
    )
    items = []
    for row in first_of_each_id(rows, lambda r: str(r["id"]), lambda r: r["question"], str(path)):
        decision = str(row["final_decision"]).strip().lower()
        if decision not in DECISIONS:
            raise DataError(
                f"{path}: id {row['id']}: final_decision={row['final_decision']!r} is not yes/no/maybe; "
                "fix the file"
            )
        contexts = [row["contexts"]] if isinstance(row["contexts"], str) else row["contexts"]
        long_answer = row.get("long_answer")
        items.append(
            PubMedQAItem(
                id=str(row["id"]),
                question=str(row["question"]).strip(),
                abstract=" ".join(c.strip() for c in contexts if c.strip()),
                decision=decision,
                long_answer=None if long_answer is None else long_answer.strip(),
            )
        )
    return items
