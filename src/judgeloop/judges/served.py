"""The ``served`` judge: the ``choice`` judge's verdict logit read from a server instead of a local model.

The prompt is rendered and tokenized here exactly as :class:`~judgeloop.judges.choice.ChoiceJudge` does
(``judge.model`` names the tokenizer: the served model's own), then sent as token ids, so the server
scores the very tokens the in-process judge would: ``s = log P(verdict A) - log P(verdict B)`` at the
answer position, both orders by default (``base.combine_orders``). Both orders of every pair of a batch
are in flight together, so a server with a prefix cache (vLLM, SGLang) computes the shared article once.

Statuses beyond the base ones (listed in :mod:`judgeloop.judges.base`):

* ``outside_topk`` (valid): on the ``top_logprobs`` route one verdict token was not in the returned top
  k; its log-probability is at most the k-th one, so the score is that bound (``s >= bound`` when A is
  the missing token's rival, ``s <= -bound`` the other way): never a silent 0;
* ``text_only`` (valid): the server returned no log-probabilities; the sampled verdict is a hard label,
  scored ``+1`` (A) or ``-1`` (B) for a calibrator to map to its accuracy;
* ``unparsed`` (masked): neither verdict token can be read (both outside the top k, or another text);
* ``failed`` (masked): the call failed after its retries (``judge.server.on_failure``: ``mask`` counts
  and logs it, ``stop`` raises);
* ``low_label_mass`` (valid): the labels (verdict or grade tokens) hold less than
  ``judge.server.min_label_mass`` of the next-token probability: the model mostly wanted to say something
  else, and the verdict read from what is left is scored but counted apart. The mass of every reply that
  gives it (all routes but ``text`` and a ``top_logprobs`` reply missing a label) is in ``stats.label_mass``.

On the decision routes (``decisions``, ``systemone``) the server renders its own prompt: the article is the
state, and each order of a pair one choice question (``prompts.JudgePrompt.decision_text``) whose options
``Summary A``, ``Summary B`` it labels ``A``, ``B``; the verdict logit is ``log p_A - log p_B`` of its
answer, and every order of every pair of an article goes in one request.

``judge.extractor: graded`` (:class:`GradedJudge`) is the rubric judge users already run, read the same
way: each summary alone in a pointwise prompt (``prompts.GRADE_TEMPLATE``), the grade tokens ``1`` to
``K`` (``judge.grades``) read from the server, the expected grade ``sum_k k p_k`` over their renormalized
probabilities, and the pair's logit the difference of the two expected grades (no order, so no
debiasing). On the ``top_logprobs`` route grades outside the top k count as 0 (status ``outside_topk``);
a text-only reply that is a grade scores as that grade (``text_only``).

``judge.extractor: likelihood`` (:class:`ServedLikelihoodJudge`) is the ``likelihood`` judge read from a
server: the ids of :func:`~judgeloop.judges.likelihood.likelihood_ids` (the summarize prompt, then the
summary) sent whole, the summary tokens' log-probabilities read back from the server's prompt
log-probabilities (vLLM ``prompt_logprobs``, SGLang ``logprob_start_len``), their mean the summary's value
and a pair's logit the difference of its two values. A server that returns no prompt log-probabilities is
refused before any judging (no text fallback).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from judgeloop.judges.base import VALID_STATUSES, Judge, Pair, PointwiseJudge, merge_status
from judgeloop.judges.choice import verdict_token_ids
from judgeloop.judges.likelihood import likelihood_ids
from judgeloop.judges.prompts import get_prompt, has_chat_template, render_chat, render_choice
from judgeloop.judges.served_client import (
    Question,
    Reply,
    ServedClient,
    ServedJudgeFailed,
    ServerConfig,
    check_served,
    label_mass,
    read_api_key,
)
from judgeloop.judges.tokens import fit_article
from judgeloop.logging import get_logger

logger = get_logger(__name__)

SERVED_STATUSES = ("low_label_mass", "outside_topk", "text_only", "unparsed", "failed")
TEXT_LOGIT = 1.0  # the score of a hard text verdict: +1 for A, -1 for B


def verdict_score(
    reply: Reply, verdict_ids: tuple[int, int], labels: tuple[str, str], min_label_mass: float = 0.0
) -> tuple[float, str]:
    """``(score, status)`` of one reply (see the module docstring for the statuses); ``min_label_mass``:
    below it an exact verdict is ``low_label_mass``."""
    if reply.error:
        return math.nan, "failed"
    if reply.logprobs is None:
        text = reply.text.strip()
        if text in labels:
            return (TEXT_LOGIT if text == labels[0] else -TEXT_LOGIT), "text_only"
        return math.nan, "unparsed"
    la, lb = (reply.logprobs.get(t) for t in verdict_ids)
    if la is not None and lb is not None:
        mass = label_mass(reply, verdict_ids)
        return la - lb, ("low_label_mass" if mass is not None and mass < min_label_mass else "ok")
    if reply.bound is not None and (la is not None or lb is not None):
        # the missing token's log-probability is at most the k-th returned one
        return (la - reply.bound if la is not None else reply.bound - lb), "outside_topk"  # type: ignore[operator]
    return math.nan, "unparsed"


def expected_grade(reply: Reply, grade_ids: Sequence[int], min_label_mass: float = 0.0) -> tuple[float, str]:
    """``(expected grade, status)`` of one graded reply: ``sum_k k p_k`` over grades ``1..K`` (``grade_ids``
    in order), their probabilities renormalized over the grades the reply returned; ``low_label_mass`` when
    all grades are read and hold less than ``min_label_mass`` of the probability."""
    if reply.error:
        return math.nan, "failed"
    if reply.logprobs is None:
        text = reply.text.strip()
        if text.isdigit() and 1 <= int(text) <= len(grade_ids):
            return float(text), "text_only"
        return math.nan, "unparsed"
    got = [(k, reply.logprobs[t]) for k, t in enumerate(grade_ids, start=1) if t in reply.logprobs]
    if not got:
        return math.nan, "unparsed"
    top = max(lp for _, lp in got)
    weights = [(k, math.exp(lp - top)) for k, lp in got]
    total = sum(w for _, w in weights)
    if len(got) < len(grade_ids):
        return sum(k * w for k, w in weights) / total, "outside_topk"
    mass = label_mass(reply, grade_ids)
    low = mass is not None and mass < min_label_mass
    return sum(k * w for k, w in weights) / total, ("low_label_mass" if low else "ok")


def single_token_ids(tokenizer: Any, labels: Sequence[str], key: str) -> tuple[int, ...]:
    """Ids of ``labels``, each exactly one token of ``tokenizer``; one line naming ``key`` otherwise."""
    ids = []
    for label in labels:
        enc = tokenizer.encode(label, add_special_tokens=False)
        if len(enc) != 1:
            raise ValueError(
                f"{key}: {label!r} is {len(enc)} tokens {tokenizer.convert_ids_to_tokens(enc)} for this "
                "tokenizer; each must be a single token"
            )
        ids.append(enc[0])
    return tuple(ids)


class _ServedParts:
    """What every served extractor shares: the client, its route, the record a saved judge keeps of its
    server, and failed calls (masked, never cached, counted in one warning or raised)."""

    client: ServedClient
    tokenizer: Any
    extractor: str = "verdict"

    def _set_up(self, server: ServerConfig, tokenizer: str | Any, prompt: str, max_length: int) -> None:
        """What every served extractor sets up before it connects: the server settings checked, the prompt,
        the served model's tokenizer (loaded from a hub id or path), the length budget. (Not named
        ``_prepare``: that is the base judge's hook for work a training loop prefetches, and a served judge
        has none.)"""
        from judgeloop.models import load_tokenizer

        check_served(server)
        self.prompt = get_prompt(prompt)
        self.tokenizer = load_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
        self.max_length = max_length
        self._chat = has_chat_template(self.tokenizer)

    def _connect(self, server: ServerConfig, token_ids: tuple[int, ...]) -> None:
        self.client = ServedClient(server, token_ids, read_api_key(server), self._detokenize)  # type: ignore[arg-type]
        self.client.connect()
        self._token_ids = {self.tokenizer.convert_ids_to_tokens(t): t for t in token_ids}
        self._token_ids.update({self.tokenizer.decode([t]): t for t in token_ids})
        self.failures: list[str] = []

    def _ask_server(
        self,
        prompts: Sequence[Sequence[int]],
        token_ids: dict[str, int],
        starts: Sequence[int] | None = None,
        questions: Sequence[Question] | None = None,
    ) -> list[Reply]:
        """The client's replies to ``prompts``; the judge's stats count the ones its cache file held and
        record each reply's label mass."""
        replies = self.client.replies(prompts, token_ids, starts, questions)
        self.stats.stored_hits, self.stats.stored_misses = self.client.cache_hits, self.client.cache_misses  # type: ignore[attr-defined]
        if starts is None:
            for reply in replies:
                mass = label_mass(reply, self.client.verdict_ids)
                if mass is not None:
                    self.stats.label_mass.append(mass)  # type: ignore[attr-defined]
        return replies

    def _detokenize(self, ids: Sequence[int]) -> str:
        """The text of ``ids`` with special tokens as written (for a server that takes text prompts)."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)

    @property
    def route(self) -> str:
        """The route in use (empty until the first call when ``route: auto``)."""
        return self.client.route

    def describe(self) -> dict[str, Any]:
        """What a saved judge records of its server: model id, what the server reports, route, token ids
        (the verdict's, or the grades' under the ``graded`` extractor)."""
        return {
            **self.client.info,
            "route": self.route,
            "prompt_format": self.client.prompt_format,
            "top_logprobs": self.client.cfg.top_logprobs,
            "extractor": self.extractor,
            "verdict_token_ids": list(self.client.verdict_ids),
        }

    def _forget_failures(self, judge: Any, pairs: Sequence[Pair]) -> None:
        """A failed call is tried again next time, never remembered as a judgement."""
        for p in pairs:
            key = judge._key(p)
            if judge._cache.get(key, (0.0, ""))[1] == "failed":
                del judge._cache[key]

    def _report_failures(self, status: list[str]) -> None:
        failed = status.count("failed")
        if not failed:
            return
        # one line, though a 5xx page has many
        first = " ".join((self.failures[0] if self.failures else "?").split())
        message = (
            f"served judge: {failed} of {len(status)} pairs failed at {self.client.cfg.base_url} (first error: "
            f"{first})"
        )
        if self.client.cfg.on_failure == "stop":
            raise ServedJudgeFailed(
                f"{message}; judge.server.on_failure=stop ended the run (on_failure=mask drops them and goes on)"
            )
        logger.warning("%s; they are masked (no score, no reward)", message)


class _ServedPointwise(_ServedParts, PointwiseJudge):
    """A served judge that values each summary alone (the ``graded`` and ``likelihood`` extractors): a
    failed value is masked, counted and asked again next time, never remembered."""

    def _score(self, pairs: list[Pair]) -> Any:
        try:
            out = super()._score(pairs)
        finally:
            for key in [k for k, (_, st) in self._values.items() if st == "failed"]:
                del self._values[key]
        self._forget_failures(self, pairs)
        self._report_failures(out.status)
        return out


class ServedJudge(_ServedParts, Judge):
    """Pairwise judge reading verdict-token log-probabilities from a vLLM / SGLang / OpenAI-style server.

    Args:
        server: the ``judge.server`` settings.
        tokenizer: the served model's tokenizer (hub id or path; the prompts are tokenized here).
        prompt, verdict_tokens, position_debias, batch_size, max_length, cache_size: as for the
            ``choice`` judge.

    Raises:
        ServerSetupError: before any judging, one line each: an unset API key, no server at the URL, an
            answer that is not a model list, a model it does not serve.
        ValueError: no ``base_url`` or ``model``, a verdict that is not one token.
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
        self._set_up(server, tokenizer, prompt, max_length)
        self.verdict_ids = verdict_token_ids(self.tokenizer, verdict_tokens)
        self.labels = (verdict_tokens[0].strip(), verdict_tokens[1].strip())
        self._connect(server, self.verdict_ids)
        self._replies: dict[tuple[int, ...], Reply] = {}
        self._ids: dict[tuple[str, str, str], tuple[list[int] | None, str]] = {}
        name = f"served|{server.base_url}|{server.model}|{prompt}|{verdict_tokens[0]}|{verdict_tokens[1]}|{max_length}"
        super().__init__(name, position_debias=position_debias, batch_size=batch_size, cache_size=cache_size)

    def render(self, article: str, a: str, b: str) -> str:
        """The full judge prompt text for one order, up to the answer position (as the choice judge's)."""
        return render_choice(self.tokenizer, self.prompt, article, a, b, self.labels)

    def prompt_ids(self, pair: Pair) -> tuple[list[int] | None, str]:
        """Token ids of the judge prompt of ``pair`` (article cut to fit ``max_length``) and its status."""

        def render_ids(article: str) -> list[int]:
            return self.tokenizer.encode(
                self.render(article, pair.a, pair.b), add_special_tokens=not self._chat
            )

        ids, status, _ = fit_article(render_ids, self.tokenizer, pair.article, self.max_length)
        return ids, status

    def _batch_ids(self, pair: Pair) -> tuple[list[int] | None, str]:
        """:meth:`prompt_ids` of ``pair``, rendered and tokenized once per batch (the requests and the
        scoring both need them; tokenizing is most of the client's own time, scripts/profile_served_judge.py)."""
        key = (pair.article, pair.a, pair.b)
        if key not in self._ids:
            self._ids[key] = self.prompt_ids(pair)
        return self._ids[key]

    def question(self, pair: Pair) -> Question:
        """``pair`` as the decision routes ask it: the article as the state, the summaries in this order in
        the question (the server renders its own prompt around them)."""
        return Question(
            pair.article,
            self.prompt.decision_text(pair.a, pair.b, self.labels),
            tuple(f"Summary {x}" for x in self.labels),
        )

    def _score(self, pairs: list[Pair]) -> Any:
        """Send every prompt of the batch (both orders) at once, then score them as the base class does."""
        orders = pairs + ([p.swapped() for p in pairs] if self.position_debias else [])
        todo, questions = [], []
        for p in orders:
            if p.a.strip() and p.b.strip() and not (self.cache_size and self._key(p) in self._cache):
                ids, _ = self._batch_ids(p)
                if ids is not None and tuple(ids) not in self._replies and ids not in todo:
                    todo.append(ids)
                    questions.append(self.question(p))
        if todo:
            self._replies.update(
                zip(map(tuple, todo), self._ask_server(todo, self._token_ids, None, questions))
            )
        try:
            out = super()._score(pairs)
        finally:
            self._replies.clear()
            self._ids.clear()
        self._forget_failures(self, orders)
        self._report_failures(out.status)
        return out

    def _score_ordered(self, pairs: Sequence[Pair]) -> tuple[list[float], list[str]]:
        scores, statuses = [], []
        for p in pairs:
            ids, status = self._batch_ids(p)
            if ids is None:
                scores.append(math.nan)
                statuses.append(status)
                continue
            reply = self._replies.get(tuple(ids))
            if reply is None:
                reply = self._ask_server([ids], self._token_ids, None, [self.question(p)])[0]
            if reply.error:
                self.failures.append(reply.error)
            score, st = verdict_score(reply, self.verdict_ids, self.labels, self.client.cfg.min_label_mass)
            scores.append(score)
            statuses.append(st if st != "ok" else status)
        return scores, statuses


class GradedJudge(_ServedPointwise):
    """Pointwise rubric judge on a server (``judge.extractor: graded``): each summary graded 1..K alone,
    the expected grade from the grade tokens' probabilities, a pair's logit the difference of its two.

    Args:
        server: the ``judge.server`` settings.
        tokenizer: the served model's tokenizer (hub id or path; the prompts are tokenized here).
        prompt: the template whose ``criteria`` the rubric states (``judge.prompt``).
        grades: the top grade K; the digits ``1``..``K`` must each be one token.
        batch_size, max_length, cache_size: as for the ``choice`` judge (``batch_size`` summaries are in
            flight together).
    """

    extractor = "graded"

    def __init__(
        self,
        server: ServerConfig,
        tokenizer: str | Any,
        prompt: str = "neutral",
        grades: int = 5,
        batch_size: int = 8,
        max_length: int = 2048,
        cache_size: int = 100_000,
    ):
        self._set_up(server, tokenizer, prompt, max_length)
        self.grades = grades
        self.grade_ids = single_token_ids(
            self.tokenizer, [str(k) for k in range(1, grades + 1)], "judge.grades"
        )
        self._connect(server, self.grade_ids)
        name = f"served_graded|{server.base_url}|{server.model}|{prompt}|{grades}|{max_length}"
        super().__init__(name, position_debias=False, batch_size=batch_size, cache_size=cache_size)

    def render(self, article: str, summary: str) -> str:
        """The full rubric prompt for one summary, up to the answer position."""
        user = self.prompt.grade_text(article, summary, self.grades)
        return render_chat(self.tokenizer, self.prompt.system, user) + self.prompt.answer_prefix

    def prompt_ids(self, article: str, summary: str) -> tuple[list[int] | None, str]:
        """Token ids of the rubric prompt of one summary (article cut to fit ``max_length``), its status."""

        def render_ids(text: str) -> list[int]:
            return self.tokenizer.encode(self.render(text, summary), add_special_tokens=not self._chat)

        ids, status, _ = fit_article(render_ids, self.tokenizer, article, self.max_length)
        return ids, status

    def _value_points(
        self, points: Sequence[tuple[str, str, tuple[str, ...]]]
    ) -> tuple[list[float], list[str]]:
        """Every summary of the chunk in flight together; its expected grade and status."""
        built = [self.prompt_ids(article, summary) for article, summary, _ in points]
        sendable = [ids for ids, _ in built if ids is not None]
        replies = iter(self._ask_server(sendable, self._token_ids) if sendable else [])
        values, statuses = [], []
        for ids, fit in built:
            if ids is None:
                values.append(math.nan)
                statuses.append(fit)
                continue
            reply = next(replies)
            if reply.error:
                self.failures.append(reply.error)
            value, status = expected_grade(reply, self.grade_ids, self.client.cfg.min_label_mass)
            values.append(value)
            statuses.append(merge_status(fit, status) if status in VALID_STATUSES else status)
        return values, statuses


class ServedLikelihoodJudge(_ServedPointwise):
    """The ``likelihood`` judge on a server (``judge.extractor: likelihood``): each summary's
    length-normalized log-likelihood as the reply to the summarize prompt, ``v = (1/n) sum_t log P(x_t |
    prompt, x_<t)`` over its ``n`` tokens, read from the server's prompt log-probabilities; a pair's logit
    ``v(a) - v(b)``, exactly the in-process :class:`~judgeloop.judges.likelihood.LikelihoodJudge`'s.

    Args:
        server: the ``judge.server`` settings (``route``: ``auto``, ``vllm`` or ``sglang``).
        tokenizer: the served model's tokenizer (hub id or path; the prompts are tokenized here).
        prompt: template name; its ``summarize`` form is the context the summary continues.
        batch_size, max_length, cache_size: as for the ``likelihood`` judge (``batch_size`` summaries are in
            flight together).

    Raises:
        ServerSetupError: before any judging, one line each: the base checks of a served judge, and a server
            that returns no prompt log-probabilities on the routes tried.
    """

    extractor = "likelihood"

    def __init__(
        self,
        server: ServerConfig,
        tokenizer: str | Any,
        prompt: str = "neutral",
        batch_size: int = 8,
        max_length: int = 2048,
        cache_size: int = 100_000,
    ):
        self._set_up(server, tokenizer, prompt, max_length)
        self._connect(server, ())
        probe, n, _ = self.summary_ids("A short article.", "A summary.")
        self.client.find_prompt_route(probe, len(probe) - n)  # type: ignore[arg-type]
        name = f"served_likelihood|{server.base_url}|{server.model}|{prompt}|{max_length}"
        super().__init__(name, position_debias=False, batch_size=batch_size, cache_size=cache_size)

    def summary_ids(self, article: str, summary: str) -> tuple[list[int] | None, int, str]:
        """``(ids, n_summary, status)`` of one summary, as the in-process likelihood judge builds them."""
        return likelihood_ids(self.tokenizer, self.prompt, self._chat, article, summary, self.max_length)

    def _value_points(
        self, points: Sequence[tuple[str, str, tuple[str, ...]]]
    ) -> tuple[list[float], list[str]]:
        """Every summary of the chunk in flight together; its mean log-probability and status."""
        built = [self.summary_ids(article, summary) for article, summary, _ in points]
        sendable = [(ids, len(ids) - n) for ids, n, _ in built if ids is not None]
        replies = iter(
            self._ask_server([i for i, _ in sendable], {}, [s for _, s in sendable]) if sendable else []
        )
        values, statuses = [], []
        for ids, _, fit in built:
            if ids is None:
                values.append(math.nan)
                statuses.append(fit)
                continue
            reply = next(replies)
            if reply.error:
                self.failures.append(reply.error)
                values.append(math.nan)
                statuses.append("failed")
            elif not reply.prompt_logprobs:
                values.append(math.nan)
                statuses.append("unparsed")
            else:
                values.append(math.fsum(reply.prompt_logprobs) / len(reply.prompt_logprobs))
                statuses.append(fit)
        return values, statuses


__all__ = [
    "SERVED_STATUSES",
    "GradedJudge",
    "ServedJudge",
    "ServedLikelihoodJudge",
    "expected_grade",
    "single_token_ids",
    "verdict_score",
]
