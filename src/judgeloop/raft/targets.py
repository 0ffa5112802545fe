"""Step 6 of the RAFT build (:mod:`judgeloop.raft.builder`): the assistant turn. A target generator
(:class:`TemplateGenerator` or :class:`LMGenerator`) writes reasoning that quotes the oracle chunk verbatim
between ``##begin_quote##`` / ``##end_quote##`` (the sentences :func:`select_quotes` picks), then
``<ANSWER>: ...``; every quote is checked to be a substring of the oracle chunk. The chat rows (system /
user / assistant) are rendered here too, for the build and for ``judgeloop eval-raft``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from judgeloop.config import bounded, check_fields
from judgeloop.models import load_causal_lm, load_tokenizer
from judgeloop.raft.chunking import Chunk, content_words, evidence_reference, word_overlap
from judgeloop.raft.readers import RaftQuestion

BEGIN_QUOTE = "##begin_quote##"
END_QUOTE = "##end_quote##"
ANSWER_MARKER = "<ANSWER>:"

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


@dataclass
class TargetConfig:
    """The assistant turn. ``generator``: ``template`` (quotes + the data set's long answer) or ``lm``
    (a causal LM writes the reasoning; outputs whose quotes are not verbatim fall back to the template).

    ``absent``: what the target says when the oracle is absent - ``abstain`` (``abstain_text`` as the
    answer) or ``answer`` (RAFT's original recipe: say so, then answer anyway).
    """

    generator: Literal["template", "lm"] = "template"
    lm_model: str = "HuggingFaceTB/SmolLM2-135M-Instruct"
    lm_max_new_tokens: int = bounded(96, ge=8, message="{key}={value} is too small; use >= 8")
    lm_batch_size: int = bounded(4, ge=0)
    max_quotes: int = bounded(1, ge=1, hint="; every answer quotes the oracle", shape="section")
    include_long_answer: bool = True
    absent: Literal["abstain", "answer"] = "abstain"
    abstain_text: str = "The documents do not contain the answer."

    def __post_init__(self) -> None:
        check_fields("target", self)
        if not self.abstain_text.strip():
            raise ValueError("target.abstain_text is empty; give the sentence the model should say")


@dataclass
class PromptConfig:
    """The system prompt of the RAFT chat rows."""

    system: str = DEFAULT_SYSTEM


_SENT = re.compile(r"[^.!?]+(?:[.!?]+|$)")


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
    ref = content_words(evidence_reference(q))
    scored = []
    for a, b in spans:
        score = word_overlap(ref, content_words(chunk.text[a:b]))
        if q.evidence is not None:
            ea, eb = q.evidence[0] - chunk.start, q.evidence[1] - chunk.start
            if a <= ea < b or a < eb <= b:
                score += 10.0
        scored.append((score, -a, (a, b)))
    best = sorted(scored, reverse=True)[:max_quotes]
    return [chunk.text[a:b] for _, _, (a, b) in sorted(best, key=lambda t: t[2][0])]


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


def render_user(
    question: str, kind: str, docs: Sequence[tuple[str, str]], marks: Mapping[str, str] | None = None
) -> str:
    """The user turn: the documents (id + text, in the given order) then the question and answer hint.
    ``marks``: doc id -> evidence mark (:mod:`judgeloop.raft.marks`), written as the opening tag's
    ``retrieval`` attribute; a document without one gets none."""
    parts = []
    for doc_id, text in docs:
        mark = (marks or {}).get(doc_id)
        attr = f' retrieval="{mark}"' if mark else ""
        parts.append(f'<DOCUMENT id="{doc_id}"{attr}>\n{text}\n</DOCUMENT>')
    hint = ANSWER_HINTS.get(kind, "")
    parts.append(f"Question: {question}" + (f"\n{hint}" if hint else ""))
    return "\n\n".join(parts)


def render_messages(
    system: str,
    question: str,
    kind: str,
    docs: Sequence[tuple[str, str]],
    target: str | None = None,
    marks: Mapping[str, str] | None = None,
) -> list[dict[str, str]]:
    """One RAFT chat row: system, user (documents + question, marked when ``marks`` is given) and, if
    given, the target."""
    msgs = [
        {"role": "system", "content": system},
        {"role": "user", "content": render_user(question, kind, docs, marks)},
    ]
    if target is not None:
        msgs.append({"role": "assistant", "content": target})
    return msgs


def make_generator(t: TargetConfig) -> TemplateGenerator | LMGenerator:
    """The generator ``target.generator`` names (the template is also the LM's fallback)."""
    fallback = TemplateGenerator(t.include_long_answer)
    if t.generator == "template":
        return fallback
    return LMGenerator(t.lm_model, t.lm_max_new_tokens, t.lm_batch_size, fallback)
