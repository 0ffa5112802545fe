"""Step 5 of the RAFT build (:mod:`judgeloop.raft.builder`): seeded per question, the oracle is present with
probability ``p_oracle``, ``num_distractors`` distractors are drawn by the source mix, the documents are
shuffled (ids stable: ``doc_id#chunk``) and the target is written; :func:`assemble_split` returns a split's
chat rows with their ``meta``."""

from __future__ import annotations

import random
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from judgeloop.raft.chunking import Chunk
from judgeloop.raft.distractors import DistractorConfig, DistractorSampler
from judgeloop.raft.readers import RaftQuestion
from judgeloop.raft.targets import (
    PromptConfig,
    TargetConfig,
    absent_reasoning,
    extract_quotes,
    quotes_are_verbatim,
    render_messages,
    render_target,
)
from judgeloop.text import text_key


class AssemblySettings(Protocol):
    """The build settings assembly reads (:class:`judgeloop.raft.builder.BuildRaftConfig` has them): named
    here so that the step sits below the builder that calls it."""

    seed: int
    p_oracle: float
    distractors: DistractorConfig
    target: TargetConfig
    prompt: PromptConfig


@dataclass
class DistractorTally:
    """The distractor sources asked for and drawn, over the whole build (``stats.json``)."""

    requested: Counter[str] = field(default_factory=Counter)
    realized: Counter[str] = field(default_factory=Counter)
    short_of_distractors: int = 0


def _example_row(
    q: RaftQuestion,
    split: str,
    present: bool,
    picked: list,
    order: list[str],
    oracle: Chunk,
    by_id: Mapping[str, str],
    reasoning: str,
    answer: str,
    system: str,
) -> dict[str, Any]:
    """One RAFT chat row and its meta (what eval-raft and the statistics read)."""
    messages = render_messages(
        system, q.question, q.kind, [(cid, by_id[cid]) for cid in order], render_target(reasoning, answer)
    )
    meta = {
        "question_id": q.id,
        "split": split,
        "question": q.question,
        "kind": q.kind,
        "answer": q.answer,
        "long_answer": q.long_answer or "",
        "target_answer": answer,
        "oracle_present": present,
        "oracle_ids": list(q.oracle_ids),
        "oracle_chunk_id": oracle.id,
        "oracle_text": oracle.text,
        "quotes": extract_quotes(reasoning) if present else [],
        "distractor_ids": [cid for cid, _, _ in picked],
        "distractor_texts": [by_id[cid] for cid, _, _ in picked],
        "distractor_sources": [real for _, _, real in picked],
        "doc_order": order,
    }
    return {"messages": messages, "meta": meta}


def assemble_split(
    cfg: AssemblySettings,
    split: str,
    qs: Sequence[RaftQuestion],
    pool: list[Chunk],
    chunks: Mapping[str, list[Chunk]],
    oracle_of: Mapping[str, Chunk],
    quotes_of: Mapping[str, list[str]],
    topics: Mapping[str, str | None],
    gen: Any,
    tally: DistractorTally,
) -> list[dict[str, Any]]:
    """The rows of one split: distractors per question, the oracle with probability p_oracle, the target."""
    pool_ids = {c.id for c in pool}
    ids_by_text: dict[str, set[str]] = defaultdict(set)
    for c in pool:
        ids_by_text[text_key(c.text)].add(c.id)
    excluded = {}
    for q in qs:
        # Every chunk of its oracle documents, and any chunk with the same text (a duplicate document).
        bad = {c.id for d in q.oracle_ids for c in chunks[d]}
        for d in q.oracle_ids:
            for t in {text_key(c.text) for c in chunks[d]}:
                bad |= ids_by_text.get(t, set())
        excluded[q.id] = bad
    sampler = DistractorSampler(qs, pool, topics, excluded, cfg.distractors)
    plans = []
    for q in qs:
        rng = random.Random(f"{cfg.seed}\x00{q.id}")
        present = rng.random() < cfg.p_oracle
        picked = sampler.sample(rng, q, cfg.distractors.num_distractors)
        if len(picked) < cfg.distractors.num_distractors:
            tally.short_of_distractors += 1
        order = [oracle_of[q.id].id] if present else []
        order += [cid for cid, _, _ in picked]
        rng.shuffle(order)
        plans.append((q, present, picked, order))
        for _, req, real in picked:
            tally.requested[req] += 1
            tally.realized[real] += 1
    present_items = [(q, oracle_of[q.id], quotes_of[q.id]) for q, present, _, _ in plans if present]
    reasons = dict(zip([q.id for q, _, _ in present_items], gen.reasoning(present_items)))
    rows = []
    for q, present, picked, order in plans:
        oracle = oracle_of[q.id]
        by_id = {oracle.id: oracle.text, **{cid: sampler.by_id[cid].text for cid, _, _ in picked}}
        assert all(cid in pool_ids for cid, _, _ in picked)
        if present:
            reasoning, answer = reasons[q.id], q.answer
            if not quotes_are_verbatim(reasoning, oracle.text):
                raise AssertionError(f"question {q.id}: a quote in the target is not verbatim in the oracle")
        else:
            reasoning, answer = absent_reasoning(q, cfg.target)
        rows.append(
            _example_row(
                q, split, present, picked, order, oracle, by_id, reasoning, answer, cfg.prompt.system
            )
        )
    return rows
