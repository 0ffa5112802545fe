"""The ``served`` judge: the ``choice`` judge's verdict logit read from a server instead of a local model.

The prompt is rendered and tokenized here exactly as :class:`~judgeloop.judges.choice.ChoiceJudge` does
(``judge.model`` names the tokenizer: the served model's own), then sent as token ids, so the server
scores the very tokens the in-process judge would: ``s = log P(verdict A) - log P(verdict B)`` at the
answer position, both orders by default (``base.combine_orders``). Both orders of every pair of a batch
are in flight together, so a server with a prefix cache (vLLM, SGLang) computes the shared article once.

Statuses beyond the base ones (``base.STATUSES``):

* ``outside_topk`` (valid): on the ``top_logprobs`` route one verdict token was not in the returned top
  k; its log-probability is at most the k-th one, so the score is that bound (``s >= bound`` when A is
  the missing token's rival, ``s <= -bound`` the other way): never a silent 0;
* ``text_only`` (valid): the server returned no log-probabilities; the sampled verdict is a hard label,
  scored ``+1`` (A) or ``-1`` (B) for a calibrator to map to its accuracy;
* ``unparsed`` (masked): neither verdict token can be read (both outside the top k, or another text);
* ``failed`` (masked): the call failed after its retries (``judge.server.on_failure``: ``mask`` counts
  and logs it, ``stop`` raises).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from judgeloop.judges.base import Judge, Pair
from judgeloop.judges.choice import verdict_token_ids
from judgeloop.judges.prompts import get_prompt, has_chat_template, render_chat
from judgeloop.judges.served_client import Reply, ServedClient, ServerConfig, read_api_key
from judgeloop.judges.tokens import fit_article
from judgeloop.logging import get_logger

logger = get_logger(__name__)

SERVED_STATUSES = ("outside_topk", "text_only", "unparsed", "failed")
TEXT_LOGIT = 1.0  # the score of a hard text verdict: +1 for A, -1 for B


def verdict_score(reply: Reply, verdict_ids: tuple[int, int], labels: tuple[str, str]) -> tuple[float, str]:
    """``(score, status)`` of one reply (see the module docstring for the statuses)."""
    if reply.error:
        return math.nan, "failed"
    if reply.logprobs is None:
        text = reply.text.strip()
        if text in labels:
            return (TEXT_LOGIT if text == labels[0] else -TEXT_LOGIT), "text_only"
        return math.nan, "unparsed"
    la, lb = (reply.logprobs.get(t) for t in verdict_ids)
    if la is not None and lb is not None:
        return la - lb, "ok"
    if reply.bound is not None and (la is not None or lb is not None):
        # the missing token's log-probability is at most the k-th returned one
        return (la - reply.bound if la is not None else reply.bound - lb), "outside_topk"  # type: ignore[operator]
    return math.nan, "unparsed"


class ServedJudge(Judge):
    """Pairwise judge reading verdict-token log-probabilities from a vLLM / SGLang / OpenAI-style server.

    Args:
        server: the ``judge.server`` settings.
        tokenizer: the served model's tokenizer (hub id or path; the prompts are tokenized here).
        prompt, verdict_tokens, position_debias, batch_size, max_length, cache_size: as for the
            ``choice`` judge.

    Raises:
        ValueError: before any judging, one line each: no ``base_url`` or ``model``, an unset API key, no
            server at the URL, a model it does not serve, a verdict that is not one token.
    """

    def __init__(
        self,
        server: ServerConfig,
        tokenizer: str | Any,
        prompt: str = "neutral",
        verdict_tokens: Sequence[str] = ("A", "B"),
        position_debias: bool = True,
        batch_size: int = 8,
        max_length: int = 2048,
        cache_size: int = 100_000,
    ):
        from judgeloop.models import load_tokenizer

        if not server.base_url or not server.model:
            raise ValueError(
                f"judge.type=served needs judge.server.base_url and judge.server.model (got "
                f"{server.base_url!r}, {server.model!r}); e.g. base_url=http://localhost:8000"
            )
        self.prompt = get_prompt(prompt)
        self.tokenizer = load_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
        self.verdict_ids = verdict_token_ids(self.tokenizer, verdict_tokens)
        self.labels = (verdict_tokens[0].strip(), verdict_tokens[1].strip())
        self.max_length = max_length
        self._chat = has_chat_template(self.tokenizer)
        self.client = ServedClient(server, self.verdict_ids, read_api_key(server), self._detokenize)
        self.client.connect()
        self._token_ids = {self.tokenizer.convert_ids_to_tokens(t): t for t in self.verdict_ids}
        self._token_ids.update({self.tokenizer.decode([t]): t for t in self.verdict_ids})
        self._replies: dict[tuple[int, ...], Reply] = {}
        self.failures: list[str] = []
        name = f"served|{server.base_url}|{server.model}|{prompt}|{verdict_tokens[0]}|{verdict_tokens[1]}|{max_length}"
        super().__init__(name, position_debias=position_debias, batch_size=batch_size, cache_size=cache_size)

    def _detokenize(self, ids: Sequence[int]) -> str:
        """The text of ``ids`` with special tokens as written (for a server that takes text prompts)."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)

    @property
    def route(self) -> str:
        """The route in use (empty until the first call when ``route: auto``)."""
        return self.client.route

    def describe(self) -> dict[str, Any]:
        """What a saved judge records of its server: model id, what the server reports, route, token ids."""
        return {
            **self.client.info,
            "route": self.route,
            "prompt_format": self.client.prompt_format,
            "top_logprobs": self.client.cfg.top_logprobs,
            "verdict_token_ids": list(self.verdict_ids),
        }

    def render(self, article: str, a: str, b: str) -> str:
        """The full judge prompt text for one order, up to the answer position (as the choice judge's)."""
        user = self.prompt.choice_text(article, a, b, self.labels)
        return render_chat(self.tokenizer, self.prompt.system, user) + self.prompt.answer_prefix

    def prompt_ids(self, pair: Pair) -> tuple[list[int] | None, str]:
        """Token ids of the judge prompt of ``pair`` (article cut to fit ``max_length``) and its status."""

        def render_ids(article: str) -> list[int]:
            return self.tokenizer.encode(
                self.render(article, pair.a, pair.b), add_special_tokens=not self._chat
            )

        ids, status, _ = fit_article(render_ids, self.tokenizer, pair.article, self.max_length)
        return ids, status

    def _score(self, pairs: list[Pair]) -> Any:
        """Send every prompt of the batch (both orders) at once, then score them as the base class does."""
        orders = pairs + ([p.swapped() for p in pairs] if self.position_debias else [])
        todo = []
        for p in orders:
            if p.a.strip() and p.b.strip() and not (self.cache_size and self._key(p) in self._cache):
                ids, _ = self.prompt_ids(p)
                if ids is not None and tuple(ids) not in self._replies:
                    todo.append(ids)
        if todo:
            self._replies.update(zip(map(tuple, todo), self.client.replies(todo, self._token_ids)))
        try:
            out = super()._score(pairs)
        finally:
            self._replies.clear()
        for p in orders:  # a failed call is tried again next time, never remembered as a judgement
            key = self._key(p)
            if self._cache.get(key, (0.0, ""))[1] == "failed":
                del self._cache[key]
        self._report_failures(out.status)
        return out

    def _report_failures(self, status: list[str]) -> None:
        failed = status.count("failed")
        if not failed:
            return
        first = self.failures[0] if self.failures else "?"
        message = (
            f"served judge: {failed} of {len(status)} pairs failed at {self.client.cfg.base_url} (first error: "
            f"{first}); they are masked (no score, no reward)"
        )
        if self.client.cfg.on_failure == "stop":
            raise RuntimeError(message.replace("they are masked", "judge.server.on_failure=stop"))
        logger.warning(message)

    def _score_ordered(self, pairs: Sequence[Pair]) -> tuple[list[float], list[str]]:
        scores, statuses = [], []
        for p in pairs:
            ids, status = self.prompt_ids(p)
            if ids is None:
                scores.append(math.nan)
                statuses.append(status)
                continue
            reply = self._replies.get(tuple(ids))
            if reply is None:
                reply = self.client.replies([ids], self._token_ids)[0]
            if reply.error:
                self.failures.append(reply.error)
            score, st = verdict_score(reply, self.verdict_ids, self.labels)
            scores.append(score)
            statuses.append(st if st != "ok" else status)
        return scores, statuses


__all__ = ["SERVED_STATUSES", "ServedJudge", "verdict_score"]
