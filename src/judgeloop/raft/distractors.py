"""Step 4 of the RAFT build (:mod:`judgeloop.raft.builder`): candidate distractors per split from four
sources: ``random``, ``same_source`` (same topic / title), ``bm25`` (bm25s over the split's chunk pool) and
``hard`` (the retriever's mined hard negatives). The oracle's document is never a distractor."""

from __future__ import annotations

import random
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from judgeloop.config import bounded, check_fields
from judgeloop.raft.chunking import Chunk
from judgeloop.raft.readers import RaftQuestion
from judgeloop.retrieval.bm25 import bm25_topk, build_bm25
from judgeloop.retrieval.encoder import BiEncoder
from judgeloop.retrieval.mining import MiningConfig, mine_hard_negatives

SOURCES = ("random", "same_source", "bm25", "hard")


@dataclass
class HardNegativeConfig:
    """Retriever-mined hard negatives (the retriever issue's miner) for the ``hard`` source."""

    encoder: str = "sentence-transformers/all-MiniLM-L6-v2"
    max_length: int = bounded(256, ge=0)
    batch_size: int = bounded(32, ge=1, shape="section")
    mining: dict[str, Any] = field(default_factory=dict)  # passed to judgeloop.retrieval.mining.MiningConfig

    def __post_init__(self) -> None:
        check_fields("distractors.hard", self)


@dataclass
class DistractorConfig:
    """``num_distractors`` per example; each slot picks a source by the weights in ``sources``.

    Sources: ``random``, ``same_source`` (same topic / title; falls back to random where a question has
    no topic), ``bm25`` (question against the split's chunk pool), ``hard`` (retriever-mined). A source
    that runs out falls back to ``random``; the realized mix is in ``stats.json``. ``candidate_depth``
    is how many ranked candidates bm25 / hard keep per question.
    """

    num_distractors: int = bounded(3, ge=0, shape="section")
    sources: dict[str, float] = field(default_factory=lambda: {"random": 1.0})
    candidate_depth: int = bounded(20, ge=1, shape="section")
    hard: HardNegativeConfig = field(default_factory=HardNegativeConfig)

    def __post_init__(self) -> None:
        check_fields("distractors", self)
        unknown = sorted(set(self.sources) - set(SOURCES))
        if unknown:
            raise ValueError(
                f"distractors.sources has unknown source(s) {unknown}; choose from {list(SOURCES)}"
            )
        if any(w < 0 for w in self.sources.values()) or sum(self.sources.values()) <= 0:
            raise ValueError(
                f"distractors.sources={self.sources} needs non-negative weights with a positive sum, "
                "e.g. {random: 0.5, bm25: 0.5}"
            )


def _bm25_rank(queries: Sequence[str], texts: Sequence[str], depth: int) -> list[list[int]]:
    """Top-``depth`` indices into ``texts`` for each query, by BM25 (:mod:`judgeloop.retrieval.bm25`)."""
    if not texts:
        return [[] for _ in queries]
    _scores, idx = bm25_topk(build_bm25(texts), queries, min(depth, len(texts)))  # (Q, k)
    return [[int(i) for i in row] for row in idx]


def _hard_rank(
    questions: Sequence[RaftQuestion],
    pool: Sequence[Chunk],
    positives: Mapping[str, set[str]],
    cfg: HardNegativeConfig,
    depth: int,
) -> dict[str, list[str]]:
    """Hard negatives per question from the retriever issue's miner (chunk ids, best first)."""
    encoder = BiEncoder.from_pretrained(cfg.encoder, max_length=cfg.max_length)
    query_emb = encoder.encode(
        [q.question for q in questions], batch_size=cfg.batch_size, is_query=True
    )  # (Q, D)
    doc_emb = encoder.encode([c.text for c in pool], batch_size=cfg.batch_size)  # (N, D)
    # Keep ``depth`` negatives from ranks [0, depth + 10) unless the config says otherwise.
    mining: dict[str, Any] = {"num_negatives": depth, "range_min": 0, "range_max": depth + 10, **cfg.mining}
    try:
        mining_cfg = MiningConfig(**mining)
    except TypeError as err:
        raise ValueError(
            f"distractors.hard.mining={cfg.mining} has a key MiningConfig does not take: {err}"
        ) from err
    mined = mine_hard_negatives(
        [q.id for q in questions],
        query_emb,
        [c.id for c in pool],
        doc_emb,
        {k: set(v) for k, v in positives.items()},
        mining_cfg,
    )
    return {qid: [doc_id for doc_id, _score in negs][:depth] for qid, negs in mined.items()}


class DistractorSampler:
    """Candidate distractors for the questions of one split, drawn from that split's chunk pool.

    ``pool`` holds the chunks this split may show (its own documents and unowned corpus documents,
    never the other split's oracle documents). ``excluded[qid]`` are chunk ids that must never be a
    distractor for ``qid`` (every chunk of its oracle documents and any chunk with the same text).
    """

    def __init__(
        self,
        questions: Sequence[RaftQuestion],
        pool: Sequence[Chunk],
        topics: Mapping[str, str | None],
        excluded: Mapping[str, set[str]],
        cfg: DistractorConfig,
    ) -> None:
        self.questions = list(questions)
        self.pool = list(pool)
        self.by_id = {c.id: c for c in self.pool}
        self.excluded = excluded
        self.cfg = cfg
        self.ranked: dict[str, dict[str, list[str]]] = {}
        weights = {s: w for s, w in cfg.sources.items() if w > 0}
        depth = cfg.candidate_depth
        if "bm25" in weights:
            # Over-fetch so that excluded chunks (the oracle's own) do not leave the list short.
            ranks = _bm25_rank([q.question for q in self.questions], [c.text for c in self.pool], depth + 16)
            self.ranked["bm25"] = {
                q.id: [self.pool[i].id for i in row if self.pool[i].id not in excluded[q.id]][:depth]
                for q, row in zip(self.questions, ranks)
            }
        if "hard" in weights:
            positives = {q.id: {c for c in excluded[q.id] if c in self.by_id} for q in self.questions}
            mined = _hard_rank(self.questions, self.pool, positives, cfg.hard, depth + 16)
            # The miner already drops positives; this filter makes "never the oracle" hold regardless.
            self.ranked["hard"] = {
                q.id: [c for c in mined.get(q.id, []) if c in self.by_id and c not in excluded[q.id]][:depth]
                for q in self.questions
            }
        if "same_source" in weights:
            by_topic: dict[str, list[str]] = defaultdict(list)
            for c in self.pool:
                t = topics.get(c.doc_id)
                if t:
                    by_topic[t].append(c.id)
            self.ranked["same_source"] = {}
            for q in self.questions:
                t = q.topic or topics.get(q.oracle_ids[0])
                self.ranked["same_source"][q.id] = (
                    [c for c in by_topic.get(t, []) if c not in excluded[q.id]] if t else []
                )
        self.source_names = sorted(weights)
        self.source_weights = [weights[s] for s in self.source_names]

    def _random(self, rng: random.Random, qid: str, taken: set[str]) -> str | None:
        bad = self.excluded[qid] | taken
        for _ in range(64):
            c = self.pool[rng.randrange(len(self.pool))].id if self.pool else None
            if c is None:
                return None
            if c not in bad:
                return c
        rest = [c.id for c in self.pool if c.id not in bad]
        return rng.choice(rest) if rest else None

    def sample(self, rng: random.Random, q: RaftQuestion, k: int) -> list[tuple[str, str, str]]:
        """``k`` distractors as (chunk id, requested source, realized source)."""
        out: list[tuple[str, str, str]] = []
        taken: set[str] = set()
        for _ in range(k):
            src = rng.choices(self.source_names, weights=self.source_weights, k=1)[0]
            chosen: str | None = None
            if src == "random":
                chosen = self._random(rng, q.id, taken)
                realized = "random"
            else:
                if src == "same_source":
                    cands = [c for c in self.ranked[src][q.id] if c not in taken]
                    chosen = rng.choice(cands) if cands else None
                else:
                    chosen = next((c for c in self.ranked[src][q.id] if c not in taken), None)
                realized = src
                if chosen is None:
                    chosen = self._random(rng, q.id, taken)
                    realized = "random"
            if chosen is None:
                break  # the pool is exhausted; fewer distractors (counted in stats)
            assert chosen not in self.excluded[q.id], "a distractor must never be the oracle"
            taken.add(chosen)
            out.append((chosen, src, realized))
        return out
