"""The judge's summary-independent work for the next batch, on a background thread (:class:`JudgePrefetch`)."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch

from judgeloop.data import SummExample
from judgeloop.judges import Judge, references_for


class JudgePrefetch:
    """The summary-independent half of judge_step, one step ahead.

    While the policy generates and updates on batch t, a background thread lets the judge do for
    batch t+1 what does not depend on the summaries (an embedding judge embeds the articles or
    references, :meth:`Judge.prepare`). The judge call of step t+1 then finds that work cached.
    Scores are unchanged (same texts, same batching); only when the work runs moves. The thread
    re-enters the caller's autocast state, since autocast is thread-local. A no-op for judges with
    nothing to prepare, or with ``enabled=False``.

    On CPU the cores are split while the judge thread works, so the two OpenMP pools never
    oversubscribe them: the judge thread has ``threads`` intra-op threads (default: half the cores),
    and the calling thread the rest from :meth:`start` until :meth:`wait` returns, then every core
    again (for the judge call itself). Without the split, measured on 2 cores, the overlap cost more
    than it saved. The split pays when the policy's own step is small or serial (the tiny config);
    with a policy whose matrix products use every core it does not, so ``enabled=None`` (auto) turns
    the prefetch on only when the judge runs on an accelerator.
    """

    def __init__(self, judge: Judge, enabled: bool | None = None, threads: int | None = None):
        self.judge = judge
        self._pool = None
        self._split: tuple[int, int] | None = None  # (all threads, the caller's share while work is pending)
        on_cpu = str(getattr(judge, "device", "cpu")) == "cpu"
        if enabled is None:
            enabled = not on_cpu
        if enabled and judge.can_prepare:
            from concurrent.futures import ThreadPoolExecutor

            initializer = None
            total = torch.get_num_threads()
            if on_cpu and total > 1:
                judge_threads = min(total - 1, threads or max(1, total // 2))
                self._split = (total, total - judge_threads)

                def initializer() -> None:
                    # per thread: the judge's share. The get first: ATen sets a new thread's count lazily
                    # from the process-wide one at its first query, which would undo a set made before.
                    torch.get_num_threads()
                    torch.set_num_threads(judge_threads)

            self._pool = ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="judge-prefetch", initializer=initializer
            )
        self._future: Any = None

    def start(self, batch: Sequence[SummExample]) -> None:
        """Begin preparing ``batch`` in the background (after waiting for any earlier request)."""
        if self._pool is None or not batch:
            return
        self.wait()
        autocast = [
            (dev, torch.get_autocast_dtype(dev)) for dev in ("cpu", "cuda") if torch.is_autocast_enabled(dev)
        ]
        cache = torch.is_autocast_cache_enabled()
        articles = [e.article for e in batch]
        refs = references_for(self.judge, batch)

        def work() -> None:
            with contextlib.ExitStack() as stack:
                for dev, dtype in autocast:
                    stack.enter_context(torch.autocast(dev, dtype=dtype, cache_enabled=cache))
                self.judge.prepare(articles, refs)

        self._future = self._pool.submit(work)
        if self._split is not None:
            torch.set_num_threads(self._split[1])  # the caller's share while the judge thread works

    def wait(self) -> None:
        """Block until the pending request is done (re-raising its error, if any)."""
        if self._future is not None:
            future, self._future = self._future, None
            try:
                future.result()
            finally:
                if self._split is not None:
                    torch.set_num_threads(self._split[0])  # the judge thread is idle: every core again

    def close(self) -> None:
        """Stop the thread and give the calling thread every core again."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self._future = None
        if self._split is not None:
            torch.set_num_threads(self._split[0])
            self._split = None
