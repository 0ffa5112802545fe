"""``judgeloop ablate --config CONFIG [k=v ...]``: the loop per calibration arm and seed, plus the summary.

``--job ARM:SEED`` runs one job (for a cluster task; run again, it continues from its checkpoint);
``--aggregate`` builds ``results.*`` from the job folders once every job has finished (``--allow-missing``:
from those that have); ``--list-jobs`` prints one ``ARM:SEED`` per line (for a job array).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from judgeloop.config import ConfigError
from judgeloop.rundir import held_folder, run_dir
from judgeloop.studies.ablation import jobs, parse_job, run_grid, run_job
from judgeloop.studies.ablation_config import AblateConfig
from judgeloop.studies.ablation_report import aggregate

__all__ = ["AblateConfig", "run"]


def run(
    cfg: AblateConfig,
    job: str | None = None,
    aggregate_only: bool = False,
    list_jobs: bool = False,
    allow_missing: bool = False,
) -> dict[str, Any]:
    """Run the command on ``cfg`` (the CLI calls this after loading and checking the config)."""
    if sum([job is not None, aggregate_only, list_jobs]) > 1:
        raise ConfigError("use only one of --job, --aggregate and --list-jobs")
    if allow_missing and not aggregate_only:
        raise ConfigError(
            "--allow-missing goes with --aggregate (it lets the summary leave out unfinished jobs)"
        )
    if list_jobs:
        sys.stdout.write("".join(f"{arm}:{seed}\n" for arm, seed in jobs(cfg)))
        return {}
    if job is not None:
        try:
            arm, seed = parse_job(job, cfg)
        except ValueError as err:
            raise ConfigError(str(err)) from err
    if aggregate_only:  # reads the job folders (each checked against this config) and writes results.* only,
        # so it also rebuilds a grid an older judgeloop ran (a committed study, with no run.json)
        with held_folder(cfg.output_dir, shared=True):  # not while a whole-grid run (exclusive) writes it
            results = aggregate(cfg, allow_missing)
        sys.stdout.write((Path(cfg.output_dir) / "results.md").read_text())
        return results
    # the grid's folder: --job tasks at once share it, each job folder held by its own run
    # (judgeloop.rundir); only a whole-grid run may clear it (overwrite=true)
    with run_dir(cfg.output_dir, "ablate", cfg, on_match="keep", shared=job is not None):
        if job is not None:
            result = run_job(cfg, arm, seed)
            sys.stdout.write(f"{job}: {result['status']} ({result['dir']})\n")
            return result
        run_grid(cfg)
        results = aggregate(cfg, allow_missing=True)  # every job ran; a failed one is listed as failed
    sys.stdout.write((Path(cfg.output_dir) / "results.md").read_text())
    return results
