"""Readers that turn QA data sets into RAFT inputs: questions with oracle documents, plus a corpus.

Each reader returns a :class:`ReadResult`: a list of :class:`RaftQuestion` (question text, the ids
of its oracle documents, the answer, and what is known about where the evidence sits) and a dict
``doc_id -> RaftDoc`` holding every oracle document and any extra documents (distractor material).

* ``pubmedqa`` (``../shared/data/pubmedqa/pubmedqa_dev.jsonl``, read by :mod:`judgeloop.data.pubmedqa`): the
  abstract's contexts are the oracle, the answer is yes/no/maybe and the long answer (the abstract's
  conclusion) is kept for the reasoning.
* ``squad`` (``../shared/data/squad2_sample``): the paragraph is the oracle, the answer is the first gold
  span, whose first occurrence in the paragraph is the evidence; unanswerable questions are skipped
  (they have no oracle) and counted.
* ``scifact`` (BEIR layout): the claim is the question, the evidence abstracts (qrels) are the oracles;
  the whole corpus is distractor material. BEIR SciFact carries no support/refute label, so the
  answer is the title of the first evidence abstract (the task becomes "find and cite the evidence").
* ``jsonl``: one question per line with ``id, question, oracle`` (a string or a list of strings),
  ``answer`` and optionally ``long_answer`` and ``topic``; field names are mapped with ``data.fields``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from judgeloop.config import bounded, check_fields
from judgeloop.data import pubmedqa
from judgeloop.io import DataError, first_of_each_id, read_jsonl
from judgeloop.text import text_key

AnswerKind = Literal["yes_no_maybe", "span", "title", "free"]


@dataclass
class RaftDoc:
    """A document of the RAFT corpus (oracle or distractor material)."""

    id: str
    text: str
    title: str = ""
    topic: str | None = None


@dataclass
class RaftQuestion:
    """A question, its oracle document ids (first = primary) and its answer.

    ``evidence`` is the character span of the answer evidence in the primary oracle document when
    the data set says where it is (SQuAD); otherwise ``None`` and the builder locates it.
    """

    id: str
    question: str
    oracle_ids: list[str]
    answer: str
    kind: AnswerKind
    long_answer: str | None = None
    topic: str | None = None
    evidence: tuple[int, int] | None = None
    meta: dict[str, str] = field(default_factory=dict)


@dataclass
class ReadResult:
    """What a reader returns: questions, the corpus, and the counts of skipped questions (a reader starts
    from an empty one with its skip reasons at 0 and fills it in)."""

    questions: list[RaftQuestion] = field(default_factory=list)
    corpus: dict[str, RaftDoc] = field(default_factory=dict)
    skipped: dict[str, int] = field(default_factory=dict)


def read_pubmedqa(path: str | Path) -> ReadResult:
    """PubMedQA rows as RAFT input (:func:`judgeloop.data.pubmedqa.read_pubmedqa`): the abstract is the
    oracle, the answer yes/no/maybe, the long answer the reasoning; a question with no abstract is skipped
    and counted (``empty_oracle``)."""
    res = ReadResult(skipped={"empty_oracle": 0})
    for item in pubmedqa.read_pubmedqa(path, require_long_answer=True):
        if not item.abstract:  # no abstract to ground the answer in: the question cannot be a RAFT example
            res.skipped["empty_oracle"] += 1
            continue
        doc_id = f"pubmed:{item.id}"
        res.corpus[doc_id] = RaftDoc(id=doc_id, text=item.abstract)
        res.questions.append(
            RaftQuestion(
                id=item.id,
                question=item.question,
                oracle_ids=[doc_id],
                answer=item.decision,
                kind="yes_no_maybe",
                long_answer=item.long_answer,
            )
        )
    return res


def read_squad(path: str | Path) -> ReadResult:
    """SQuAD rows as RAFT input: the paragraph is the oracle, the first gold span the answer."""
    rows = read_jsonl(
        path,
        required=["id", "title", "paragraph_index", "context", "question", "answers"],
        kinds={
            "id": "id",
            "title": "text",
            "paragraph_index": "id",
            "context": "text",
            "question": "text",
            "answers": "spans",
            "is_impossible": "bool",
        },
    )
    res = ReadResult(skipped={"unanswerable": 0, "answer_not_in_context": 0, "empty_oracle": 0})
    for row in _unique_rows(rows, "id", "question", path):
        if not row["context"].strip():
            res.skipped["empty_oracle"] += 1
            continue
        doc_id = f"{row['title']}#p{row['paragraph_index']}"
        res.corpus.setdefault(
            doc_id,
            RaftDoc(id=doc_id, text=str(row["context"]), title=str(row["title"]), topic=str(row["title"])),
        )
        answers = [a["text"] if isinstance(a, Mapping) else a for a in row["answers"]]
        if row.get("is_impossible") or not answers:
            res.skipped["unanswerable"] += 1
            continue
        start = str(row["context"]).find(answers[0])
        if start < 0:
            res.skipped["answer_not_in_context"] += 1
            continue
        res.questions.append(
            RaftQuestion(
                id=str(row["id"]),
                question=str(row["question"]).strip(),
                oracle_ids=[doc_id],
                answer=answers[0],
                kind="span",
                topic=str(row["title"]),
                evidence=(start, start + len(answers[0])),
                meta={"all_answers": json.dumps(answers)},
            )
        )
    return res


def read_scifact(path: str | Path, split: str = "train") -> ReadResult:
    """BEIR SciFact as RAFT input: claims with their evidence abstracts as oracles."""
    root = Path(path)
    kinds = {"_id": "id", "text": "text", "title": "text"}
    corpus_rows = read_jsonl(root / "corpus.jsonl", required=["_id", "text"], kinds=kinds)
    query_rows = read_jsonl(root / f"queries_{split}.jsonl", required=["_id", "text"], kinds=kinds)
    qrels_path = root / f"qrels_{split}.tsv"
    if not qrels_path.is_file():
        raise DataError(f"SciFact qrels '{qrels_path}' does not exist; data.path must be the BEIR folder")
    corpus = {
        str(r["_id"]): RaftDoc(id=str(r["_id"]), text=str(r["text"]), title=str(r.get("title", "")))
        for r in corpus_rows
    }
    from judgeloop.retrieval.beir import load_qrels

    positives = {
        q: [d for d, grade in docs.items() if grade > 0] for q, docs in load_qrels(qrels_path).items()
    }
    res = ReadResult(corpus=corpus, skipped={"no_evidence": 0, "empty_oracle": 0})
    for r in _unique_rows(query_rows, "_id", "text", root / f"queries_{split}.jsonl"):
        qid = str(r["_id"])
        oracle = [d for d in positives.get(qid, []) if d in corpus]
        if not oracle:
            res.skipped["no_evidence"] += 1
            continue
        oracle = [d for d in oracle if corpus[d].text.strip()]
        if not oracle:
            res.skipped["empty_oracle"] += 1
            continue
        title = corpus[oracle[0]].title or oracle[0]
        res.questions.append(
            RaftQuestion(
                id=qid, question=str(r["text"]).strip(), oracle_ids=oracle, answer=title, kind="title"
            )
        )
    return res


def read_generic_jsonl(path: str | Path, fields: Mapping[str, str]) -> ReadResult:
    """Generic JSONL: ``fields`` maps our names (id, question, oracle, answer, long_answer, topic) to yours."""
    names = {k: fields.get(k, k) for k in ("id", "question", "oracle", "answer", "long_answer", "topic")}
    rows = read_jsonl(
        path,
        required=[names["id"], names["question"], names["oracle"], names["answer"]],
        kinds={
            names["id"]: "id",
            names["question"]: "text",
            names["oracle"]: "texts",
            names["answer"]: "text",
            names["long_answer"]: "text",
            names["topic"]: "text",
        },
    )
    res = ReadResult()
    for row in _unique_rows(rows, names["id"], names["question"], path):
        qid = str(row[names["id"]])
        oracles = row[names["oracle"]]
        oracles = [o for o in ([oracles] if isinstance(oracles, str) else oracles) if o.strip()]
        if not oracles:
            raise DataError(
                f"{path}: id {qid}: field '{names['oracle']}' is empty; every question needs an oracle "
                "document (drop the row or fill the field)"
            )
        topic = row.get(names["topic"])
        ids = []
        for i, text in enumerate(oracles):
            doc_id = f"{qid}:oracle{i}"
            res.corpus[doc_id] = RaftDoc(
                id=doc_id, text=str(text), topic=None if topic is None else str(topic)
            )
            ids.append(doc_id)
        answer = str(row[names["answer"]]).strip()
        long_answer = row.get(names["long_answer"])
        kind: AnswerKind = "yes_no_maybe" if answer.lower() in ("yes", "no", "maybe") else "free"
        res.questions.append(
            RaftQuestion(
                id=qid,
                question=str(row[names["question"]]).strip(),
                oracle_ids=ids,
                answer=answer.lower() if kind == "yes_no_maybe" else answer,
                kind=kind,
                long_answer=None if long_answer is None else str(long_answer),
                topic=None if topic is None else str(topic),
            )
        )
    return res


def read_corpus_jsonl(path: str | Path) -> dict[str, RaftDoc]:
    """Extra distractor documents: JSONL with ``id`` (or ``_id``) and ``text`` (optional ``title``, ``topic``)."""
    rows = read_jsonl(path, kinds={"id": "id", "_id": "id", "text": "text", "title": "text", "topic": "text"})
    out: dict[str, RaftDoc] = {}
    for lineno, r in enumerate(rows, start=1):
        doc_id = r.get("id", r.get("_id"))
        if doc_id is None or "text" not in r:
            raise DataError(f"{path}:{lineno}: corpus rows need 'id' (or '_id') and 'text'; got {sorted(r)}")
        if str(doc_id) in out and out[str(doc_id)].text != r["text"]:
            raise DataError(
                f"{path}:{lineno}: document id '{doc_id}' appears again with different text; "
                "corpus ids must be unique"
            )
        topic = r.get("topic")
        out[str(doc_id)] = RaftDoc(
            id=str(doc_id),
            text=str(r["text"]),
            title=str(r.get("title", "")),
            topic=None if topic is None else str(topic),
        )
    return out


def _unique_rows(rows: list[dict], id_key: str, text_key: str, path: str | Path) -> list[dict]:
    """First row of each id; a repeated id with a different question is named in a warning."""
    return first_of_each_id(rows, lambda r: str(r[id_key]), lambda r: r[text_key], str(path))


@dataclass
class RaftDataConfig:
    """Input questions. ``format``: ``pubmedqa``, ``squad``, ``scifact`` (BEIR folder) or ``jsonl``.

    ``fields`` maps the generic JSONL's names (id, question, oracle, answer, long_answer, topic);
    ``corpus_path`` adds extra distractor documents (JSONL with id, text); ``max_questions`` keeps the
    first N questions after de-duplication; ``max_corpus_docs`` caps the extra (non-oracle) documents.
    """

    format: Literal["pubmedqa", "squad", "scifact", "jsonl"] = "pubmedqa"
    path: str | None = None
    fields: dict[str, str] = field(default_factory=dict)
    corpus_path: str | None = None
    scifact_split: str = "train"
    max_questions: int | None = bounded(None, ge=2, hint=" (or null for all)", shape="section")
    max_corpus_docs: int | None = bounded(None, ge=0, hint=" (or null for all)", shape="section")

    def __post_init__(self) -> None:
        check_fields("data", self)
        if not self.path:
            raise ValueError(f"data.path is not set for data.format={self.format}; pass data.path=PATH")


def read_questions(cfg: RaftDataConfig) -> tuple[ReadResult, dict[str, int]]:
    """Read questions and corpus; remove duplicate questions (same normalized text, first kept).

    Returns:
        The read result and counts (``duplicates_removed``, ``read``, ``skipped_*``).
    """
    assert cfg.path is not None
    if cfg.format == "pubmedqa":
        res = read_pubmedqa(cfg.path)
    elif cfg.format == "squad":
        res = read_squad(cfg.path)
    elif cfg.format == "scifact":
        res = read_scifact(cfg.path, cfg.scifact_split)
    else:
        res = read_generic_jsonl(cfg.path, cfg.fields)
    if cfg.corpus_path:
        for doc_id, doc in read_corpus_jsonl(cfg.corpus_path).items():
            res.corpus.setdefault(doc_id, doc)
    counts = {"read": len(res.questions), **{f"skipped_{k}": v for k, v in res.skipped.items()}}
    seen: set[str] = set()
    seen_ids: set[str] = set()
    kept: list[RaftQuestion] = []
    for q in res.questions:
        key = text_key(q.question)
        if key in seen or q.id in seen_ids:
            continue
        seen.add(key)
        seen_ids.add(q.id)
        kept.append(q)
    counts["duplicates_removed"] = len(res.questions) - len(kept)
    if cfg.max_questions is not None:
        kept = kept[: cfg.max_questions]
    oracle_docs = {d for q in kept for d in q.oracle_ids}
    extra = sorted(d for d in res.corpus if d not in oracle_docs)
    if cfg.max_corpus_docs is not None:
        extra = extra[: cfg.max_corpus_docs]
    corpus = {d: res.corpus[d] for d in sorted(oracle_docs | set(extra))}
    counts["questions"] = len(kept)
    counts["corpus_docs"] = len(corpus)
    return ReadResult(kept, corpus, res.skipped), counts
