"""Step 7 of the RAFT build (:mod:`judgeloop.raft.builder`): evaluation questions, long answers and oracle
chunks never appear in a training example's documents. :func:`split_pools` keeps them out of the training
distractor pool; :func:`check_raft_leakage` checks the built rows."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from judgeloop.data.splits import LeakageError
from judgeloop.raft.chunking import Chunk
from judgeloop.raft.readers import RaftQuestion
from judgeloop.raft.splitting import SPLITS
from judgeloop.text import text_key


def _leak_strings(
    eval_qs: Sequence[RaftQuestion], oracle_of: Mapping[str, Chunk], min_chars: int
) -> list[str]:
    out = []
    for q in eval_qs:
        out.append(text_key(q.question))
        out.append(text_key(oracle_of[q.id].text))
        out += _answer_needles(q.kind, q.answer, q.long_answer or "", min_chars)
    return [s for s in out if s]


def _answer_needles(kind: str, answer: str, long_answer: str, min_chars: int) -> list[str]:
    """Answer texts that must not appear in training documents.

    Long answers (reasoning / conclusions) always count when at least ``min_chars`` long. Extracted
    span answers (SQuAD) do not: they are phrases of the oracle that recur across an article's other
    paragraphs by nature (use ``split.group_by=topic`` to keep whole articles apart instead).
    """
    texts = [long_answer] + ([answer] if kind in ("free", "title") else [])
    return [text_key(t) for t in texts if t and len(t.strip()) >= min_chars]


def check_raft_leakage(
    train_rows: Sequence[Mapping[str, Any]], eval_rows: Sequence[Mapping[str, Any]], min_chars: int = 20
) -> None:
    """Raise :class:`LeakageError` if an evaluation question, long answer or oracle chunk appears in
    a training example's documents, or a question id / text is in both splits."""
    train_ids = {r["meta"]["question_id"] for r in train_rows}
    train_q = {text_key(r["meta"]["question"]) for r in train_rows}
    needles: list[tuple[str, str]] = []
    for r in eval_rows:
        m = r["meta"]
        if m["question_id"] in train_ids:
            raise LeakageError(f"question id '{m['question_id']}' is in both the train and eval splits")
        if text_key(m["question"]) in train_q:
            raise LeakageError(
                f"eval question {m['question_id']} ({m['question'][:60]!r}) is also a training question"
            )
        needles.append((m["question_id"], text_key(m["question"])))
        needles.append((m["question_id"], text_key(m["oracle_text"])))
        for needle in _answer_needles(m.get("kind", "free"), m["answer"], m["long_answer"], min_chars):
            needles.append((m["question_id"], needle))
    for r in train_rows:
        m = r["meta"]
        docs = [text_key(t) for t in m["distractor_texts"]]
        if m["oracle_present"]:
            docs.append(text_key(m["oracle_text"]))
        for qid, needle in needles:
            for d in docs:
                if needle and needle in d:
                    raise LeakageError(
                        f"training example {m['question_id']} shows a document containing text of eval question "
                        f"{qid} ({needle[:60]!r}); rebuild with a different split.salt or remove the duplicate document"
                    )


def split_pools(
    splits: Mapping[str, Sequence[RaftQuestion]],
    chunks: Mapping[str, list[Chunk]],
    oracle_of: Mapping[str, Chunk],
    leak_min_chars: int,
) -> tuple[dict[str, list[Chunk]], int]:
    """Each split's distractor pool: its own documents plus unowned ones; train loses every chunk that
    holds an eval oracle's text. Returns the pools and how many train chunks were removed."""
    owner: dict[str, str] = {}
    for s in SPLITS:
        for q in splits[s]:
            for d in q.oracle_ids:
                assert owner.setdefault(d, s) == s, f"oracle document {d} is in two splits"
    leak = _leak_strings(splits["eval"], oracle_of, leak_min_chars)
    pools: dict[str, list[Chunk]] = {}
    removed = 0
    for s in SPLITS:
        pool = [c for d in sorted(chunks) if owner.get(d, s) == s for c in chunks[d]]
        if s == "train":
            kept = [c for c in pool if not any(n in text_key(c.text) for n in leak)]
            removed = len(pool) - len(kept)
            pool = kept
        pools[s] = pool
    return pools, removed
