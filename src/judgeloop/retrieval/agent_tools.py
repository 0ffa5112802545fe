"""The retrieval agent's toolbox (:class:`judgeloop.retrieval.agent.Toolbox`) over a corpus: exact dense
search (a bi-encoder, corpus embeddings through the embedding cache), BM25 (:mod:`judgeloop.retrieval.bm25`),
and one causal LM that rewrites, writes hypothetical passages, decomposes and reads.

Every LM output is kept in an append-only JSONL cache (:class:`LMCache`, one row per prompt, keyed by the
model, the generation length and the prompt's text), flushed after each batch: a killed run restarted on
the same folder reads what was generated and continues where it stopped, and a replay gets the same
outputs (greedy decoding). :meth:`CorpusToolbox.prefetch` fills the cache in batches before the loop runs
question by question.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from judgeloop.hashing import json_digest
from judgeloop.logging import get_logger
from judgeloop.retrieval.agent import LMOutput
from judgeloop.retrieval.escalation import REWRITE_PROMPT

logger = get_logger(__name__)

__all__ = ["AGENT_PROMPTS", "CorpusToolbox", "LMCache", "LMSettings"]

AGENT_PROMPTS = {
    "rewrite": REWRITE_PROMPT,
    "hyde": (
        "Write two sentences of a passage that answers this question, as a reference text would state "
        "it. No introduction.\nQuestion: {query}"
    ),
    "decompose": (
        "Split this question into at most two simpler sub-questions that together answer it. Reply with "
        "one sub-question per line, nothing else.\nQuestion: {query}"
    ),
}


@dataclass
class LMSettings:
    """Generation lengths per LM action and the reader's instruction."""

    rewrite_max_new_tokens: int = 24
    hyde_max_new_tokens: int = 48
    decompose_max_new_tokens: int = 40
    answer_max_new_tokens: int = 12
    batch_size: int = 8
    max_passage_tokens: int = 160  # each passage is cut to this many tokens in the reader's prompt
    instruction: str = (
        ""  # the reader's instruction (routing.llm: SHORT_ANSWER, YES_NO_MAYBE, EXTRACT_ANSWER)
    )

    def max_new(self, action: str) -> int:
        return int(getattr(self, f"{action}_max_new_tokens"))


class LMCache:
    """Prompt -> :class:`LMOutput` rows in ``path`` (JSONL, appended and flushed per batch)."""

    def __init__(self, path: str | Path | None, model_name: str) -> None:
        self.path = Path(path) if path is not None else None
        self.model_name = model_name
        self.rows: dict[str, LMOutput] = {}
        if self.path is not None and self.path.is_file():
            for line in self.path.read_text().splitlines():
                try:
                    r = json.loads(line)
                except json.JSONDecodeError:  # a line cut by a kill: regenerated
                    continue
                lp = r.get("logprob_mean")
                self.rows[r["key"]] = LMOutput(
                    r["text"], int(r["tokens"]), float(r["seconds"]), math.nan if lp is None else float(lp)
                )
            logger.info("LM cache: %d outputs read from %s", len(self.rows), self.path)

    def key(self, prompt: str, max_new_tokens: int) -> str:
        return json_digest([self.model_name, max_new_tokens, prompt])

    def add(self, keys: Sequence[str], outs: Sequence[LMOutput]) -> None:
        lines = []
        for k, o in zip(keys, outs):
            self.rows[k] = o
            lp = o.logprob_mean if math.isfinite(o.logprob_mean) else None
            lines.append(
                json.dumps(
                    {"key": k, "text": o.text, "tokens": o.tokens, "seconds": o.seconds, "logprob_mean": lp}
                )
            )
        if self.path is not None and lines:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.path.open("a") as f:
                f.write("\n".join(lines) + "\n")
                f.flush()


class CorpusToolbox:
    """Dense and BM25 search over ``doc_texts`` and one LM (``model``, ``tokenizer``) with a cache.

    Args:
        doc_ids, doc_texts: the corpus, in the order of ``corpus_emb`` rows.
        corpus_emb: ``(N, D)`` L2-normalized document embeddings.
        encode_query: texts -> ``(Q, D)`` normalized embeddings (the same encoder, query side).
        bm25: a :func:`judgeloop.retrieval.bm25.build_bm25` index over ``doc_texts``.
        model, tokenizer: the causal LM (None: no LM; then only ``dense``, ``bm25``, ``fuse`` and the
            evidence-only answer work).
        cache: the :class:`LMCache`.
        settings: :class:`LMSettings`.
        reads: ``False``: the answer is the window itself (a claim's evidence, BEIR), no LM call.
    """

    def __init__(
        self,
        doc_ids: Sequence[str],
        doc_texts: Sequence[str],
        corpus_emb: np.ndarray,
        encode_query: Any,
        bm25: Any,
        model: Any = None,
        tokenizer: Any = None,
        cache: LMCache | None = None,
        settings: LMSettings | None = None,
        reads: bool = True,
    ) -> None:
        self.doc_ids, self.doc_texts = list(doc_ids), list(doc_texts)
        self.corpus_emb = corpus_emb
        self.encode_query = encode_query
        self.bm25 = bm25
        self.model, self.tokenizer = model, tokenizer
        self.cache = cache if cache is not None else LMCache(None, "none")
        self.settings = settings or LMSettings()
        self.reads = reads
        self._query_emb: dict[str, np.ndarray] = {}
        self._cut: dict[int, str] = {}

    # -- retrieval ---------------------------------------------------------------------------------
    def query_embedding(self, texts: Sequence[str]) -> np.ndarray:
        """``(Q, D)`` query embeddings, memoized per text."""
        todo = [t for t in dict.fromkeys(texts) if t not in self._query_emb]
        if todo:
            for t, e in zip(todo, self.encode_query(todo)):
                self._query_emb[t] = np.asarray(e, dtype=np.float32)
        return np.stack([self._query_emb[t] for t in texts]) if texts else np.zeros((0, 1))

    def similarity(self, query: str, docs: Sequence[int]) -> np.ndarray:
        """Cosine similarity of ``query`` to the corpus documents ``docs``."""
        q = self.query_embedding([query])[0]
        return self.corpus_emb[list(docs)] @ q if len(docs) else np.zeros(0)

    def retrieve(self, retriever: str, query: str, depth: int) -> tuple[list[int], list[float]]:
        k = min(depth, len(self.doc_ids))
        if retriever == "dense":
            s = self.corpus_emb @ self.query_embedding([query])[0]  # (N,)
            idx = np.argsort(-s, kind="stable")[:k]
            return idx.tolist(), s[idx].tolist()
        if retriever == "bm25":
            from judgeloop.retrieval.bm25 import bm25_topk

            scores, idx = bm25_topk(self.bm25, [query], k)
            return idx[0].tolist(), scores[0].tolist()
        raise ValueError(f"retriever {retriever!r} is not 'dense' or 'bm25'")

    def doc_id(self, index: int) -> str:
        return self.doc_ids[int(index)]

    # -- the language model ------------------------------------------------------------------------
    def _passage(self, i: int) -> str:
        """Document ``i`` cut to ``max_passage_tokens`` tokens."""
        if i not in self._cut:
            ids = self.tokenizer(self.doc_texts[i], add_special_tokens=False)["input_ids"]
            n = self.settings.max_passage_tokens
            self._cut[i] = self.doc_texts[i] if len(ids) <= n else self.tokenizer.decode(ids[:n])
        return self._cut[i]

    def prompt(self, action: str, question: str, passages: Sequence[int] = ()) -> str:
        """The user message of an LM action, or of the reader (``answer``) with ``passages``."""
        if action == "answer":
            from judgeloop.routing.llm import RAG, render_passages

            return RAG.format(
                instruction=self.settings.instruction,
                passages=render_passages([self._passage(i) for i in passages]),
                question=question,
            )
        return AGENT_PROMPTS[action].format(query=question)

    def lm_bound(self, action: str, question: str, passages: Sequence[int] = ()) -> int:
        if action == "answer" and not self.reads:
            return 0
        self._need_lm(action)
        from judgeloop.routing.llm import chat_prompt

        text = chat_prompt(self.tokenizer, self.prompt(action, question, passages))
        n = len(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        return n + self.settings.max_new(action)

    def _need_lm(self, action: str) -> None:
        if self.model is None:
            raise ValueError(
                f"action {action!r} needs a language model; set model.name or drop it from the menu"
            )

    def _run(self, action: str, prompts: Sequence[str]) -> list[LMOutput]:
        """LM outputs for ``prompts`` (user messages), generated in batches where not cached."""
        from judgeloop.routing.llm import generate

        n_new = self.settings.max_new(action)
        keys = [self.cache.key(p, n_new) for p in prompts]
        todo = list(dict.fromkeys(k for k in keys if k not in self.cache.rows))
        if todo:
            self._need_lm(action)
            by_key = dict(zip(keys, prompts))
            b = self.settings.batch_size
            for start in range(0, len(todo), b):
                chunk = todo[start : start + b]
                gens = generate(self.model, self.tokenizer, [by_key[k] for k in chunk], n_new, b, desc=action)
                self.cache.add(
                    chunk,
                    [
                        LMOutput(
                            g.raw.strip() if action != "answer" else g.text,
                            g.prompt_tokens + g.new_tokens,
                            g.seconds,
                            g.logprob_mean,
                        )
                        for g in gens
                    ],
                )
        return [self.cache.rows[k] for k in keys]

    def generate(self, action: str, question: str) -> LMOutput:
        return self._run(action, [self.prompt(action, question)])[0]

    def answer(self, question: str, passages: Sequence[int]) -> LMOutput:
        if not self.reads:  # the evidence is the answer: the window's documents
            return LMOutput(" ".join(self.doc_id(i) for i in passages), 0, 0.0)
        from judgeloop.routing.llm import strip_answer_label

        out = self._run("answer", [self.prompt("answer", question, passages)])[0]
        return LMOutput(strip_answer_label(out.text), out.tokens, out.seconds, out.logprob_mean)

    def prefetch(self, action: str, questions: Sequence[str], passages: Sequence[Sequence[int]] = ()) -> None:
        """Fill the cache for ``action`` on many questions (with their windows for ``answer``) in batches."""
        if action == "answer" and not self.reads:
            return
        t0 = time.perf_counter()
        if action == "answer":
            prompts = [self.prompt("answer", q, p) for q, p in zip(questions, passages)]
        else:
            prompts = [self.prompt(action, q) for q in questions]
        self._run(action, prompts)
        logger.info("%s: %d prompts ready (%.1fs)", action, len(prompts), time.perf_counter() - t0)
