"""RAFT-style training data: a question, k distractor documents, and the oracle with probability ``p_oracle``.

RAFT (Zhang et al. 2024, "RAFT: Adapting Language Model to Domain Specific RAG", arXiv:2403.10131)
trains a generator to answer from a set of documents in which the useful one (the oracle) may be
present or absent, citing the evidence it used. The pipeline here, one named step each, one module per step:

1. :func:`~judgeloop.raft.readers.read_questions` (``readers``) - questions with oracle documents and
   answers, plus a corpus; duplicate questions are removed.
2. :func:`~judgeloop.raft.splitting.split_questions` (``splitting``) - a held-out evaluation split by a
   stable hash of connected groups of questions that share an oracle document (so no oracle is in both
   splits).
3. :func:`~judgeloop.raft.chunking.chunk_corpus` (``chunking``) - token windows; the oracle chunk
   (:func:`~judgeloop.raft.chunking.oracle_chunk`) is the one that holds the answer evidence (the known
   span, else the chunk most similar to the long answer / answer).
4. :class:`~judgeloop.raft.distractors.DistractorSampler` (``distractors``) - per split, candidate
   distractors from four sources: ``random``, ``same_source`` (same topic/title), ``bm25`` (bm25s over the
   split's chunk pool), ``hard`` (the retriever's mined hard negatives). The oracle's document is never a
   distractor.
5. :func:`~judgeloop.raft.assembly.assemble_split` (``assembly``) - seeded per question: oracle present
   with probability ``p_oracle``, k distractors drawn by the source mix, documents shuffled, ids stable
   (``doc_id#chunk``).
6. a target generator (``targets``: :class:`~judgeloop.raft.targets.TemplateGenerator` or
   :class:`~judgeloop.raft.targets.LMGenerator`) writes reasoning that quotes the oracle verbatim between
   ``##begin_quote##``/``##end_quote##`` then ``<ANSWER>: ...``; every quote is checked to be a substring
   of the oracle chunk.
7. :func:`~judgeloop.raft.leakage.check_raft_leakage` (``leakage``) - evaluation questions, long answers
   and oracle chunks never appear in a training example's documents.
8. (``marks.enabled``) :func:`~judgeloop.raft.marks.fit_marks` (``marks``) - a conformal retriever fitted on
   the train split; every shown document gets its evidence mark in ``meta.doc_marks`` (and, with
   ``marks.in_prompt``, in the prompt).

:func:`build_raft` runs the steps in that order and :func:`save_raft` writes what they built. Rows are chat
``messages`` (system / user / assistant), the format TRL's ``SFTTrainer`` takes, plus ``meta`` (ids, texts
and answers needed to re-render any evaluation setting).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from judgeloop.config import bounded, check_fields
from judgeloop.logging import get_logger
from judgeloop.models import load_tokenizer
from judgeloop.raft.assembly import DistractorTally, assemble_split
from judgeloop.raft.chunking import ChunkConfig, chunk_corpus, oracle_chunk
from judgeloop.raft.distractors import DistractorConfig
from judgeloop.raft.leakage import check_raft_leakage, split_pools
from judgeloop.raft.marks import MarksConfig, doc_marks, fit_marks
from judgeloop.raft.readers import RaftDataConfig, read_questions
from judgeloop.raft.splitting import SPLITS, RaftSplitConfig, split_questions
from judgeloop.raft.targets import LMGenerator, PromptConfig, TargetConfig, make_generator, select_quotes
from judgeloop.retrieval.conformal import corpus_fingerprint

logger = get_logger(__name__)


@dataclass
class BuildRaftConfig:
    """``judgeloop build-raft``: read, split, chunk, sample distractors, write targets, save."""

    data: RaftDataConfig = field(
        default_factory=lambda: RaftDataConfig(path="../shared/data/pubmedqa/pubmedqa_dev.jsonl")
    )
    chunk: ChunkConfig = field(default_factory=ChunkConfig)
    split: RaftSplitConfig = field(default_factory=RaftSplitConfig)
    distractors: DistractorConfig = field(default_factory=DistractorConfig)
    target: TargetConfig = field(default_factory=TargetConfig)
    prompt: PromptConfig = field(default_factory=PromptConfig)
    marks: MarksConfig = field(default_factory=MarksConfig)
    p_oracle: float = bounded(0.8, ge=0.0, le=1.0, hint=" (RAFT uses 0.8)", shape="section")
    seed: int = bounded(0, ge=0, le=2**32 - 1)
    max_length: int | None = bounded(768, ge=16, hint=" tokens or null", shape="section")
    output_dir: str = "runs/raft/pubmedqa"
    overwrite: bool = False  # true: clear an output_dir that holds another run (judgeloop.rundir)

    def __post_init__(self) -> None:
        check_fields("", self)


@dataclass
class RaftBuild:
    """The built data: ``rows[split]`` (messages + meta), ``stats`` and, with marks, the fitted conformal
    retriever (``conformal``) and the scorer it was fitted with."""

    rows: dict[str, list[dict[str, Any]]]
    stats: dict[str, Any]
    conformal: Any | None = None
    scorer: dict[str, Any] | None = None


def _percentiles(values: Sequence[int]) -> dict[str, float]:
    if not values:
        return {}
    import numpy as np

    arr = np.asarray(values)
    return {
        "mean": float(arr.mean()),
        "p50": float(np.percentile(arr, 50)),
        "p95": float(np.percentile(arr, 95)),
        "max": int(arr.max()),
    }


def _token_lengths(
    tokenizer: Any, split_rows: Sequence[Mapping[str, Any]], max_length: int | None
) -> dict[str, Any]:
    full, prompt, completion = [], [], []
    for r in split_rows:
        p = _count_tokens(tokenizer, r["messages"][:2], add_generation_prompt=True)
        f = _count_tokens(tokenizer, r["messages"], add_generation_prompt=False)
        full.append(f)
        prompt.append(p)
        completion.append(f - p)
    out: dict[str, Any] = {
        "total": _percentiles(full),
        "prompt": _percentiles(prompt),
        "completion": _percentiles(completion),
    }
    if max_length is not None:
        out["num_over_max_length"] = sum(v > max_length for v in full)
    return out


def build_raft(cfg: BuildRaftConfig, generator: Any | None = None) -> RaftBuild:
    """Run the whole pipeline (steps 1-7 of the module docstring) for ``cfg``; nothing is written.

    Args:
        cfg: the builder config.
        generator: an object with ``reasoning(items) -> list[str]`` (items are (question, oracle chunk,
            quotes)); defaults to the one ``cfg.target.generator`` names.

    Returns:
        :class:`RaftBuild` with ``rows["train"]``, ``rows["eval"]`` and ``stats``.
    """
    read, counts = read_questions(cfg.data)
    if len(read.questions) < 2:
        raise ValueError(
            f"data: only {len(read.questions)} question(s) after de-duplication; need at least 2"
        )
    splits = split_questions(read.questions, cfg.split, read.corpus)
    if not splits["train"] or not splits["eval"]:
        raise ValueError(
            f"split.eval_fraction={cfg.split.eval_fraction} left the "
            f"{'train' if not splits['train'] else 'eval'} split empty for {len(read.questions)} questions; "
            "use more questions or a fraction nearer 0.5"
        )
    tokenizer = load_tokenizer(cfg.chunk.tokenizer)
    chunks = chunk_corpus(tokenizer, read.corpus, cfg.chunk)
    # Oracle chunk and quotes per question.
    oracle_of = {q.id: oracle_chunk(q, chunks[q.oracle_ids[0]]) for q in read.questions}
    quotes_of = {q.id: select_quotes(q, oracle_of[q.id], cfg.target.max_quotes) for q in read.questions}
    pools, removed_for_leakage = split_pools(splits, chunks, oracle_of, cfg.split.leak_min_chars)
    topics = {d: doc.topic for d, doc in read.corpus.items()}
    gen = generator if generator is not None else make_generator(cfg.target)
    tally = DistractorTally()
    rows = {
        s: assemble_split(cfg, s, splits[s], pools[s], chunks, oracle_of, quotes_of, topics, gen, tally)
        for s in SPLITS
    }
    check_raft_leakage(rows["train"], rows["eval"], cfg.split.leak_min_chars)
    conformal = add_marks(cfg, rows) if cfg.marks.enabled else None
    n_train, n_eval = len(rows["train"]), len(rows["eval"])
    stats: dict[str, Any] = {
        "num_examples": n_train + n_eval,
        "num_train": n_train,
        "num_eval": n_eval,
        "p_oracle": cfg.p_oracle,
        "oracle_rate": sum(r["meta"]["oracle_present"] for r in rows["train"]) / max(1, n_train),
        "oracle_rate_eval": sum(r["meta"]["oracle_present"] for r in rows["eval"]) / max(1, n_eval),
        "num_distractors": cfg.distractors.num_distractors,
        "distractor_sources_requested": dict(sorted(tally.requested.items())),
        "distractor_sources_realized": dict(sorted(tally.realized.items())),
        "examples_short_of_distractors": tally.short_of_distractors,
        "pool_chunks": {s: len(pools[s]) for s in SPLITS},
        "train_chunks_removed_for_leakage": removed_for_leakage,
        "num_chunks": sum(len(v) for v in chunks.values()),
        "counts": counts,
        "generator": cfg.target.generator,
        "token_lengths": {s: _token_lengths(tokenizer, rows[s], cfg.max_length) for s in SPLITS},
        "tokenizer": cfg.chunk.tokenizer,
        "seed": cfg.seed,
        "corpus": corpus_fingerprint(
            [c.id for v in chunks.values() for c in v], [c.text for v in chunks.values() for c in v]
        ),
    }
    if isinstance(gen, LMGenerator):
        stats["lm_generated"] = gen.num_generated_
        stats["lm_fallbacks_to_template"] = gen.num_fallbacks_
    if conformal is not None:
        stats["marks"] = _marks_stats(cfg.marks, conformal, rows)
    return RaftBuild(rows, stats, conformal, cfg.marks.scorer() if conformal is not None else None)


def add_marks(cfg: BuildRaftConfig, rows: dict[str, list[dict[str, Any]]]) -> Any:
    """Step 8: fit the marks' conformal retriever on the train rows, write every row's ``meta.doc_marks``
    and, with ``marks.in_prompt``, re-render its user turn with them; returns the fitted retriever."""
    from judgeloop.raft.targets import render_user

    model = fit_marks(cfg.marks, rows["train"])
    for split_rows in rows.values():
        for row, marks in zip(split_rows, doc_marks(cfg.marks, model, split_rows, cfg.marks.levels)):
            meta = row["meta"]
            meta["doc_marks"] = marks
            if cfg.marks.in_prompt:
                texts = dict(zip(meta["distractor_ids"], meta["distractor_texts"]))
                texts[meta["oracle_chunk_id"]] = meta["oracle_text"]
                docs = [(d, texts[d]) for d in meta["doc_order"]]
                row["messages"][1]["content"] = render_user(
                    meta["question"], meta["kind"], docs, {d: m["text"] for d, m in marks.items()}
                )
    return model


def _marks_stats(cfg: MarksConfig, model: Any, rows: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """How the marks fall on each split's shown oracle chunks and distractors."""
    out: dict[str, Any] = {
        "levels": cfg.levels,
        "in_prompt": cfg.in_prompt,
        "n_cal": model.n_cal_,
        "thresholds": {f"{x:g}": model.threshold_at(x) for x in cfg.levels},
    }
    for split, split_rows in rows.items():
        counts: dict[str, dict[str, int]] = {"oracle": {}, "distractor": {}}
        for r in split_rows:
            m = r["meta"]
            for d in m["doc_order"]:
                who = "oracle" if d == m["oracle_chunk_id"] else "distractor"
                level = m["doc_marks"][d]["level"]
                key = "outside" if level is None else f"{level:g}"
                counts[who][key] = counts[who].get(key, 0) + 1
        out[split] = counts
    return out


def _count_tokens(tokenizer: Any, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool) -> int:
    text = tokenizer.apply_chat_template(
        list(messages), tokenize=False, add_generation_prompt=add_generation_prompt
    )
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def save_raft(build: RaftBuild, output_dir: str | Path, config: Any | None = None) -> Path:
    """Write ``train.jsonl``, ``eval.jsonl``, ``dataset/`` (a ``datasets.DatasetDict``), ``stats.json``
    (and ``config.yaml`` when ``config`` is given; ``conformal.json`` with marks), each atomically."""
    from datasets import Dataset, DatasetDict

    from judgeloop.io import atomic_dir, atomic_write_json, atomic_write_jsonl, atomic_write_text

    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    for s, split_rows in build.rows.items():
        atomic_write_jsonl(out / f"{s}.jsonl", split_rows)
    dd = DatasetDict({s: Dataset.from_list(split_rows) for s, split_rows in build.rows.items()})
    with atomic_dir(out / "dataset") as tmp:
        dd.save_to_disk(str(tmp))
    atomic_write_json(out / "stats.json", build.stats)
    if build.conformal is not None:
        from judgeloop.retrieval.conformal import save_conformal_file

        save_conformal_file(
            out / "conformal.json", build.conformal, build.stats["corpus"], build.scorer or {}
        )
    if config is not None:
        from judgeloop.config import to_yaml

        atomic_write_text(out / "config.yaml", to_yaml(config))
    return out
