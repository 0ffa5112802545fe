"""Cross-request batching: comparisons from concurrent requests merged into one judge call.

Rollout workers post small requests (one prompt's group, one sample); a judge call costs a fixed
overhead (tokenizing, a model forward with its padding, Python) plus a small per-item part, so merging
them is where a served judge gets its throughput. :class:`ComparisonBatcher` queues each request's
comparisons, and one task takes the first waiting request, adds the ones that arrive within
``max_wait_ms`` (or are already queued) up to ``max_batch_size`` comparisons, runs one
:meth:`~judgeloop.judges.calibrated.CalibratedJudge.compare` on a single judge thread (the event loop
keeps answering ``/health`` meanwhile; the judge is never called concurrently) and hands each request
its own slice back, in order. A request is never split across judge calls. The judge object, and so
its caches, is shared by every request.

When a merged call raises, each request of it is judged again alone, so one request's bad input fails
that request only (:class:`JudgeFailure`, a 500 with its reason).

``num_threads`` sets torch's intra-op threads on the judge thread itself: torch's setting is per
thread (OpenMP's), so ``torch.set_num_threads`` in the main thread would not reach it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from judgeloop.judges.calibrated import CalibratedJudge, Comparison, MissingReferences, References, Texts
from judgeloop.logging import get_logger

logger = get_logger(__name__)


class JudgeFailure(RuntimeError):
    """The judge raised on a request's comparisons (the message names the error)."""


@dataclass
class _Job:
    prompts: list[str]
    a: list[str]
    b: list[str]
    references: list[tuple[str, ...]]
    future: asyncio.Future[Comparison]

    def __len__(self) -> int:
        return len(self.prompts)


@dataclass
class BatchStats:
    """What the batcher did: jobs and comparisons judged, judge calls, the largest call. A job is one
    :meth:`ComparisonBatcher.submit`: a ``/v1`` request's comparisons, or one whole group of the
    OpenRLHF or verl route (whose samples arrive in separate posts; the server counts posts itself)."""

    jobs: int = 0
    comparisons: int = 0
    judge_calls: int = 0
    failed_calls: int = 0
    max_batch: int = 0
    in_flight: int = 0  # jobs submitted and not answered yet
    judge_seconds: float = 0.0
    batch_sizes: dict[int, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {
            "judge_jobs": self.jobs,
            "comparisons": self.comparisons,
            "judge_calls": self.judge_calls,
            "failed_calls": self.failed_calls,
            "max_batch": self.max_batch,
            "in_flight_jobs": self.in_flight,
            "mean_batch": self.comparisons / self.judge_calls if self.judge_calls else 0.0,
            "judge_seconds": round(self.judge_seconds, 3),
        }


def _slice(out: Comparison, start: int, end: int) -> Comparison:
    return Comparison(
        p=out.p[start:end],
        logit=out.logit[start:end],
        status=out.status[start:end],
        forward=out.forward[start:end],
        reverse=None if out.reverse is None else out.reverse[start:end],
    )


class ComparisonBatcher:
    """Merges :meth:`submit` calls from concurrent requests into judge calls (see the module docstring).

    Args:
        judge: the calibrated judge every request shares.
        max_batch_size: comparisons per judge call (a larger request runs alone, unsplit).
        max_wait_ms: how long the first queued request waits for others to join its call.
        num_threads: torch intra-op threads of the judge thread (0: torch's default).
    """

    def __init__(
        self,
        judge: CalibratedJudge,
        max_batch_size: int = 256,
        max_wait_ms: float = 5.0,
        num_threads: int = 0,
    ):
        self.judge = judge
        self.max_batch_size = max_batch_size
        self.max_wait_s = max_wait_ms / 1000.0
        self.num_threads = num_threads
        self.threads = 0  # what the judge thread runs with, once started
        self.stats = BatchStats()
        self._queue: asyncio.Queue[_Job] | None = None
        self._task: asyncio.Task[None] | None = None
        self._carry: _Job | None = None
        self._executor = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="judge", initializer=self._init_thread
        )

    def _init_thread(self) -> None:
        if self.num_threads:
            torch.set_num_threads(self.num_threads)

    async def start(self) -> None:
        """Start the judge thread and the batching task on the running event loop."""
        loop = asyncio.get_running_loop()
        self.threads = await loop.run_in_executor(self._executor, torch.get_num_threads)
        self._queue = asyncio.Queue()
        self._task = asyncio.create_task(self._run(), name="judge-batcher")

    async def stop(self) -> None:
        """Stop the task (after the server has drained its requests) and the judge thread."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._executor.shutdown(wait=True)

    async def submit(self, prompts: Texts, a: Texts, b: Texts, references: References = None) -> Comparison:
        """The calibrated comparisons of ``(prompts[i], a[i], b[i])``, judged in a call shared with other
        requests; equal to ``judge.compare(prompts, a, b, references)`` (bit for bit in a call of its own;
        merged, within float rounding: texts are padded to the whole call's longest).

        Raises:
            JudgeFailure: the judge raised on these comparisons.
        """
        assert self._queue is not None, "ComparisonBatcher.start() was not called"
        refs: list[tuple[str, ...]] = (
            [tuple(r) for r in references] if references is not None else [()] * len(prompts)
        )
        future: asyncio.Future[Comparison] = asyncio.get_running_loop().create_future()
        self.stats.in_flight += 1
        try:
            await self._queue.put(_Job(list(prompts), list(a), list(b), refs, future))
            return await future
        finally:
            self.stats.in_flight -= 1

    async def _next(self, timeout: float | None) -> _Job | None:
        assert self._queue is not None
        if self._carry is not None:
            job, self._carry = self._carry, None
            return job
        if timeout is None:
            return await self._queue.get()
        if not self._queue.empty():
            return self._queue.get_nowait()
        if timeout <= 0:
            return None
        try:
            return await asyncio.wait_for(self._queue.get(), timeout)
        except asyncio.TimeoutError:
            return None

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            first = await self._next(None)
            assert first is not None
            batch, size = [first], len(first)
            deadline = loop.time() + self.max_wait_s
            while size < self.max_batch_size:
                job = await self._next(deadline - loop.time())
                if job is None:
                    break
                if size + len(job) > self.max_batch_size:
                    self._carry = job  # the next call's first request
                    break
                batch.append(job)
                size += len(job)
            batch = [j for j in batch if not j.future.cancelled()]  # a caller that went away
            if batch:
                await self._judge(batch)

    def _compare(self, jobs: list[_Job]) -> Comparison:
        prompts = [p for j in jobs for p in j.prompts]
        a = [x for j in jobs for x in j.a]
        b = [x for j in jobs for x in j.b]
        refs = [r for j in jobs for r in j.references]
        t0 = time.perf_counter()
        out = self.judge.compare(prompts, a, b, refs if any(refs) else None)
        self.stats.judge_seconds += time.perf_counter() - t0
        return out

    async def _judge(self, batch: list[_Job]) -> None:
        loop = asyncio.get_running_loop()
        size = sum(len(j) for j in batch)
        self.stats.judge_calls += 1
        self.stats.max_batch = max(self.stats.max_batch, size)
        try:
            out = await loop.run_in_executor(self._executor, self._compare, batch)
        except Exception as err:
            self.stats.failed_calls += 1
            if len(batch) == 1:
                logger.warning("judge failed on a request of %d comparisons: %r", size, err)
                if not batch[0].future.done():  # the caller's missing input stays what it is (a 422)
                    failure = (
                        err
                        if isinstance(err, MissingReferences)
                        else JudgeFailure(f"{type(err).__name__}: {err}")
                    )
                    batch[0].future.set_exception(failure)
                return
            for job in batch:  # find the request that broke it: judge each alone
                await self._judge([job])
            return
        self.stats.jobs += len(batch)
        self.stats.comparisons += size
        start = 0
        for job in batch:
            end = start + len(job)
            if not job.future.done():
                job.future.set_result(_slice(out, start, end))
            start = end
        assert start == len(out.status) == len(out.p)


def to_json_floats(values: np.ndarray) -> list[float | None]:
    """Floats for a JSON body: NaN / inf (a failed judgement) become null, never a number."""
    return [float(v) if np.isfinite(v) else None for v in np.asarray(values, dtype=float)]


__all__ = ["BatchStats", "ComparisonBatcher", "JudgeFailure", "to_json_floats"]
