"""Split documents into overlapping windows of tokens (not characters), keeping every chunk verbatim.

A chunk is a window of ``chunk_tokens`` tokens of a given tokenizer; consecutive windows share
``overlap_tokens`` tokens. The chunk's text is the slice of the original document between the
character offsets of its first and last token, so a chunk is always a verbatim substring of the
document (quotes checked against a chunk are therefore also verbatim in the source).

Step 3 of the RAFT build (:mod:`judgeloop.raft.builder`) chunks the corpus (:func:`chunk_corpus`) and picks
each question's oracle chunk, the one that holds the answer evidence (:func:`oracle_chunk`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from judgeloop.config import bounded, check_fields
from judgeloop.raft.readers import RaftDoc, RaftQuestion
from judgeloop.text import STOPWORDS


@dataclass(frozen=True)
class Chunk:
    """A verbatim piece of a document: ``doc_text[start:end] == text``; ``id`` is ``"{doc_id}#{index}"``."""

    id: str
    doc_id: str
    index: int
    text: str
    start: int
    end: int
    num_tokens: int


@dataclass
class ChunkConfig:
    """Token windows: ``chunk_tokens`` per chunk, ``overlap_tokens`` shared by neighbours."""

    tokenizer: str = "HuggingFaceTB/SmolLM2-135M-Instruct"
    chunk_tokens: int = bounded(128, ge=8, message="{key}={value} is too small; use at least 8 tokens")
    overlap_tokens: int = 16

    def __post_init__(self) -> None:
        check_fields("chunk", self)
        if not 0 <= self.overlap_tokens < self.chunk_tokens:
            raise ValueError(
                f"chunk.overlap_tokens={self.overlap_tokens} must be in [0, chunk_tokens={self.chunk_tokens}); "
                "lower the overlap or raise chunk_tokens"
            )


def _token_char_spans(tokenizer: Any, text: str) -> list[tuple[int, int]]:
    """Character span of each token of ``text`` (no special tokens); needs a fast tokenizer."""
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError(
            f"chunk.tokenizer {type(tokenizer).__name__} is not a fast tokenizer; token chunking needs "
            "character offsets, so use a tokenizer with a tokenizers backend"
        )
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    spans = [(int(a), int(b)) for a, b in enc["offset_mapping"]]
    # Byte-level BPE offsets can include a leading space in the token; that is fine for slicing.
    return [(a, b) for a, b in spans if b > a]


def chunk_text(tokenizer: Any, doc_id: str, text: str, chunk_tokens: int, overlap_tokens: int) -> list[Chunk]:
    """Cut ``text`` into windows of ``chunk_tokens`` tokens with ``overlap_tokens`` overlap.

    Args:
        tokenizer: a Hugging Face fast tokenizer (offsets are needed to slice the original text).
        doc_id: id of the document; chunk ids are ``f"{doc_id}#{i}"`` and do not depend on anything else.
        text: the document.
        chunk_tokens: window length in tokens.
        overlap_tokens: tokens shared by consecutive windows (stride = chunk_tokens - overlap_tokens).

    Returns:
        Chunks in document order; an empty or whitespace-only text gives no chunk. The last window is
        not padded: it holds whatever tokens remain (a document shorter than a window is one chunk).
    """
    if not 0 <= overlap_tokens < chunk_tokens:
        raise ValueError(f"overlap_tokens={overlap_tokens} must be in [0, chunk_tokens={chunk_tokens})")
    spans = _token_char_spans(tokenizer, text)
    if not spans:
        return []
    stride = chunk_tokens - overlap_tokens
    chunks: list[Chunk] = []
    start_tok = 0
    while True:
        window = spans[start_tok : start_tok + chunk_tokens]
        a, b = window[0][0], window[-1][1]
        piece = text[a:b]
        # Trim surrounding whitespace but keep offsets consistent, so text == doc[start:end] holds.
        lead = len(piece) - len(piece.lstrip())
        trail = len(piece) - len(piece.rstrip())
        a, b = a + lead, b - trail
        chunks.append(
            Chunk(
                id=f"{doc_id}#{len(chunks)}",
                doc_id=doc_id,
                index=len(chunks),
                text=text[a:b],
                start=a,
                end=b,
                num_tokens=len(window),
            )
        )
        if start_tok + chunk_tokens >= len(spans):
            break
        start_tok += stride
    return chunks


# The oracle chunk: the one that holds the answer evidence (step 3 of :mod:`judgeloop.raft.builder`).

_WORD = re.compile(r"[a-z0-9]+")
_STOP = STOPWORDS | frozenset(
    ["after", "been", "before", "between", "during", "no", "our", "there", "we", "yes"]
)  # plus narrative words of abstracts, and PubMedQA's yes/no answers


def content_words(text: str) -> set[str]:
    """The lower-cased words of ``text`` that carry its topic (no stop words, no single letters)."""
    return {w for w in _WORD.findall(text.lower()) if w not in _STOP and len(w) > 1}


def word_overlap(a: set[str], b: set[str]) -> float:
    """The share of ``a``'s words that ``b`` holds."""
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
    ref = content_words(evidence_reference(q))
    return max(chunks, key=lambda c: (word_overlap(ref, content_words(c.text)), -c.index))
