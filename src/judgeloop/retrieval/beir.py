"""Retrieval data: BEIR-layout readers, (query, positive) pair JSONL, and leak-free query splits.

BEIR layout (Thakur et al. 2021, https://github.com/beir-cellar/beir): ``corpus.jsonl`` rows
``{_id, title, text}``, ``queries*.jsonl`` rows ``{_id, text}``, ``qrels*.tsv`` with a header and
columns ``query-id, corpus-id, score``. Everything is kept as plain dicts keyed by string ids so
other parts (miners, metrics, RAFT data builders, conformal retrieval) can share them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from judgeloop.data.splits import LeakageError, hash_unit
from judgeloop.io import DataError, read_jsonl, read_lines
from judgeloop.text import text_key

__all__ = [
    "BeirData",
    "LeakageError",
    "check_query_split",
    "doc_text",
    "load_beir",
    "load_pairs",
    "load_qrels",
    "split_queries",
]


@dataclass
class BeirData:
    """A retrieval data set.

    Attributes:
        corpus: doc id -> ``{"title": str, "text": str}``.
        queries: query id -> query text.
        qrels: query id -> {doc id: relevance grade}; grades <= 0 are kept but are not positives.
    """

    corpus: dict[str, dict[str, str]]
    queries: dict[str, str]
    qrels: dict[str, dict[str, int]] = field(default_factory=dict)

    def positives(self, min_grade: int = 1) -> dict[str, set[str]]:
        """query id -> set of doc ids with grade >= ``min_grade`` (only queries that have one)."""
        out: dict[str, set[str]] = {}
        for qid, docs in self.qrels.items():
            pos = {d for d, g in docs.items() if g >= min_grade}
            if pos:
                out[qid] = pos
        return out

    def subset(self, query_ids: Iterable[str]) -> BeirData:
        """The same corpus with only ``query_ids`` (and their qrels)."""
        ids = [q for q in query_ids]
        return BeirData(
            corpus=self.corpus,
            queries={q: self.queries[q] for q in ids},
            qrels={q: dict(self.qrels[q]) for q in ids if q in self.qrels},
        )


def doc_text(doc: Mapping[str, str], sep: str = " ") -> str:
    """The text encoded for a document: ``title + sep + text`` (title omitted when empty), as in BEIR."""
    title = (doc.get("title") or "").strip()
    text = doc.get("text") or ""
    return f"{title}{sep}{text}" if title else text


_BEIR_KINDS = {"_id": "id", "text": "text", "title": "text"}


def _read_corpus(path: str | Path) -> dict[str, dict[str, str]]:
    corpus: dict[str, dict[str, str]] = {}
    for i, row in enumerate(read_jsonl(path, required=["_id", "text"], kinds=_BEIR_KINDS), start=1):
        doc_id = str(row["_id"])
        if doc_id in corpus:
            raise DataError(f"{path}: duplicate corpus _id '{doc_id}' (row {i}); corpus ids must be unique")
        corpus[doc_id] = {"title": str(row.get("title") or ""), "text": str(row["text"])}
    return corpus


def _read_queries(path: str | Path) -> dict[str, str]:
    queries: dict[str, str] = {}
    for i, row in enumerate(read_jsonl(path, required=["_id", "text"], kinds=_BEIR_KINDS), start=1):
        qid = str(row["_id"])
        if qid in queries:
            raise DataError(f"{path}: duplicate query _id '{qid}' (row {i}); query ids must be unique")
        queries[qid] = str(row["text"])
    return queries


def load_qrels(path: str | Path) -> dict[str, dict[str, int]]:
    """Read a BEIR qrels TSV (header ``query-id corpus-id score``) into {query id: {doc id: grade}}."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"qrels file '{path}' does not exist; check data.*.qrels_path")
    qrels: dict[str, dict[str, int]] = {}
    for lineno, line in read_lines(path):
        row = line.rstrip("\r\n").split("\t")
        if not "".join(row).strip():
            continue
        if lineno == 1 and row[0].strip().lower() in ("query-id", "query_id", "qid"):
            continue
        if len(row) < 3:
            raise DataError(
                f"{path}:{lineno}: expected 3 tab-separated columns (query-id, corpus-id, score), got {row!r}"
            )
        try:
            grade = int(float(row[2]))
        except (ValueError, OverflowError):  # not a number, nan (ValueError) or inf (OverflowError)
            raise DataError(
                f"{path}:{lineno}: score {row[2]!r} is not a finite number; a qrels score is a relevance grade "
                "(e.g. 0, 1, 2)"
            ) from None
        qrels.setdefault(row[0].strip(), {})[row[1].strip()] = grade
    if not qrels:
        raise DataError(f"qrels file '{path}' holds no judgements")
    return qrels


def load_beir(corpus_path: str | Path, queries_path: str | Path, qrels_path: str | Path) -> BeirData:
    """Load a BEIR-layout data set and check that qrels point at known queries and documents.

    Queries without any qrels are dropped (they cannot be trained on or evaluated); qrels that name an
    unknown query or document raise :class:`DataError`.
    """
    corpus = _read_corpus(corpus_path)
    queries = _read_queries(queries_path)
    qrels = load_qrels(qrels_path)
    unknown_q = sorted(q for q in qrels if q not in queries)
    if unknown_q:
        raise DataError(
            f"{qrels_path}: {len(unknown_q)} query id(s) not in {queries_path} (e.g. '{unknown_q[0]}'); "
            "the qrels and queries files must come from the same split"
        )
    for qid, docs in qrels.items():
        for doc_id in docs:
            if doc_id not in corpus:
                raise DataError(
                    f"{qrels_path}: query '{qid}' judges doc '{doc_id}', which is not in {corpus_path}; "
                    "use the corpus the qrels were made for"
                )
    queries = {q: t for q, t in queries.items() if q in qrels}
    return BeirData(corpus=corpus, queries=queries, qrels=qrels)


def _stable_id(prefix: str, text: str) -> str:
    return prefix + hashlib.sha256(text.encode()).hexdigest()[:16]


def load_pairs(
    path: str | Path,
    query_field: str = "query",
    positive_field: str = "positive",
    title_field: str | None = None,
) -> BeirData:
    """Read plain (query, positive) pair JSONL as a :class:`BeirData`.

    Ids are derived from a hash of the text, so identical queries (or passages) share one id and a query
    with several positives gets several qrels. The corpus is the set of distinct positive passages.
    """
    kinds = {query_field: "text", positive_field: "text", **({title_field: "text"} if title_field else {})}
    rows = read_jsonl(path, required=[query_field, positive_field], kinds=kinds)
    data = BeirData(corpus={}, queries={}, qrels={})
    for row in rows:
        query, passage = str(row[query_field]), str(row[positive_field])
        title = str(row.get(title_field) or "") if title_field else ""
        qid, did = _stable_id("q", query), _stable_id("d", title + "\x00" + passage)
        data.queries[qid] = query
        data.corpus[did] = {"title": title, "text": passage}
        data.qrels.setdefault(qid, {})[did] = 1
    return data


def split_queries(
    query_ids: Sequence[str],
    eval_fraction: float,
    salt: str = "judgeloop",
    queries: Mapping[str, str] | None = None,
) -> tuple[list[str], list[str]]:
    """Deterministically split query ids into (train, eval) by a stable hash.

    A query lands in eval when ``hash(salt, key) < eval_fraction``; the key is the query id, or, when
    ``queries`` (id -> text) is given, the first id carrying the same normalized text, so duplicate
    queries never straddle the split. The result does not depend on input order.

    Returns:
        (train_ids, eval_ids), each in input order; checked disjoint with :func:`check_query_split`.
    """
    if not 0.0 < eval_fraction < 1.0:
        raise ValueError(f"eval_fraction={eval_fraction} must be in (0, 1); e.g. data.eval_fraction=0.2")
    first_for_text: dict[str, str] = {}
    train: list[str] = []
    held: list[str] = []
    for qid in query_ids:
        key = qid
        if queries is not None:
            key = first_for_text.setdefault(text_key(queries[qid]), qid)
        (held if hash_unit(key, salt) < eval_fraction else train).append(qid)
    if not train or not held:
        raise ValueError(
            f"split of {len(query_ids)} queries with eval_fraction={eval_fraction} left an empty side "
            f"({len(train)} train, {len(held)} eval); use more queries or a different eval_fraction"
        )
    check_query_split(train, held, queries)
    return train, held


def check_query_split(
    train_ids: Iterable[str], eval_ids: Iterable[str], queries: Mapping[str, str] | None = None
) -> None:
    """Raise :class:`LeakageError` if a query id (or, given ``queries``, a query text) is on both sides."""
    train_ids, eval_ids = list(train_ids), list(eval_ids)
    both = set(train_ids) & set(eval_ids)
    if both:
        raise LeakageError(
            f"query id '{sorted(both)[0]}' is in both the train and eval queries ({len(both)} ids)"
        )
    if queries is not None:
        train_text = {text_key(queries[q]): q for q in train_ids if q in queries}
        for q in eval_ids:
            if q in queries and text_key(queries[q]) in train_text:
                raise LeakageError(
                    f"eval query '{q}' has the same text as train query '{train_text[text_key(queries[q])]}'; "
                    "split with judgeloop.retrieval.beir.split_queries(..., queries=...)"
                )
