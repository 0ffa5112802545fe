"""RAFT-style training data: a question, k distractor documents, and the oracle with probability ``p_oracle``.

RAFT (Zhang et al. 2024, "RAFT: Adapting Language Model to Domain Specific RAG", arXiv:2403.10131)
trains a generator to answer from a set of documents in which the useful one (the oracle) may be
present or absent, citing the evidence it used. The pipeline here, one named step each:

1. :func:`read_questions` - questions with oracle documents and answers, plus a corpus (readers in
   ``raft_readers``); duplicate questions are removed.
2. :func:`split_questions` - a held-out evaluation split by a stable hash of connected groups of
   questions that share an oracle document (so no oracle is in both splits).
3. :func:`chunk_corpus` - token windows (``chunking``); the oracle chunk is the one that holds the answer
   evidence (the known span, else the chunk most similar to the long answer / answer).
4. :class:`DistractorSampler` - per split, candidate distractors from four sources: ``random``,
   ``same_source`` (same topic/title), ``bm25`` (bm25s over the split's chunk pool), ``hard``
   (the retriever's mined hard negatives). The oracle's document is never a distractor.
5. :func:`assemble_example` - seeded per question: oracle present with probability ``p_oracle``,
   k distractors drawn by the source mix, documents shuffled, ids stable (``doc_id#chunk``).
6. a target generator (:class:`TemplateGenerator` or :class:`LMGenerator`) writes reasoning that quotes
   the oracle verbatim between ``##begin_quote##``/``##end_quote##`` then ``<ANSWER>: ...``; every quote
   is checked to be a substring of the oracle chunk.
7. :func:`check_raft_leakage` - evaluation questions, long answers and oracle chunks never appear in a
   training example's documents.

Rows are chat ``messages`` (system / user / assistant), the format TRL's ``SFTTrainer`` takes, plus
``meta`` (ids, texts and answers needed to re-render any evaluation setting).
"""

from __future__ import annotations

import random
import re
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from judgeloop.config import check_at_least, check_range
from judgeloop.data.splits import LeakageError, hash_unit
from judgeloop.logging import get_logger
from judgeloop.models import load_causal_lm, load_tokenizer
from judgeloop.raft.chunking import Chunk, ChunkConfig, chunk_text
from judgeloop.raft.readers import (
    RaftDoc,
    RaftQuestion,
    ReadResult,
    read_corpus_jsonl,
    read_generic_jsonl,
    read_pubmedqa,
    read_scifact,
    read_squad,
)
from judgeloop.retrieval.bm25 import bm25_topk, build_bm25
from judgeloop.retrieval.encoder import BiEncoder
from judgeloop.retrieval.mining import MiningConfig, mine_hard_negatives
from judgeloop.text import STOPWORDS

logger = get_logger(__name__)

BEGIN_QUOTE = "##begin_quote##"
END_QUOTE = "##end_quote##"
ANSWER_MARKER = "<ANSWER>:"
SOURCES = ("random", "same_source", "bm25", "hard")
SPLITS = ("train", "eval")

DEFAULT_SYSTEM = (
    "You answer questions using the documents provided; some of them may be irrelevant. Quote the evidence "
    f"you use verbatim between {BEGIN_QUOTE} and {END_QUOTE}, then give the final answer after {ANSWER_MARKER} "
    "If the documents do not contain the answer, say so."
)

ANSWER_HINTS = {
    "yes_no_maybe": "Answer with yes, no or maybe.",
    "span": "Answer with a short span copied from the documents.",
    "title": "Answer with the title of the document that holds the evidence.",
    "free": "",
}


# ----------------------------------------------------------------------------------------------- config


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
    max_questions: int | None = None
    max_corpus_docs: int | None = None

    def __post_init__(self) -> None:
        if not self.path:
            raise ValueError(f"data.path is not set for data.format={self.format}; pass data.path=PATH")
        check_at_least("data", self, "max_questions", 2, " (or null for all)", optional=True)
        check_at_least("data", self, "max_corpus_docs", 0, " (or null for all)", optional=True)


@dataclass
class RaftSplitConfig:
    """Held-out evaluation split: a fraction of question groups, by a stable hash.

    ``group_by``: ``oracle`` groups questions that share an oracle document; ``topic`` also groups by
    topic (e.g. SQuAD article title), a stricter split. ``leak_min_chars``: eval answers shorter than
    this (e.g. "yes", "France") are not checked against training documents, since they occur anywhere.
    """

    eval_fraction: float = 0.2
    group_by: Literal["oracle", "topic"] = "oracle"
    salt: str = "judgeloop-raft"
    leak_min_chars: int = 20

    def __post_init__(self) -> None:
        check_range("split", self, "eval_fraction", 0.0, 1.0, hint="; e.g. 0.2")
        check_at_least("split", self, "leak_min_chars", 1)


@dataclass
class HardNegativeConfig:
    """Retriever-mined hard negatives (the retriever issue's miner) for the ``hard`` source."""

    encoder: str = "sentence-transformers/all-MiniLM-L6-v2"
    max_length: int = 256
    batch_size: int = 32
    mining: dict[str, Any] = field(default_factory=dict)  # passed to judgeloop.retrieval.mining.MiningConfig

    def __post_init__(self) -> None:
        check_at_least("distractors.hard", self, "batch_size", 1)


@dataclass
class DistractorConfig:
    """``num_distractors`` per example; each slot picks a source by the weights in ``sources``.

    Sources: ``random``, ``same_source`` (same topic / title; falls back to random where a question has
    no topic), ``bm25`` (question against the split's chunk pool), ``hard`` (retriever-mined). A source
    that runs out falls back to ``random``; the realized mix is in ``stats.json``. ``candidate_depth``
    is how many ranked candidates bm25 / hard keep per question.
    """

    num_distractors: int = 3
    sources: dict[str, float] = field(default_factory=lambda: {"random": 1.0})
    candidate_depth: int = 20
    hard: HardNegativeConfig = field(default_factory=HardNegativeConfig)

    def __post_init__(self) -> None:
        check_at_least("distractors", self, "num_distractors", 0)
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
        check_at_least("distractors", self, "candidate_depth", 1)


@dataclass
class TargetConfig:
    """The assistant turn. ``generator``: ``template`` (quotes + the data set's long answer) or ``lm``
    (a causal LM writes the reasoning; outputs whose quotes are not verbatim fall back to the template).

    ``absent``: what the target says when the oracle is absent - ``abstain`` (``abstain_text`` as the
    answer) or ``answer`` (RAFT's original recipe: say so, then answer anyway).
    """

    generator: Literal["template", "lm"] = "template"
    lm_model: str = "HuggingFaceTB/SmolLM2-135M-Instruct"
    lm_max_new_tokens: int = 96
    lm_batch_size: int = 4
    max_quotes: int = 1
    include_long_answer: bool = True
    absent: Literal["abstain", "answer"] = "abstain"
    abstain_text: str = "The documents do not contain the answer."

    def __post_init__(self) -> None:
        check_at_least("target", self, "max_quotes", 1, "; every answer quotes the oracle")
        if self.lm_max_new_tokens < 8:
            raise ValueError(f"target.lm_max_new_tokens={self.lm_max_new_tokens} is too small; use >= 8")
        if not self.abstain_text.strip():
            raise ValueError("target.abstain_text is empty; give the sentence the model should say")


@dataclass
class PromptConfig:
    """The system prompt of the RAFT chat rows."""

    system: str = DEFAULT_SYSTEM


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
    p_oracle: float = 0.8
    seed: int = 0
    max_length: int | None = 768
    output_dir: str = "runs/raft/pubmedqa"

    def __post_init__(self) -> None:
        check_range("", self, "p_oracle", 0.0, 1.0, "[]", " (RAFT uses 0.8)")
        check_at_least("", self, "max_length", 16, " tokens or null", optional=True)


# ------------------------------------------------------------------------------------------- 1. reading


def _norm(text: str) -> str:
    return " ".join(text.lower().split())


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
        key = _norm(q.question)
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


# ------------------------------------------------------------------------------------------- 2. splitting


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


# ------------------------------------------------------------------------------------------- 3. chunking


_WORD = re.compile(r"[a-z0-9]+")
_STOP = STOPWORDS | frozenset(
    ["after", "been", "before", "between", "during", "no", "our", "there", "we", "yes"]
)  # plus narrative words of abstracts, and PubMedQA's yes/no answers
_SENT = re.compile(r"[^.!?]+(?:[.!?]+|$)")


def _content_words(text: str) -> set[str]:
    return {w for w in _WORD.findall(text.lower()) if w not in _STOP and len(w) > 1}


def _overlap(a: set[str], b: set[str]) -> float:
    return len(a & b) / max(1, len(a))


def chunk_corpus(tokenizer: Any, corpus: Mapping[str, RaftDoc], cfg: ChunkConfig) -> dict[str, list[Chunk]]:
    """``doc_id -> chunks`` (document order) for every document in ``corpus``."""
    return {
        d: chunk_text(tokenizer, d, doc.text, cfg.chunk_tokens, cfg.overlap_tokens)
        for d, doc in corpus.items()
    }


def evidence_reference(q: RaftQuestion) -> str:
    """Text that the evidence should resemble when its position is unknown."""
    return q.long_answer or f"{q.question} {q.answer}"


def oracle_chunk(q: RaftQuestion, chunks: Sequence[Chunk]) -> Chunk:
    """The chunk of the primary oracle document that holds the answer evidence.

    With a known evidence span (SQuAD), the first chunk containing it whole (else the one overlapping it
    most); otherwise the chunk whose content words overlap most with the long answer (or question + answer).
    """
    if not chunks:
        raise ValueError(f"question {q.id}: its oracle document {q.oracle_ids[0]} is empty")
    if q.evidence is not None:
        a, b = q.evidence
        for c in chunks:
            if c.start <= a and b <= c.end:
                return c
        return max(chunks, key=lambda c: (min(b, c.end) - max(a, c.start), -c.index))
    ref = _content_words(evidence_reference(q))
    return max(chunks, key=lambda c: (_overlap(ref, _content_words(c.text)), -c.index))


def sentence_spans(text: str) -> list[tuple[int, int]]:
    """Character spans of sentence-like pieces of ``text`` (stripped; verbatim slices)."""
    spans = []
    for m in _SENT.finditer(text):
        a, b = m.start(), m.end()
        piece = text[a:b]
        a += len(piece) - len(piece.lstrip())
        b -= len(piece) - len(piece.rstrip())
        if b - a >= 3:
            spans.append((a, b))
    return spans


def select_quotes(q: RaftQuestion, chunk: Chunk, max_quotes: int) -> list[str]:
    """Sentences of the oracle chunk to quote (document order), each a verbatim substring of it.

    The sentence holding the known evidence span comes first; the rest are ranked by content-word
    overlap with the long answer (or question + answer).
    """
    spans = sentence_spans(chunk.text)
    if not spans:
        return [chunk.text.strip()]
    ref = _content_words(evidence_reference(q))
    scored = []
    for a, b in spans:
        score = _overlap(ref, _content_words(chunk.text[a:b]))
        if q.evidence is not None:
            ea, eb = q.evidence[0] - chunk.start, q.evidence[1] - chunk.start
            if a <= ea < b or a < eb <= b:
                score += 10.0
        scored.append((score, -a, (a, b)))
    best = sorted(scored, reverse=True)[:max_quotes]
    return [chunk.text[a:b] for _, _, (a, b) in sorted(best, key=lambda t: t[2][0])]


# ---------------------------------------------------------------------------------------- quotes / targets


_QUOTE_RE = re.compile(re.escape(BEGIN_QUOTE) + r"(.*?)" + re.escape(END_QUOTE), re.DOTALL)


def extract_quotes(text: str) -> list[str]:
    """The quoted spans of an answer (stripped)."""
    return [m.strip() for m in _QUOTE_RE.findall(text)]


def quotes_are_verbatim(text: str, source: str | Sequence[str]) -> bool:
    """True when ``text`` has at least one quote and every quote is a substring of ``source``
    (a string, or any of several strings)."""
    sources = [source] if isinstance(source, str) else list(source)
    quotes = extract_quotes(text)
    return bool(quotes) and all(qt and any(qt in s for s in sources) for qt in quotes)


def parse_answer(text: str) -> str | None:
    """The text after the last ``<ANSWER>:`` (first line), or ``None`` when the marker is missing."""
    if ANSWER_MARKER not in text:
        return None
    return text.rsplit(ANSWER_MARKER, 1)[1].strip().split("\n")[0].strip()


class TemplateGenerator:
    """Reasoning from a template: cite the oracle chunk by id, quote it, add the long answer if given."""

    def __init__(self, include_long_answer: bool = True) -> None:
        self.include_long_answer = include_long_answer

    def reasoning(self, items: Sequence[tuple[RaftQuestion, Chunk, list[str]]]) -> list[str]:
        out = []
        for q, chunk, quotes in items:
            quoted = " and ".join(f"{BEGIN_QUOTE}{qt}{END_QUOTE}" for qt in quotes)
            text = f'Document "{chunk.id}" says {quoted}.'
            if self.include_long_answer and q.long_answer:
                text += f" {q.long_answer}"
            elif q.kind in ("span", "title", "free"):
                text += f" So the answer is {q.answer}."
            out.append(text)
        return out


class LMGenerator:
    """Reasoning written by a causal LM (any ``judgeloop.models`` name), greedy and batched.

    The LM sees the oracle chunk, the question and the answer, and is asked to explain while quoting
    the document verbatim. Outputs with no quote, or a quote that is not a substring of the oracle,
    are replaced by the template's reasoning; ``num_fallbacks_`` counts them.
    """

    def __init__(
        self,
        model_name: str,
        max_new_tokens: int = 96,
        batch_size: int = 4,
        fallback: TemplateGenerator | None = None,
    ) -> None:
        self.model = load_causal_lm(model_name).eval()
        self.tokenizer = load_tokenizer(model_name)
        self.tokenizer.padding_side = "left"
        self.max_new_tokens = max_new_tokens
        self.batch_size = batch_size
        self.fallback = fallback or TemplateGenerator()
        self.num_fallbacks_ = 0
        self.num_generated_ = 0

    def _prompt(self, q: RaftQuestion, chunk: Chunk) -> str:
        msg = (
            f"Document:\n{chunk.text}\n\nQuestion: {q.question}\nCorrect answer: {q.answer}\n\n"
            f"Explain in one or two sentences why the answer is correct. Copy the supporting sentence from the "
            f"document exactly, between {BEGIN_QUOTE} and {END_QUOTE}."
        )
        return self.tokenizer.apply_chat_template(
            [{"role": "user", "content": msg}], tokenize=False, add_generation_prompt=True
        )

    def reasoning(self, items: Sequence[tuple[RaftQuestion, Chunk, list[str]]]) -> list[str]:
        import torch

        out: list[str] = []
        for start in range(0, len(items), self.batch_size):
            batch = items[start : start + self.batch_size]
            enc = self.tokenizer(
                [self._prompt(q, c) for q, c, _ in batch],
                return_tensors="pt",
                padding=True,
                add_special_tokens=False,
            )
            with torch.inference_mode():
                gen = self.model.generate(
                    **enc,
                    max_new_tokens=self.max_new_tokens,
                    do_sample=False,
                    pad_token_id=self.tokenizer.pad_token_id,
                )
            texts = self.tokenizer.batch_decode(gen[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
            for (q, chunk, quotes), text in zip(batch, texts):
                self.num_generated_ += 1
                text = text.split(ANSWER_MARKER)[0].strip()
                if quotes_are_verbatim(text, chunk.text):
                    out.append(text)
                else:
                    self.num_fallbacks_ += 1
                    out.append(self.fallback.reasoning([(q, chunk, quotes)])[0])
        return out


def absent_reasoning(q: RaftQuestion, cfg: TargetConfig) -> tuple[str, str]:
    """(reasoning, answer) when the oracle is not among the documents."""
    text = "None of the documents contains evidence that answers this question."
    if cfg.absent == "abstain":
        return text, cfg.abstain_text
    return text + " Answering from background knowledge.", q.answer


def render_target(reasoning: str, answer: str) -> str:
    """The assistant turn: the reasoning, then the answer after the answer marker."""
    return f"{reasoning}\n{ANSWER_MARKER} {answer}"


def render_user(question: str, kind: str, docs: Sequence[tuple[str, str]]) -> str:
    """The user turn: the documents (id + text, in the given order) then the question and answer hint."""
    parts = [f'<DOCUMENT id="{doc_id}">\n{text}\n</DOCUMENT>' for doc_id, text in docs]
    hint = ANSWER_HINTS.get(kind, "")
    parts.append(f"Question: {question}" + (f"\n{hint}" if hint else ""))
    return "\n\n".join(parts)


def render_messages(
    system: str, question: str, kind: str, docs: Sequence[tuple[str, str]], target: str | None = None
) -> list[dict[str, str]]:
    """One RAFT chat row: system, user (documents + question) and, if given, the target."""
    msgs = [
        {"role": "system", "content": system},
        {"role": "user", "content": render_user(question, kind, docs)},
    ]
    if target is not None:
        msgs.append({"role": "assistant", "content": target})
    return msgs


# ---------------------------------------------------------------------------------------- 4. distractors


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


# ------------------------------------------------------------------------------------------ 5. assembly


@dataclass
class RaftBuild:
    """The built data: ``rows[split]`` (messages + meta) and ``stats``."""

    rows: dict[str, list[dict[str, Any]]]
    stats: dict[str, Any]


def _leak_strings(
    eval_qs: Sequence[RaftQuestion], oracle_of: Mapping[str, Chunk], min_chars: int
) -> list[str]:
    out = []
    for q in eval_qs:
        out.append(_norm(q.question))
        out.append(_norm(oracle_of[q.id].text))
        out += _answer_needles(q.kind, q.answer, q.long_answer or "", min_chars)
    return [s for s in out if s]


def _answer_needles(kind: str, answer: str, long_answer: str, min_chars: int) -> list[str]:
    """Answer texts that must not appear in training documents.

    Long answers (reasoning / conclusions) always count when at least ``min_chars`` long. Extracted
    span answers (SQuAD) do not: they are phrases of the oracle that recur across an article's other
    paragraphs by nature (use ``split.group_by=topic`` to keep whole articles apart instead).
    """
    texts = [long_answer] + ([answer] if kind in ("free", "title") else [])
    return [_norm(t) for t in texts if t and len(t.strip()) >= min_chars]


def check_raft_leakage(
    train_rows: Sequence[Mapping[str, Any]], eval_rows: Sequence[Mapping[str, Any]], min_chars: int = 20
) -> None:
    """Raise :class:`LeakageError` if an evaluation question, long answer or oracle chunk appears in
    a training example's documents, or a question id / text is in both splits."""
    train_ids = {r["meta"]["question_id"] for r in train_rows}
    train_q = {_norm(r["meta"]["question"]) for r in train_rows}
    needles: list[tuple[str, str]] = []
    for r in eval_rows:
        m = r["meta"]
        if m["question_id"] in train_ids:
            raise LeakageError(f"question id '{m['question_id']}' is in both the train and eval splits")
        if _norm(m["question"]) in train_q:
            raise LeakageError(
                f"eval question {m['question_id']} ({m['question'][:60]!r}) is also a training question"
            )
        needles.append((m["question_id"], _norm(m["question"])))
        needles.append((m["question_id"], _norm(m["oracle_text"])))
        for needle in _answer_needles(m.get("kind", "free"), m["answer"], m["long_answer"], min_chars):
            needles.append((m["question_id"], needle))
    for r in train_rows:
        m = r["meta"]
        docs = [_norm(t) for t in m["distractor_texts"]]
        if m["oracle_present"]:
            docs.append(_norm(m["oracle_text"]))
        for qid, needle in needles:
            for d in docs:
                if needle and needle in d:
                    raise LeakageError(
                        f"training example {m['question_id']} shows a document containing text of eval question "
                        f"{qid} ({needle[:60]!r}); rebuild with a different split.salt or remove the duplicate document"
                    )


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


def _split_pools(
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
            kept = [c for c in pool if not any(n in _norm(c.text) for n in leak)]
            removed = len(pool) - len(kept)
            pool = kept
        pools[s] = pool
    return pools, removed


def _make_generator(cfg: BuildRaftConfig) -> Any:
    fallback = TemplateGenerator(cfg.target.include_long_answer)
    if cfg.target.generator == "template":
        return fallback
    t = cfg.target
    return LMGenerator(t.lm_model, t.lm_max_new_tokens, t.lm_batch_size, fallback)


@dataclass
class _Tally:
    requested: Counter[str] = field(default_factory=Counter)
    realized: Counter[str] = field(default_factory=Counter)
    short_of_distractors: int = 0


def _example_row(
    q: RaftQuestion, split: str, present: bool, picked: list, order: list[str], oracle: Chunk,
    by_id: Mapping[str, str], reasoning: str, answer: str, system: str,
) -> dict[str, Any]:  # fmt: skip
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


def _build_split(
    cfg: BuildRaftConfig, split: str, qs: Sequence[RaftQuestion], pool: list[Chunk],
    chunks: Mapping[str, list[Chunk]], oracle_of: Mapping[str, Chunk], quotes_of: Mapping[str, list[str]],
    topics: Mapping[str, str | None], gen: Any, tally: _Tally,
) -> list[dict[str, Any]]:  # fmt: skip
    """The rows of one split: distractors per question, the oracle with probability p_oracle, the target."""
    pool_ids = {c.id for c in pool}
    ids_by_text: dict[str, set[str]] = defaultdict(set)
    for c in pool:
        ids_by_text[_norm(c.text)].add(c.id)
    excluded = {}
    for q in qs:
        # Every chunk of its oracle documents, and any chunk with the same text (a duplicate document).
        bad = {c.id for d in q.oracle_ids for c in chunks[d]}
        for d in q.oracle_ids:
            for t in {_norm(c.text) for c in chunks[d]}:
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
    pools, removed_for_leakage = _split_pools(splits, chunks, oracle_of, cfg.split.leak_min_chars)
    topics = {d: doc.topic for d, doc in read.corpus.items()}
    gen = generator if generator is not None else _make_generator(cfg)
    tally = _Tally()
    rows = {
        s: _build_split(cfg, s, splits[s], pools[s], chunks, oracle_of, quotes_of, topics, gen, tally)
        for s in SPLITS
    }
    check_raft_leakage(rows["train"], rows["eval"], cfg.split.leak_min_chars)
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
    }
    if isinstance(gen, LMGenerator):
        stats["lm_generated"] = gen.num_generated_
        stats["lm_fallbacks_to_template"] = gen.num_fallbacks_
    return RaftBuild(rows, stats)


def _count_tokens(tokenizer: Any, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool) -> int:
    text = tokenizer.apply_chat_template(
        list(messages), tokenize=False, add_generation_prompt=add_generation_prompt
    )
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def save_raft(build: RaftBuild, output_dir: str | Path, config: Any | None = None) -> Path:
    """Write ``train.jsonl``, ``eval.jsonl``, ``dataset/`` (a ``datasets.DatasetDict``), ``stats.json``
    (and ``config.yaml`` when ``config`` is given), each atomically."""
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
    if config is not None:
        from judgeloop.config import to_yaml

        atomic_write_text(out / "config.yaml", to_yaml(config))
    return out
