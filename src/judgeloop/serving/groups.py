"""Groupwise rewards served: :func:`judgeloop.rewards.score_groups` with its one judge call sent through
the cross-request batcher, and :class:`PromptGroups`, which gathers the completions of one prompt that
arrive in separate requests (OpenRLHF posts each sample alone) into one group.

With ``empty_loses`` (the OpenRLHF route, where a refused sample stops the training run) an empty
completion is not sent to the judge: a comparison of it against a non-empty text has p = 0 (it loses),
two empty ones tie (p = 0.5), so the aggregate ranks it last (win rate 0.0; the lowest Bradley-Terry
strength of its group): :class:`judgeloop.rewards.EmptyLoses` around the batched judge, the rule
``JudgeReward`` uses too. The ``/v1/*`` routes refuse empty texts unless asked (422).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from starlette.concurrency import run_in_threadpool

from judgeloop.judges.calibrated import Comparison, References, Texts
from judgeloop.logging import get_logger
from judgeloop.rewards import EmptyLoses, Group, GroupScores, score_groups
from judgeloop.serving.batcher import ComparisonBatcher

logger = get_logger(__name__)


class _BatchedJudge:
    """What :func:`score_groups` needs of a judge (``pairwise``, ``debiases``, ``compare``), with
    ``compare`` handed to the batcher on the server's event loop; called from a worker thread."""

    def __init__(self, batcher: ComparisonBatcher, loop: asyncio.AbstractEventLoop):
        self.batcher, self.loop = batcher, loop
        self.pairwise = batcher.judge.pairwise
        self.debiases = batcher.judge.debiases

    def compare(self, prompts: Texts, a: Texts, b: Texts, references: References = None) -> Comparison:
        coro = self.batcher.submit(prompts, a, b, references)
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()


async def served_group_scores(
    batcher: ComparisonBatcher, groups: Sequence[Group], settings: dict[str, Any], empty_loses: bool = False
) -> GroupScores:
    """:func:`judgeloop.rewards.score_groups` of ``groups`` (``settings``: scheme, aggregate, m, prior,
    probability), its judge call merged with other requests'. Equal to scoring them in process; with
    ``empty_loses``, an empty completion loses to every non-empty text (module docstring)."""
    batched = _BatchedJudge(batcher, asyncio.get_running_loop())
    judge = EmptyLoses(batched) if empty_loses else batched  # the one copy of the empty-completion rule
    return await run_in_threadpool(score_groups, judge, list(groups), **settings)


@dataclass
class _Pending:
    source: str
    anchor: str | None
    completions: list[str] = field(default_factory=list)
    futures: list[asyncio.Future[float | None]] = field(default_factory=list)
    timer: asyncio.TimerHandle | None = None


class PromptGroups:
    """Completions of one prompt posted in separate requests, gathered into one group.

    :meth:`reward` waits until ``group_size`` completions of its (source, anchor) arrived, or
    ``wait_s`` passed since the first (a short group is scored as it is, and counted in
    ``partial_groups``), then scores the group with :func:`served_group_scores` and answers every
    waiting caller with its own completion's reward (``None``: no valid comparison). Once
    :meth:`drain` is called (the server is stopping) every open group is scored at once, and so is each
    completion that arrives after, so no caller waits out ``wait_s`` while the server drains.
    """

    def __init__(
        self,
        batcher: ComparisonBatcher,
        settings: dict[str, Any],
        group_size: int,
        wait_s: float,
        empty_loses: bool = False,
    ):
        self.batcher, self.settings = batcher, settings
        self.group_size, self.wait_s = group_size, wait_s
        self.empty_loses = empty_loses
        self._open: dict[tuple[str, str | None], _Pending] = {}
        self.groups = 0
        self.partial_groups = 0
        self.empty_completions = 0  # counted by the route that sends them
        self.draining = False
        self._tasks: set[asyncio.Task[None]] = set()  # the scoring tasks running (a reference keeps them)

    async def reward(self, source: str, completion: str, anchor: str | None = None) -> float | None:
        key = (source, anchor)
        pending = self._open.get(key)
        if pending is None:
            pending = self._open[key] = _Pending(source, anchor)
            loop = asyncio.get_running_loop()
            pending.timer = loop.call_later(self.wait_s, self._close, key, pending, True)
        future: asyncio.Future[float | None] = asyncio.get_running_loop().create_future()
        pending.completions.append(completion)
        pending.futures.append(future)
        if len(pending.completions) >= self.group_size or self.draining:
            self._close(key, pending, self.draining and len(pending.completions) < self.group_size)
        return await future

    @property
    def open_groups(self) -> int:
        """Groups still waiting for completions."""
        return len(self._open)

    def drain(self) -> None:
        """Score every open group now (short ones as they are) and every later completion at once."""
        self.draining = True
        for key, pending in list(self._open.items()):
            self._close(key, pending, True)

    def _close(self, key: tuple[str, str | None], pending: _Pending, short: bool) -> None:
        if self._open.get(key) is not pending:
            return  # already closed
        del self._open[key]
        if pending.timer is not None:
            pending.timer.cancel()
        self.groups += 1
        if short:
            self.partial_groups += 1
            if not self.draining:
                logger.warning(
                    "a group closed after %.0f s with %d of %d completions (openrlhf.n_samples_per_prompt=%d "
                    "should equal the trainer's --rollout.n_samples_per_prompt)",
                    self.wait_s,
                    len(pending.completions),
                    self.group_size,
                    self.group_size,
                )
        task = asyncio.get_running_loop().create_task(self._score(pending))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _score(self, pending: _Pending) -> None:
        group = Group(pending.source, pending.completions, pending.anchor)
        try:
            scores = await served_group_scores(self.batcher, [group], self.settings, self.empty_loses)
        except Exception as err:
            for f in pending.futures:
                if not f.done():
                    f.set_exception(err)
            return
        for f, r in zip(pending.futures, scores.rewards[0]):
            if not f.done():
                f.set_result(r)


__all__ = ["PromptGroups", "served_group_scores"]
