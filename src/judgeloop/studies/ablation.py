"""The raw-vs-calibrated ablation: the same loop per arm x seed, on the same articles with the same seeds,
compared on per-article differences paired on (seed, article).

An ablation is a grid of *jobs* (arm, seed), each an ordinary ``train`` run in
``output_dir/ARM/seedS``. Jobs can run here one after another, several at once
(``ablation.num_workers``), or one per cluster task (``judgeloop ablate --job ARM:SEED``), and
:func:`judgeloop.studies.ablation_report.aggregate` builds the summary from whatever job folders exist. A job whose ``report.json``
exists and whose saved config matches is skipped, so an interrupted ablation continues where it
stopped; a job whose config changed is rerun. The runs of an ablation share the starting policy's
work (:mod:`judgeloop.loop.start_cache`) through ``output_dir/_shared``.

Outputs under ``output_dir``:

* ``results.json``: the premise check, paired deltas of every per-article final metric against the
  baseline arm and against the starting policy (95% two-level bootstrap interval and minimum
  detectable difference), per-arm means over seeds, curves, refits, and the path of every run's
  ``per_article.jsonl`` (so every number can be recomputed);
* ``results.md``: the premise sentence first, then the paired table, then absolute values;
* ``curves.png`` (means over seeds with min-max bands) and ``deltas.png`` (a forest plot).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from judgeloop.calibration import CalibrationError
from judgeloop.config import config_changes, default_dict, migrate, replace, to_yaml
from judgeloop.devices import on_cpu
from judgeloop.io import atomic_write_json
from judgeloop.logging import get_logger
from judgeloop.loop.config import RESUME_FREE_KEYS
from judgeloop.rundir import check_not_in_use
from judgeloop.studies.ablation_config import AblateConfig

logger = get_logger(__name__)

# Keys that cannot change a job's results: a finished job with only these different is not rerun. They are
# the keys a resume may change, except max_steps (a resumed run may extend; a finished job of other length
# is another job) and threads (a job at another thread count rounds differently: it is rerun, so a grid's
# jobs stay at one count).
NON_RESULT_KEYS = tuple(k for k in RESUME_FREE_KEYS if k not in ("max_steps", "threads"))


# --- jobs -------------------------------------------------------------------------------------------


def jobs(cfg: AblateConfig) -> list[tuple[str, int]]:
    """Every (arm, seed) of the ablation, in run order (arm-major: the arms of one seed reuse its start)."""
    return [(arm, seed) for arm in cfg.ablation.arms for seed in cfg.ablation.seeds]


def parse_job(text: str, cfg: AblateConfig) -> tuple[str, int]:
    """``"platt:1"`` -> ("platt", 1), checked against the ablation's arms and seeds."""
    arm, sep, seed = text.partition(":")
    if not sep or not seed.lstrip("-").isdigit():
        raise ValueError(
            f"--job {text!r} is not ARM:SEED; e.g. --job {cfg.ablation.arms[0]}:{cfg.ablation.seeds[0]}"
        )
    if (arm, int(seed)) not in jobs(cfg):
        raise ValueError(
            f"--job {text!r} is not in this ablation (arms {cfg.ablation.arms}, seeds {cfg.ablation.seeds}); "
            "list them with --list-jobs"
        )
    return arm, int(seed)


def job_dir(cfg: AblateConfig, arm: str, seed: int) -> Path:
    """The folder of one ablation job: ``OUTPUT_DIR/ARM/seedSEED``."""
    return Path(cfg.output_dir) / arm / f"seed{seed}"


def arm_config(cfg: AblateConfig, arm: str, seed: int) -> AblateConfig:
    """The config of one job: the arm's method, the seed, its own folder, the shared start cache."""
    shared = str(Path(cfg.output_dir) / "_shared") if cfg.ablation.share_start_work else "null"
    return replace(
        cfg,
        [
            f"calibration.method={arm}",
            f"seed={seed}",
            f"output_dir={job_dir(cfg, arm, seed)}",
            "resume_from=auto",  # a job stopped or killed mid-run continues from its newest checkpoint
            f"save_every_n_steps={cfg.ablation.save_every_n_steps}",
            f"keep_checkpoints={cfg.keep_checkpoints or 1}",
            "stop_after_n_steps=null",
            f"start_cache={shared}",
            f"run_name={arm}-seed{seed}",  # one dashboard run per job, grouped by the ablation's folder
            f"run_group={cfg.run_group or Path(cfg.output_dir).name}",
            f"threads={'null' if cfg.ablation.threads_per_job is None else cfg.ablation.threads_per_job}",
        ],
    )


def result_key(cfg_dict: dict[str, Any]) -> dict[str, Any]:
    """The part of a config (as a dict) that can change a job's results."""
    return {k: v for k, v in cfg_dict.items() if k not in NON_RESULT_KEYS}


def job_status(job_cfg: AblateConfig) -> tuple[str, list[str]]:
    """``done`` (report exists, config matches), ``changed`` (report exists, config differs: the
    differences are returned) or ``todo``."""
    folder = Path(job_cfg.output_dir)
    if not (folder / "report.json").is_file() or not (folder / "config.yaml").is_file():
        return "todo", []
    saved = result_key(migrate(type(job_cfg), yaml.safe_load((folder / "config.yaml").read_text()) or {}))
    new = result_key(yaml.safe_load(to_yaml(job_cfg)))
    changes = config_changes(saved, new, defaults=default_dict(type(job_cfg)))
    return ("changed", changes) if changes else ("done", [])


def run_job(cfg: AblateConfig, arm: str, seed: int) -> dict[str, Any]:
    """Run one job unless it is already done; returns {"arm", "seed", "status", "dir"[, "error"]}."""
    from judgeloop.recipes import train

    job_cfg = arm_config(cfg, arm, seed)
    folder = Path(job_cfg.output_dir)
    status, changes = job_status(job_cfg)
    if status == "done":
        logger.info("ablation: %s:%d already done in %s; skipped", arm, seed, folder)
        return {"arm": arm, "seed": seed, "status": "skipped", "dir": str(folder)}
    if status == "changed":
        logger.info("ablation: %s:%d config changed (%s); rerunning", arm, seed, "; ".join(changes[:5]))
    # the same --job running elsewhere now: its folder is neither cleaned nor resumed
    check_not_in_use(folder)
    can_resume = status != "changed" and resumable(job_cfg)
    if can_resume:
        logger.info("ablation: %s:%d continues from its newest checkpoint", arm, seed)
    elif folder.exists():
        # a stale run, or a half-finished one with no checkpoint this config can continue: start clean, so
        # no old file survives into the new one
        stale = folder.with_name(f".{folder.name}.stale")
        if stale.exists():
            shutil.rmtree(stale)
        os.replace(folder, stale)
        shutil.rmtree(stale)
    (folder / "failed.json").unlink(missing_ok=True)
    logger.info("ablation: arm=%s seed=%d", arm, seed)
    try:
        train(job_cfg)
    except CalibrationError as err:  # a failed run is reported as failed, never as numbers
        logger.error("ablation: arm=%s seed=%d failed: %s", arm, seed, err)
        atomic_write_json(folder / "failed.json", {"arm": arm, "seed": seed, "error": str(err)})
        return {"arm": arm, "seed": seed, "status": "failed", "dir": str(folder), "error": str(err)}
    return {"arm": arm, "seed": seed, "status": "ran", "dir": str(folder)}


def resumable(job_cfg: AblateConfig) -> bool:
    """Whether the job's folder holds a checkpoint its config can continue from (``resume_from: auto``
    will take it); one made with a config that would change the run is not."""
    from judgeloop.config import ConfigError
    from judgeloop.loop.run_state_files import checked_resume, latest_checkpoint, remove_orphans

    folder = Path(job_cfg.output_dir)
    if not folder.is_dir():
        return False
    remove_orphans(folder)  # a write killed between its two renames leaves the checkpoint as .NAME.old
    found = latest_checkpoint(folder)
    if found is None:
        return False
    try:
        checked_resume(to_yaml(job_cfg), found, RESUME_FREE_KEYS, default_dict(type(job_cfg)), type(job_cfg))
    except ConfigError as err:
        logger.info("ablation: %s is not continued: %s", found, err)
        return False
    return True


# Resident memory of one SmolLM2-135M job with the MiniLM judge, measured (3.4 GiB peak), rounded up.
JOB_MEMORY_GIB = 4.0


def default_workers(cfg: AblateConfig, n_jobs: int) -> int:
    """Jobs at once when ``ablation.num_workers`` is unset.

    On CPU: one job per ``ablation.threads_per_job`` cores (one single-thread job per core by default), as far as memory allows (``JOB_MEMORY_GIB`` per job). Measured
    on 2 cores, the quickstart's raw and platt arms x 2 seeds: 654 s as one two-thread job at a time,
    531 s as two one-thread jobs at a time (1.23x), with the same numbers. Decoding a batch of a few
    prompts is latency-bound and gains little from a second thread, so two jobs use the cores better.
    On a GPU (``device`` auto or cuda where there is one): one job at a time (they would share it).
    """
    if not on_cpu(cfg.device):
        return 1
    cores = (os.cpu_count() or 1) // (cfg.ablation.threads_per_job or 1)
    try:
        mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        mem_gib = JOB_MEMORY_GIB
    return max(1, min(cores, int(mem_gib // JOB_MEMORY_GIB), n_jobs))  # cores: of threads_per_job each


_GRID_STOPPED: Any = None  # in a worker: the parent's event, set once a stop signal reached the grid


def _worker_init(threads: int, stop_names: Sequence[str], grid_stopped: Any) -> None:
    global _GRID_STOPPED
    os.environ["OMP_NUM_THREADS"] = str(threads)
    import signal

    import torch

    torch.set_num_threads(threads)
    _GRID_STOPPED = grid_stopped
    # an idle worker ignores a stop signal (the parent has cancelled what it had not started); one that is
    # running a job catches it in _worker_job. A worker killed by it would break the pool, and the pool
    # would then kill the other workers in the middle of their checkpoints.
    for name in stop_names:
        signal.signal(getattr(signal, name), signal.SIG_IGN)


def _worker_job(cfg: AblateConfig, arm: str, seed: int) -> dict[str, Any]:
    from judgeloop.logging import quiet_third_party, setup_logging
    from judgeloop.signals import stop_signals

    quiet_third_party(progress_bars=False)  # several jobs share the terminal: the parent's line counts them
    setup_logging(prefix=f"{arm}:{seed}")
    # caught from here on: a signal before the run's own set-up is seen by the run, which stops after step 0
    with stop_signals(cfg.stop_signals):
        if _GRID_STOPPED is not None and _GRID_STOPPED.is_set():  # queued before the stop, not begun
            return {"arm": arm, "seed": seed, "status": "not started", "dir": job_dir(cfg, arm, seed)}
        return run_job(dataclasses.replace(cfg, progress_bar=False), arm, seed)  # progress_bar: result-free


def run_jobs(cfg: AblateConfig, todo: Sequence[tuple[str, int]], num_workers: int) -> list[dict[str, Any]]:
    """Run ``todo`` here (``num_workers == 1``) or in ``num_workers`` processes, each job at
    ``ablation.threads_per_job`` threads (or, when that is null, the cores split evenly).

    A stop signal (``stop_signals``, e.g. SLURM's SIGTERM) stops the grid as it stops one run: no further
    job starts, each running job (the signal is passed on to the workers) finishes its step in progress and
    writes its checkpoint, and :class:`~judgeloop.signals.GridStopped` says which; the same command
    continues them (``resume_from: auto``)."""
    from judgeloop.signals import GridStopped, Stopped, stop_signals

    progress = JobProgress(len(todo))
    how = "run the same command again to continue (each job from its checkpoint)"
    with stop_signals(cfg.stop_signals) as stop:
        if num_workers > 1 and len(todo) > 1:
            return _run_in_workers(cfg, todo, num_workers, progress, stop, how)
        results = []
        for i, (arm, seed) in enumerate(todo):
            if stop.requested:
                raise GridStopped(stop.signum or 0, i, [], len(todo) - i, how)
            try:
                results.append(progress.done(run_job(cfg, arm, seed)))
            except Stopped as err:
                raise GridStopped(err.signum, i, [_stopped(arm, seed, err)], len(todo) - i - 1, how) from None
        return results


def _stopped(arm: str, seed: int, err: Any) -> str:
    return f"{arm}:{seed} at step {err.step}"


def _run_in_workers(
    cfg: AblateConfig,
    todo: Sequence[tuple[str, int]],
    num_workers: int,
    progress: JobProgress,
    stop: Any,
    how: str,
) -> list[dict[str, Any]]:
    """:func:`run_jobs` in ``num_workers`` spawned processes; a stop signal is passed on to them."""
    import multiprocessing as mp
    from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

    import torch

    from judgeloop.signals import GridStopped, Stopped

    threads = cfg.ablation.threads_per_job or max(1, torch.get_num_threads() // num_workers)
    logger.info("ablation: %d jobs on %d workers, %d thread(s) each", len(todo), num_workers, threads)
    ctx = mp.get_context("spawn")
    grid_stopped = ctx.Event()
    init = (threads, list(cfg.stop_signals), grid_stopped)
    stopped: list[str] = []  # the running jobs that checkpointed and stopped
    not_started = 0
    signum = None
    with ProcessPoolExecutor(num_workers, ctx, _worker_init, init) as pool:
        futures = {pool.submit(_worker_job, cfg, arm, seed): (arm, seed) for arm, seed in todo}
        pending = set(futures)
        while pending:
            finished, pending = wait(pending, timeout=0.5, return_when=FIRST_COMPLETED)
            for f in finished:
                err = None if f.cancelled() else f.exception()
                if f.cancelled() or (err is None and f.result()["status"] == "not started"):
                    not_started += 1
                elif isinstance(err, Stopped):
                    stopped.append(_stopped(*futures[f], err))
                    signum = signum or err.signum
                else:
                    progress.done(f.result())  # a job's error is raised here
            if stop.requested and not grid_stopped.is_set():
                grid_stopped.set()
                signum = stop.signum
                for f in pending:
                    f.cancel()  # the ones not yet handed to a worker; the queued ones see grid_stopped
                logger.warning(
                    "ablation: %s: no further job starts; the running ones checkpoint", stop.name()
                )
                for child in mp.active_children():  # the pool's workers
                    os.kill(child.pid, stop.signum)
    if signum is not None:
        raise GridStopped(signum, progress.finished, stopped, not_started, how)
    return [f.result() for f in futures]


class JobProgress:
    """One line per finished job: how many of the grid are done, the time so far, and an estimate of
    what is left (the wall time so far per job that ran, times the jobs still to run: with several
    workers the wall time already counts them; skipped jobs count as done and take no time)."""

    def __init__(self, total: int):
        import time

        self.total, self.finished, self.ran, self.start, self.clock = (
            total,
            0,
            0,
            time.monotonic(),
            time.monotonic,
        )

    def done(self, result: dict[str, Any]) -> dict[str, Any]:
        self.finished += 1
        self.ran += result["status"] != "skipped"
        elapsed = self.clock() - self.start
        left = self.total - self.finished
        eta = f", about {_duration(elapsed / self.ran * left)} left" if self.ran and left else ""
        logger.info(
            "ablation: %d of %d jobs done, %s elapsed%s (%s:%d %s)",
            self.finished,
            self.total,
            _duration(elapsed),
            eta,
            result["arm"],
            result["seed"],
            result["status"],
        )
        return result


def _duration(seconds: float) -> str:
    m, s = divmod(int(round(seconds)), 60)
    return f"{m}m{s:02d}s" if m else f"{s}s"


def run_grid(cfg: AblateConfig) -> list[dict[str, Any]]:
    """Run every arm x seed (checked first, all together); each job's result. The summary is
    :func:`judgeloop.studies.ablation_report.aggregate`'s, which reads the job folders (``judgeloop ablate``
    writes it after the grid)."""
    from judgeloop.loop.recalibration import check_calibration_budget
    from judgeloop.loop.setup import check_models
    from judgeloop.loop.state import load_splits

    check_models(cfg)  # once, before any job starts: models, then data against every arm's fit
    calibration_ids = [e.id for e in load_splits(cfg).calibration]
    for arm in cfg.ablation.arms:
        for seed in cfg.ablation.seeds:
            check_calibration_budget(arm_config(cfg, arm, seed).calibration, calibration_ids, seed)
    grid = jobs(cfg)
    n = cfg.ablation.num_workers or default_workers(cfg, len(grid))
    return run_jobs(cfg, grid, n)


# Final metrics with one value per article (the per-article key), whose interval is the two-level bootstrap.
