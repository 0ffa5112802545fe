"""Stopping a trainer on a scheduler's signal: finish the step, checkpoint, exit with 128 + signum.

A cluster stops a job with a signal and kills it a grace period later: SLURM sends SIGTERM on
``scancel``, preemption and the time limit, or a chosen signal some minutes before it
(``#SBATCH --signal=B:USR1@120``). Under :func:`stop_signals` such a signal only sets a flag
(:class:`StopRequest`); the trainer looks at it between steps, so the step in progress finishes, a
checkpoint of the state after it is written (atomically, by every process), and :class:`Stopped`
carries the checkpoint and the way to continue to the command line, which prints one line and exits
with the conventional status (143 for SIGTERM, 138 for SIGUSR1). A second signal while the checkpoint
is written changes nothing: the flag is already set. Ctrl-C (SIGINT) keeps Python's immediate
``KeyboardInterrupt`` unless SIGINT is listed too.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator, Sequence
from typing import Any

from judgeloop.logging import get_logger

logger = get_logger(__name__)

# What SLURM sends on scancel / preemption / the time limit, and the usual "--signal=B:USR1@120".
DEFAULT_STOP_SIGNALS = ("SIGTERM", "SIGUSR1")
_UNCATCHABLE = ("SIGKILL", "SIGSTOP")
_ACTIVE: StopRequest | None = None  # the request of the outermost stop_signals scope of this process


def check_signal_names(names: Sequence[str], key: str = "stop_signals") -> None:
    """Refuse a name that is no catchable signal of this platform (naming the closest valid one).

    Raises:
        ValueError: an unknown or uncatchable signal name.
    """
    import difflib

    valid = sorted(
        n for n in dir(signal) if n.startswith("SIG") and not n.startswith("SIG_") and n not in _UNCATCHABLE
    )
    for name in names:
        if name in _UNCATCHABLE:
            raise ValueError(f"{key} lists {name}, which cannot be caught; use SIGTERM or SIGUSR1")
        if name not in valid or not isinstance(getattr(signal, name), signal.Signals):
            close = difflib.get_close_matches(str(name).upper(), valid, n=1)
            hint = f"; did you mean {close[0]}?" if close else " (e.g. SIGTERM, SIGUSR1)"
            raise ValueError(f"{key} lists {name!r}, which is no signal name{hint}")


class StopRequest:
    """The first stop signal received (``signum``; None until one comes)."""

    def __init__(self) -> None:
        self.signum: int | None = None

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def agreed(self, accelerator: Any) -> int | None:
        """The signal to stop on, the same on every process (call it on every process at the same point):
        a scheduler signals the processes of a job at slightly different moments, and a process that saved
        while another took one more step would wait for it forever."""
        if accelerator is None or accelerator.num_processes <= 1:
            return self.signum
        import torch

        mine = torch.tensor([self.signum or 0], device=accelerator.device)
        found = int(accelerator.gather(mine).max().item())
        return found or None

    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else ""


@contextlib.contextmanager
def stop_signals(names: Sequence[str]) -> Iterator[StopRequest]:
    """While inside, each signal in ``names`` sets the returned request's ``signum`` instead of stopping
    the process; the previous handlers are restored on leaving. Outside the main thread (where Python
    cannot install handlers) nothing is installed and the request is never set.

    Nested inside another ``stop_signals`` of the same process, it yields the outer request and installs
    nothing: a signal caught by the outer scope (an ablation worker between two jobs, or a run still in
    its set-up) is seen by the inner one, which stops after the step in progress."""
    global _ACTIVE
    if _ACTIVE is not None:
        yield _ACTIVE
        return
    request = StopRequest()
    if not names or threading.current_thread() is not threading.main_thread():
        yield request
        return

    def handler(signum: int, frame: Any) -> None:
        if request.signum is None:
            request.signum = signum
            logger.warning(
                "received %s: finishing the current step, then writing a checkpoint and stopping",
                signal.Signals(signum).name,
            )
        else:  # e.g. a second scancel while the checkpoint is written: the flag is set, nothing to redo
            logger.warning("received %s again: already stopping", signal.Signals(signum).name)

    previous = {}
    for name in names:
        sig = getattr(signal, name)
        previous[sig] = signal.signal(sig, handler)
    _ACTIVE = request
    try:
        yield request
    finally:
        _ACTIVE = None
        for sig, old in previous.items():
            signal.signal(sig, old)


class Stopped(Exception):
    """A run stopped by a signal after writing its checkpoint; ``exit_status`` is 128 + signum."""

    def __init__(self, signum: int, step: int, checkpoint: str, how_to_continue: str):
        super().__init__(signum, step, checkpoint, how_to_continue)
        self.signum, self.step, self.checkpoint, self.how_to_continue = (
            signum,
            step,
            checkpoint,
            how_to_continue,
        )

    @property
    def exit_status(self) -> int:
        return 128 + self.signum

    def __str__(self) -> str:
        name = signal.Signals(self.signum).name
        return (
            f"stopped by {name} after step {self.step}; checkpoint {self.checkpoint}: {self.how_to_continue}"
        )


class GridStopped(Stopped):
    """A grid of runs (``judgeloop ablate``) stopped by a signal: ``done`` jobs had finished, every job that
    was running stopped after its step in progress and wrote its checkpoint (``jobs``: ``"ARM:SEED at step
    N"``; one past its last step finishes instead and counts as done), and ``not_started`` jobs were never
    begun. The same command continues them all."""

    def __init__(self, signum: int, done: int, jobs: Sequence[str], not_started: int, how_to_continue: str):
        Exception.__init__(self, signum, done, list(jobs), not_started, how_to_continue)
        self.signum, self.done, self.jobs, self.not_started, self.how_to_continue = (
            signum,
            done,
            list(jobs),
            not_started,
            how_to_continue,
        )

    def __str__(self) -> str:
        name = signal.Signals(self.signum).name
        stopped = f" ({', '.join(self.jobs)})" if self.jobs else ""
        return (
            f"stopped by {name}: {self.done} job(s) done, {len(self.jobs)} running job(s) checkpointed{stopped}, "
            f"{self.not_started} not started: {self.how_to_continue}"
        )
