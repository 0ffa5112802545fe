"""Evidence marks: each document of a RAFT prompt labelled with what calibrated retrieval says of it.

A conformal retriever (:class:`~judgeloop.retrieval.conformal.ConformalRetriever`, document guarantee) is
fitted on the train split of a RAFT build: each train question's oracle chunk, scored against the question
by the marks' bi-encoder (cosine, mapped to [0, 1] by ``(1 + cos) / 2``), is one calibration point. Every
document shown with a question then gets

* its **level**: the tightest of ``levels`` (coverages, e.g. 80% and 95%) whose conformal set holds it,
  or none;
* its **conformal p-value** (:meth:`~judgeloop.retrieval.conformal.ConformalRetriever.pvalue`): how far
  inside the sets it sits; a document scored like a typical oracle has a large p.

The prompt format (documented in docs/retrieval.md) puts the mark in the document's opening tag::

    <DOCUMENT id="12345#0" retrieval="in the 80% set, p=0.62: likely relevant">
    <DOCUMENT id="67890#1" retrieval="in the 95% set only, p=0.09: uncertain">
    <DOCUMENT id="24680#0" retrieval="outside the 95% set, p=0.01: likely irrelevant">

The builder writes the marks into each row's ``meta`` (``doc_marks``) and, with ``marks.in_prompt``, into
its prompts; ``judgeloop eval-raft`` renders its settings with or without them from the build's
``conformal.json``, which carries the fingerprint of the build's chunk corpus.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from judgeloop.config import bounded, check_fields

DEFAULT_LEVELS = (0.8, 0.95)


@dataclass
class MarksConfig:
    """Evidence marks in a RAFT build: ``enabled`` fits the conformal retriever on the train split and writes
    ``conformal.json`` and every row's ``meta.doc_marks``; ``in_prompt`` also puts the marks into the build's
    prompts (train on marked prompts). ``levels``: the coverages of the sets a mark names."""

    enabled: bool = False
    in_prompt: bool = False
    encoder: str = "sentence-transformers/all-MiniLM-L6-v2"
    max_length: int = bounded(256, ge=0)
    batch_size: int = bounded(32, ge=1, shape="section")
    levels: list[float] = field(default_factory=lambda: list(DEFAULT_LEVELS))

    def __post_init__(self) -> None:
        check_fields("marks", self)
        check_levels(self.levels, "marks.levels")
        if self.in_prompt and not self.enabled:
            raise ValueError(
                "marks.in_prompt=true needs marks.enabled=true (the marks come from the fitted sets)"
            )

    def scorer(self) -> dict[str, Any]:
        """What must match for a conformal file to be reused with these scores."""
        return {
            "encoder": self.encoder,
            "pooling": "mean",
            "max_length": self.max_length,
            "score_map": "affine",
        }


def check_levels(levels: Sequence[float], key: str) -> None:
    """``levels`` is a non-empty list of distinct coverages in (0, 1)."""
    if not levels or any(not 0.0 < x < 1.0 for x in levels) or len(set(levels)) != len(levels):
        raise ValueError(f"{key}={list(levels)} must be distinct coverages in (0, 1), e.g. [0.8, 0.95]")


def mark_text(level: float | None, pvalue: float, levels: Sequence[float]) -> str:
    """The ``retrieval="..."`` text of one document (module docstring)."""
    tight, wide = min(levels), max(levels)
    if level is None or (isinstance(level, float) and math.isnan(level)):
        return f"outside the {wide:.0%} set, p={pvalue:.2f}: likely irrelevant"
    if level == tight:
        return f"in the {level:.0%} set, p={pvalue:.2f}: likely relevant"
    return f"in the {level:.0%} set only, p={pvalue:.2f}: uncertain"


def pair_scores(cfg: MarksConfig, pairs: Sequence[tuple[str, str]]) -> np.ndarray:
    """``(N,)`` the (question, document) pairs' scores in [0, 1]: ``(1 + cos) / 2`` under ``cfg.encoder``
    (mean pooling, L2-normalized); each distinct text is encoded once."""
    from judgeloop.retrieval.conformal import map_scores
    from judgeloop.retrieval.encoder import BiEncoder

    if not pairs:
        return np.zeros(0)
    enc = BiEncoder.from_pretrained(cfg.encoder, pooling="mean", normalize=True, max_length=cfg.max_length)
    qs = sorted({q for q, _ in pairs})
    ds = sorted({d for _, d in pairs})
    q_emb = dict(zip(qs, enc.encode(qs, batch_size=cfg.batch_size, is_query=True).numpy()))
    d_emb = dict(zip(ds, enc.encode(ds, batch_size=cfg.batch_size).numpy()))
    cos = np.asarray([float(q_emb[q] @ d_emb[d]) for q, d in pairs])
    return np.asarray(map_scores(cos, "affine"))


def row_docs(meta: Mapping[str, Any]) -> list[tuple[str, str]]:
    """Every document a row can show (its oracle chunk, then its distractors), as (id, text)."""
    docs = [(meta["oracle_chunk_id"], meta["oracle_text"])]
    return docs + list(zip(meta["distractor_ids"], meta["distractor_texts"]))


def fit_marks(cfg: MarksConfig, train_rows: Sequence[Mapping[str, Any]]) -> Any:
    """The conformal retriever of the marks, fitted on the train rows' (question, oracle chunk) scores."""
    from judgeloop.retrieval.conformal import ConformalRetriever

    if not train_rows:
        raise ValueError("the train split is empty; the marks' conformal sets are fitted on it")
    s = pair_scores(cfg, [(r["meta"]["question"], r["meta"]["oracle_text"]) for r in train_rows])[:, None]
    n = len(train_rows)
    # alpha only sets threshold_; the marks use threshold_at(level) for each level
    return ConformalRetriever(alpha=1.0 - max(cfg.levels), guarantee="document").fit(
        s, np.ones((n, 1), bool), np.zeros(n, np.int64)
    )


def doc_marks(
    cfg: MarksConfig, model: Any, rows: Sequence[Mapping[str, Any]], levels: Sequence[float]
) -> list[dict[str, dict[str, Any]]]:
    """Per row, ``{doc id: {"score", "level", "pvalue", "text"}}`` for every document it can show."""
    pairs = [(r["meta"]["question"], text) for r in rows for _, text in row_docs(r["meta"])]
    scores = pair_scores(cfg, pairs)
    lv, pv = model.levels(scores, levels), model.pvalue(scores)
    out, k = [], 0
    for r in rows:
        marks = {}
        for doc_id, _ in row_docs(r["meta"]):
            level = None if math.isnan(lv[k]) else float(lv[k])
            marks[doc_id] = {
                "score": float(scores[k]),
                "level": level,
                "pvalue": float(pv[k]),
                "text": mark_text(level, float(pv[k]), levels),
            }
            k += 1
        out.append(marks)
    return out


@dataclass
class EvalMarksConfig:
    """``judgeloop eval-raft`` with evidence marks: with ``compare``, every model is evaluated without and
    with the marks on the same questions, and the paired deltas get bootstrap intervals over questions.
    ``conformal_path``: the marks' conformal retriever (default ``DATA_DIR/conformal.json``, written by
    ``build-raft`` with ``marks.enabled``); it must have been fitted on that build's chunk corpus."""

    compare: bool = False
    conformal_path: str | None = None
    levels: list[float] = field(default_factory=lambda: list(DEFAULT_LEVELS))
    batch_size: int = bounded(32, ge=0)
    num_bootstrap: int = bounded(1000, ge=1, shape="section")

    def __post_init__(self) -> None:
        check_fields("marks", self)
        check_levels(self.levels, "marks.levels")


def load_eval_marks(cfg: EvalMarksConfig, data_dir: str | Path) -> tuple[Any, MarksConfig]:
    """The conformal retriever for a RAFT build's marks and the scorer it was fitted with, checked against
    the build's corpus (``stats.json``) before any model loads.

    Raises:
        ValueError: one line naming ``marks.conformal_path`` (or the build) and the fix.
    """
    import json

    from judgeloop.retrieval.conformal import conformal_file_info, load_conformal_file

    path = Path(cfg.conformal_path) if cfg.conformal_path else Path(data_dir) / "conformal.json"
    stats_path = Path(data_dir) / "stats.json"
    corpus = json.loads(stats_path.read_text()).get("corpus") if stats_path.is_file() else None
    if corpus is None:
        raise ValueError(
            f"data_dir={data_dir} has no corpus fingerprint in stats.json (built before marks existed); rebuild it "
            "with build-raft to use marks"
        )
    if cfg.conformal_path is None and not path.is_file():
        raise ValueError(
            f"data_dir={data_dir} has no conformal.json; build it with marks.enabled=true or set marks.conformal_path"
        )
    scorer = conformal_file_info(path, "marks.conformal_path")["scorer"]
    model = load_conformal_file(path, corpus, scorer, "marks.conformal_path")
    return model, MarksConfig(
        enabled=True,
        encoder=scorer["encoder"],
        max_length=int(scorer["max_length"]),
        batch_size=cfg.batch_size,
        levels=list(cfg.levels),
    )


def paired_marks(
    without: Mapping[str, Any], with_marks: Mapping[str, Any], num_bootstrap: int, seed: int
) -> dict[str, Any]:
    """Per setting, accuracy without and with the marks and the paired delta (bootstrap over questions); the
    same for quote validity on the free generations."""
    from judgeloop.intervals import bootstrap_mean_interval

    def delta(a: Sequence[float], b: Sequence[float]) -> dict[str, Any]:
        x, y = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
        d = y - x
        return {
            "without": float(x.mean()) if x.size else None,
            "with": float(y.mean()) if y.size else None,
            "delta": float(d.mean()) if d.size else None,
            "ci95": list(bootstrap_mean_interval(d, num_bootstrap, seed=seed)),
            "n": int(d.size),
            "changed": int((d != 0).sum()),
        }

    out: dict[str, Any] = {"accuracy": {}}
    for setting, e in without["settings"].items():
        if "correct" in e:
            out["accuracy"][setting] = delta(e["correct"], with_marks["settings"][setting]["correct"])
    if "quotes" in without and "quotes" in with_marks:
        out["quote_validity"] = delta(without["quotes"]["valid"], with_marks["quotes"]["valid"])
        out["has_answer_marker"] = delta(without["quotes"]["has_answer"], with_marks["quotes"]["has_answer"])
    return out
