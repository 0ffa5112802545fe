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

from starlette.concurrency import run_in_threadpool

from judgeloop.judges.calibrated import Comparison, References, Texts
from judgeloop.logging import get_logger
from judgeloop.rewards import EmptyLoses, Group, GroupScores, RewardConfig, score_groups
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
    batcher: ComparisonBatcher, groups: Sequence[Group], settings: RewardConfig, empty_loses: bool = False
) -> GroupScores:
    """:func:`judgeloop.rewards.score_groups` of ``groups`` with ``settings``, its judge call merged with other requests'. Equal to scoring them in process; with
    ``empty_loses``, an empty completion loses to every non-empty text (module docstring)."""
    batched = _BatchedJudge(batcher, asyncio.get_running_loop())
    judge = EmptyLoses(batched) if empty_loses else batched  # the one copy of the empty-completion rule
    return await run_in_threadpool(score_groups, judge, list(groups), settings)


@dataclass
class _Pending:
    source: str
    anchor: str | None
    completions: list[str] = field(default_factory=list)
    futures: list[asyncio.Future[float | None]] = field(default_factory=list)
    timer: asyncio.TimerHandle | None = None  # wait_s after the first completion
    idle: asyncio.TimerHandle | None = None  # idle_s after the latest one


class PromptGroups:
    """Completions of one prompt posted in separate requests, gathered into one group.

    :meth:`reward` waits until ``group_size`` completions of its (source, anchor) arrived, or
    ``wait_s`` passed since the first, or ``idle_s`` (when set) since the latest with no other (a short
    group is scored as it is, and counted in ``partial_groups``), then scores the group with :func:`served_group_scores` and answers every
    waiting caller with its own completion's reward (``None``: no valid comparison). Once
    :meth:`drain` is called (the server is stopping) every open group is scored at once, and so is each
    completion that arrives after, so no caller waits out ``wait_s`` while the server drains.
    """

    def __init__(
        self,
        batcher: ComparisonBatcher,
        settings: RewardConfig,
        group_size: int,
        wait_s: float,
        empty_loses: bool = False,
        idle_s: float | None = None,
    ):
        self.batcher, self.settings = batcher, settings
        self.group_size, self.wait_s, self.idle_s = group_size, wait_s, idle_s
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
        loop = asyncio.get_running_loop()
        if pending is None:
            pending = self._open[key] = _Pending(source, anchor)
            pending.timer = loop.call_later(self.wait_s, self._close, key, pending, True, "wait")
        future: asyncio.Future[float | None] = loop.create_future()
        pending.completions.append(completion)
        pending.futures.append(future)
        if len(pending.completions) >= self.group_size or self.draining:
            self._close(key, pending, self.draining and len(pending.completions) < self.group_size)
        elif self.idle_s is not None:  # restart the idle clock at every arrival
            if pending.idle is not None:
                pending.idle.cancel()
            pending.idle = loop.call_later(self.idle_s, self._close, key, pending, True, "idle")
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

    def _close(self, key: tuple[str, str | None], pending: _Pending, short: bool, why: str = "") -> None:
        if self._open.get(key) is not pending:
            return  # already closed
        del self._open[key]
        for timer in (pending.timer, pending.idle):
            if timer is not None:
                timer.cancel()
        self.groups += 1
        if short:
            self.partial_groups += 1
            if not self.draining:
                after = (
                    f"{self.idle_s:g} s without another completion (group_idle_s)"
                    if why == "idle"
                    else f"{self.wait_s:g} s (group_wait_s)"
                )
                logger.warning(
                    "a group closed after %s with %d of %d completions (the group size should equal the "
                    "trainer's samples per prompt; raise group_idle_s if its generations finish further apart)",
                    after,
                    len(pending.completions),
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
