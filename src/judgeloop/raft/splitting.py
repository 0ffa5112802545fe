"""Step 2 of the RAFT build (:mod:`judgeloop.raft.builder`): a held-out evaluation split by a stable hash
of connected groups of questions that share an oracle document (or a topic), so no oracle is in both."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from judgeloop.config import bounded, check_fields
from judgeloop.data.splits import hash_unit
from judgeloop.raft.readers import RaftDoc, RaftQuestion

SPLITS = ("train", "eval")


@dataclass
class RaftSplitConfig:
    """Held-out evaluation split: a fraction of question groups, by a stable hash.

    ``group_by``: ``oracle`` groups questions that share an oracle document; ``topic`` also groups by
    topic (e.g. SQuAD article title), a stricter split. ``leak_min_chars``: eval answers shorter than
    this (e.g. "yes", "France") are not checked against training documents, since they occur anywhere.
    """

    eval_fraction: float = bounded(0.2, gt=0.0, lt=1.0, hint="; e.g. 0.2", shape="section")
    group_by: Literal["oracle", "topic"] = "oracle"
    salt: str = "judgeloop-raft"
    leak_min_chars: int = bounded(20, ge=1, shape="section")

    def __post_init__(self) -> None:
        check_fields("split", self)


def split_questions(
    questions: Sequence[RaftQuestion], cfg: RaftSplitConfig, corpus: Mapping[str, RaftDoc] | None = None
) -> dict[str, list[RaftQuestion]]:
    """Assign questions to ``train`` / ``eval`` by connected group (shared oracle doc, or topic).

    A group's key is its smallest member key, hashed with ``cfg.salt``; the group goes to ``eval`` when
    the hash is below ``eval_fraction``. Questions sharing an oracle document are always together.
    """
    parent: dict[str, str] = {}

    def find(x: str) -> str:
        parent.setdefault(x, x)
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    def union(a: str, b: str) -> None:
        ra, rb = find(a), find(b)
        if ra != rb:
            parent[max(ra, rb)] = min(ra, rb)

    for q in questions:
        keys = [f"doc:{d}" for d in q.oracle_ids]
        if cfg.group_by == "topic":
            topic = q.topic or (
                corpus[q.oracle_ids[0]].topic if corpus and q.oracle_ids[0] in corpus else None
            )
            if topic:
                keys.append(f"topic:{topic}")
        for k in keys[1:]:
            union(keys[0], k)
        find(keys[0])
    out: dict[str, list[RaftQuestion]] = {s: [] for s in SPLITS}
    for q in questions:
        root = find(f"doc:{q.oracle_ids[0]}")
        out["eval" if hash_unit(root, cfg.salt) < cfg.eval_fraction else "train"].append(q)
    return out
