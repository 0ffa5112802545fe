"""The ablation's statistics (paired bootstrap, premise check) and its job machinery (skip, rerun,
--job + --aggregate, parallel workers, shared start work), end to end on the tiny config."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from judgeloop.config import ConfigError, load_config
from judgeloop.studies.ablation_config import AblateConfig
from judgeloop.studies.stats import (
    MDD_FACTOR,
    aligned_differences,
    paired_bootstrap,
    paired_matrix,
    premise_check,
    recovered_fraction,
)

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "feedback_loop" / "tiny.yaml"


# --- the bootstrap on hand-made cases -------------------------------------------------------------


def test_constant_shift_gives_an_interval_on_that_shift():
    d = np.full((3, 20), 0.25)
    res = paired_bootstrap(d, n_boot=2000, seed=0)
    assert res.delta == pytest.approx(0.25)
    assert res.ci95 == [pytest.approx(0.25), pytest.approx(0.25)]
    assert res.se == pytest.approx(0.0, abs=1e-12) and res.n == 60 and res.n_seeds == 3


def test_shift_plus_noise_interval_contains_the_shift_and_excludes_zero():
    rng = np.random.default_rng(1)
    d = 0.3 + rng.normal(0, 0.2, size=(4, 50))
    res = paired_bootstrap(d, n_boot=2000, seed=0)
    assert res.ci95[0] < 0.3 < res.ci95[1]
    assert res.excludes_zero
    assert res.mdd == pytest.approx(MDD_FACTOR * res.se)
    # the bootstrap SE is close to the analytic SE of a mean of iid cells (no seed effect here)
    assert res.se == pytest.approx(0.2 / np.sqrt(d.size), rel=0.25)


def test_pure_noise_covers_zero_in_about_95_percent_of_trials():
    # 300 seeded trials of iid noise; the percentile interval should cover 0 in ~95% of them. Tolerance
    # [0.90, 0.99]: a binomial(300, 0.95) count lies in it with probability > 0.995, and the percentile
    # bootstrap's known slight under-coverage at this size (~94%) stays inside.
    rng = np.random.default_rng(123)
    covered = 0
    trials = 300
    for t in range(trials):
        d = rng.normal(0, 1, size=(6, 30))
        lo, hi = paired_bootstrap(d, n_boot=1000, seed=t).ci95
        covered += lo <= 0 <= hi
    assert 0.90 <= covered / trials <= 0.99


def test_paired_matrix_pairs_on_seed_and_article_and_skips_missing():
    a = {0: {"x": 1.0, "y": 2.0, "z": None}, 1: {"x": 3.0, "y": 5.0}, 2: {"x": 9.0}}
    b = {0: {"x": 0.5, "y": 1.0, "z": 1.0}, 1: {"x": 1.0, "y": 1.0}}
    d = paired_matrix(a, b)  # seeds 0, 1 (seed 2 has no baseline); articles x, y, z
    assert d.shape == (2, 3)
    np.testing.assert_array_equal(d[0, :2], [0.5, 1.0])
    np.testing.assert_array_equal(d[1, :2], [2.0, 4.0])
    assert np.isnan(d[0, 2]) and np.isnan(d[1, 2])
    assert paired_bootstrap(d, 1000).delta == pytest.approx(np.mean([0.5, 1.0, 2.0, 4.0]))


# --- the premise check on planted drifts ------------------------------------------------------------


def _rows(values: np.ndarray) -> dict[int, dict[str, dict[str, float]]]:
    return {s: {f"a{i}": {"copy_rate": float(v)} for i, v in enumerate(row)} for s, row in enumerate(values)}


@pytest.mark.parametrize(
    "shift, direction, holds",
    [(0.1, "increase", True), (-0.1, "increase", False), (-0.1, "decrease", True), (0.0, "increase", False)],
)
def test_premise_check_on_planted_drifts(shift, direction, holds):
    rng = np.random.default_rng(7)
    start = rng.uniform(0.2, 0.6, size=(3, 40))
    final = start + shift + rng.normal(0, 0.03, size=start.shape)
    res = premise_check(_rows(start), _rows(final), "copy_rate", direction, 2000, 0, ("copy_rate",))
    assert res["holds"] is holds
    assert res["metrics"]["copy_rate"]["delta"] == pytest.approx(shift, abs=0.02)
    if holds:
        assert res["sentence"].startswith("The raw judge moved the policy")
    else:
        assert "cannot show a correction" in res["sentence"]


def _cells(values: np.ndarray) -> dict[int, dict[str, float]]:
    return {s: {f"a{i}": float(v) for i, v in enumerate(row)} for s, row in enumerate(values)}


def test_recovered_fraction_finds_a_planted_half_and_is_undefined_without_an_oracle_gain():
    rng = np.random.default_rng(3)
    base = rng.uniform(0.2, 0.3, size=(3, 60))
    oracle = base + 0.04 + rng.normal(0, 0.01, size=base.shape)
    arm = base + 0.02 + rng.normal(0, 0.01, size=base.shape)
    gain, oracle_gain = aligned_differences(_cells(base), _cells(arm), _cells(oracle))
    res = recovered_fraction(gain, oracle_gain, 2000, 0)
    assert res["defined"] and res["fraction"] == pytest.approx(0.5, abs=0.05)
    lo, hi = res["ci95"]
    assert lo < 0.5 < hi and hi - lo < 0.3
    assert res["oracle_gain"]["delta"] == pytest.approx(0.04, abs=0.005)
    # an oracle no better than the baseline: nothing to recover, the ratio is not reported
    flat = base + rng.normal(0, 0.01, size=base.shape)
    gain, oracle_gain = aligned_differences(_cells(base), _cells(arm), _cells(flat))
    res = recovered_fraction(gain, oracle_gain, 2000, 0)
    assert not res["defined"] and res["fraction"] is None and res["ci95"] == [None, None]
    assert res["arm_gain"]["delta"] == pytest.approx(0.02, abs=0.005)


def test_aligned_differences_share_one_grid_of_seeds_and_articles():
    base = {0: {"a": 1.0, "b": 2.0}, 1: {"a": 1.0}}
    arm = {0: {"a": 2.0, "b": None}, 1: {"a": 3.0}, 2: {"a": 9.0}}
    oracle = {0: {"a": 1.5, "b": 4.0}, 1: {"a": 2.0}}
    d_arm, d_oracle = aligned_differences(base, arm, oracle)
    assert d_arm.shape == d_oracle.shape == (2, 2)  # seeds 0 and 1 (all three have them); articles a, b
    assert d_arm[0, 0] == 1.0 and np.isnan(d_arm[0, 1]) and d_oracle[0, 1] == 2.0 and np.isnan(d_oracle[1, 1])


# --- config validation ------------------------------------------------------------------------------


def test_duplicate_seeds_and_a_missing_baseline_are_config_errors():
    with pytest.raises(ConfigError, match="more than once"):
        load_config(AblateConfig, TINY, ["ablation.seeds=[0,0]"])
    with pytest.raises(ConfigError, match="ablation.baseline"):
        load_config(AblateConfig, TINY, ["ablation.arms=[platt,isotonic]"])
    with pytest.raises(ConfigError, match="ablation.style_metric"):
        load_config(AblateConfig, TINY, ["ablation.style_metric=rouge"])


def test_one_file_serves_train_and_ablate_and_only_ablate_reads_the_grid():
    """The grid's settings live in studies/ (AblateConfig); the loop's schema accepts a file's
    ``ablation:`` section unread, so ``judgeloop train`` runs every shipped feedback_loop config."""
    from judgeloop.config import migrate, to_dict
    from judgeloop.loop.config import FeedbackLoopConfig

    loop_cfg = load_config(FeedbackLoopConfig, TINY)
    grid = load_config(AblateConfig, TINY)
    assert not hasattr(loop_cfg, "ablation") and grid.ablation.arms
    assert to_dict(grid) == to_dict(loop_cfg) | {"ablation": to_dict(grid.ablation)}
    saved = to_dict(grid)  # a run saved before the move holds the section: it still compares
    assert migrate(FeedbackLoopConfig, saved) == to_dict(loop_cfg)
    with pytest.raises(ConfigError, match="unknown config key 'ablation.armz'"):
        load_config(AblateConfig, TINY, ["ablation.armz=[raw]"])


# --- end to end on the tiny config --------------------------------------------------------------------

FAST = [
    "judge.model=judgeloop-tiny/encoder",
    "judge.cache_size=0",
    "policy.sft_steps=40",
    "max_steps=2",
    "eval_every_n_steps=2",
    "calibration.recalibrate_every_n_steps=2",
    "calibration.num_articles=40",
    "calibration.min_points=4",
    "num_eval_articles=6",
    "num_validation_articles=4",
    "progress_bar=false",
    "log_with=[jsonl]",
    "data.embedded_size=120",
    "generation.max_new_tokens=8",
    "ablation.arms=[raw,platt]",
    "ablation.seeds=[0,1]",
    "ablation.bootstrap_samples=1000",
    "save_final_policy=false",
]


def _cfg(out: Path, *extra: str) -> AblateConfig:
    return load_config(AblateConfig, TINY, [*FAST, f"output_dir={out}", *extra])


def _results(out: Path) -> dict:
    res = json.loads((out / "results.json").read_text())
    # the per-article paths are relative to each output folder, so they compare equal across folders
    return res


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The reference ablation: one process. Every job runs at ablation.threads_per_job (1) threads however
    it is launched, so the other launches compare bit for bit with it on any machine."""
    from judgeloop.studies.ablation import run_grid
    from judgeloop.studies.ablation_report import aggregate

    out = tmp_path_factory.mktemp("abl") / "one"
    cfg = _cfg(out, "ablation.num_workers=1")
    run_grid(cfg)
    aggregate(cfg, allow_missing=True)  # what judgeloop ablate writes after the grid
    return out


@pytest.mark.slow
def test_ablation_writes_per_article_rows_paired_deltas_and_the_premise(one_process):
    res = _results(one_process)
    assert set(res["paired"]) == {"platt"} and res["paired"]["platt"]["vs"] == "raw"
    d = res["paired"]["platt"]["rouge_l_neutral"]
    assert d["n"] == 2 * 6 and d["n_seeds"] == 2 and d["ci95"][0] <= d["delta"] <= d["ci95"][1]
    assert res["premise"]["style_metric"] == "copy_rate" and isinstance(res["premise"]["holds"], bool)
    md = (one_process / "results.md").read_text()
    assert md.splitlines()[2].startswith("**Premise.**")
    assert (one_process / "curves.png").is_file() and (one_process / "deltas.png").is_file()
    # every paired delta can be recomputed from the per-article rows the results point to
    rows = {}
    for arm in ("raw", "platt"):
        for rel in res["arms"][arm]["per_article"]:
            seed = int(Path(rel).parent.name.removeprefix("seed"))
            lines = (one_process / rel).read_text().splitlines()
            rows[arm, seed] = {r["id"]: r for r in map(json.loads, lines) if r["step"] == 2}
            assert {0, 2} == {json.loads(x)["step"] for x in lines}
    diffs = [
        rows["platt", s][i]["rouge_l_neutral"] - rows["raw", s][i]["rouge_l_neutral"]
        for s in (0, 1)
        for i in rows["raw", s]
    ]
    assert d["delta"] == pytest.approx(float(np.mean(diffs)))
    # the start was shared: the second job of a seed read the step-0 work the first one wrote
    report = json.loads((one_process / "platt" / "seed1" / "report.json").read_text())
    assert report["start_cache"]["hits"] >= 3


@pytest.mark.slow
def test_finished_jobs_are_skipped_and_a_changed_job_is_rerun(one_process, tmp_path):
    import shutil

    from judgeloop.studies.ablation import run_job

    out = tmp_path / "copy"
    shutil.copytree(one_process, out)
    assert run_job(_cfg(out), "platt", 0)["status"] == "skipped"
    # a key that cannot change results (the progress bar, the worker count) keeps it skipped
    assert (
        run_job(_cfg(out, "progress_bar=true", "ablation.num_workers=2"), "platt", 0)["status"] == "skipped"
    )
    before = (out / "platt" / "seed0" / "report.json").read_text()
    assert run_job(_cfg(out, "loss.beta=0.2"), "platt", 0)["status"] == "ran"
    assert (out / "platt" / "seed0" / "report.json").read_text() != before


@pytest.mark.slow
def test_jobs_one_by_one_then_aggregate_equal_the_one_process_ablation(one_process, tmp_path):
    from judgeloop.cli import main

    out = tmp_path / "jobs"
    args = ["ablate", "--config", str(TINY), *FAST, f"output_dir={out}"]
    listed = []
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main([*args, "--list-jobs"]) == 0
    listed = buf.getvalue().split()
    assert listed == ["raw:0", "raw:1", "platt:0", "platt:1"]
    # at the process's own thread count: each job sets ablation.threads_per_job itself
    for job in reversed(listed):  # any order: the shared start work is computed by whichever comes first
        with contextlib.redirect_stdout(io.StringIO()):
            assert main([*args, "--job", job]) == 0
    with contextlib.redirect_stdout(io.StringIO()):
        assert main([*args, "--aggregate"]) == 0
    assert _results(out) == _results(one_process)
    assert main([*args, "--job", "oracle:0"]) == 2  # not in the grid: a one-line error


def _edit_numerics(out: Path, job: str, **changes) -> None:
    arm, seed = job.split(":")
    path = out / arm / f"seed{seed}" / "report.json"
    report = json.loads(path.read_text())
    for segment in report["numerics"]:
        segment.update(changes)
    path.write_text(json.dumps(report))


@pytest.mark.slow
def test_aggregate_refuses_jobs_at_other_thread_counts_and_names_other_kernels(one_process, tmp_path):
    import shutil

    from judgeloop.config import ConfigError
    from judgeloop.studies.ablation_report import aggregate

    res = _results(one_process)  # every job at ablation.threads_per_job, on one machine: nothing to name
    assert res["numerics"]["threads"] == 1 and len(res["numerics"]["kernels"]) == 1
    assert "Numerics differ" not in (one_process / "results.md").read_text()
    for job in ("raw:0", "raw:1", "platt:0", "platt:1"):
        arm, seed = job.split(":")
        cfg = (one_process / arm / f"seed{seed}" / "config.yaml").read_text()
        assert "\nthreads: 1\n" in cfg  # recorded in each job's config

    mixed = tmp_path / "mixed"
    shutil.copytree(one_process, mixed)
    _edit_numerics(mixed, "platt:1", threads=2)  # as a job run with threads_per_job=2 would record it
    with pytest.raises(
        ConfigError, match=re.escape("(1 thread(s): raw:0, raw:1, platt:0; 2 thread(s): platt:1)")
    ):
        aggregate(_cfg(mixed))

    other = tmp_path / "other"
    shutil.copytree(one_process, other)
    _edit_numerics(other, "raw:1", kernels="AVX2 avx2")  # a SLURM task on an older node
    aggregate(_cfg(other))
    md = (other / "results.md").read_text()
    assert "**Numerics differ between jobs**" in md and "`AVX2 avx2 fp32`: raw:1" in md


@pytest.mark.slow
def test_two_workers_give_the_same_numbers_as_one(one_process, tmp_path):
    from judgeloop.studies.ablation import run_grid
    from judgeloop.studies.ablation_report import aggregate

    out = tmp_path / "two"
    cfg = _cfg(out, "ablation.num_workers=2")
    run_grid(cfg)  # two workers x ablation.threads_per_job (1) each
    aggregate(cfg, allow_missing=True)
    assert _results(out) == _results(one_process)


@pytest.mark.slow
def test_shared_start_work_changes_no_number(one_process, tmp_path):
    from judgeloop.recipes import train

    train(_cfg(tmp_path / "alone", "calibration.method=platt", "seed=1", "threads=1"))  # the jobs' count
    alone = json.loads((tmp_path / "alone" / "report.json").read_text())
    shared = json.loads((one_process / "platt" / "seed1" / "report.json").read_text())
    assert alone["start_cache"] is None and shared["start_cache"]["hits"] >= 3
    for key in ("final", "refits", "train_log", "history"):
        assert alone[key] == shared[key], key
    assert (tmp_path / "alone" / "per_article.jsonl").read_text() == (
        one_process / "platt" / "seed1" / "per_article.jsonl"
    ).read_text()


_KILL_DRIVER = """
import os, signal, sys
import judgeloop.loop.recalibration as rn
from judgeloop.cli import main

real = rn.maybe_recalibrate
def maybe_recalibrate(step, *args, **kwargs):  # mid-step 3, after the step-2 checkpoint
    if step == 3:
        os.kill(os.getpid(), signal.SIGKILL)
    return real(step, *args, **kwargs)
rn.maybe_recalibrate = maybe_recalibrate
sys.exit(main(sys.argv[1:]))
"""

# what differs between a job run in one go and one killed and rerun, besides timing: the numerics entry
# of each segment (one more for the rerun) and the start cache's counters (the rerun starts from the checkpoint)
_SEGMENT_FIELDS = ("numerics", "start_cache")


@pytest.mark.slow
def test_a_killed_job_rerun_with_the_same_job_continues_and_ends_with_the_same_report(tmp_path):
    """SIGKILL of `--job raw:0` mid-step 3 in a child process; the same `--job` again continues from the
    step-2 checkpoint (ablation.save_every_n_steps) and writes the uninterrupted job's report.json."""
    import os
    import subprocess
    import sys

    from judgeloop.cli import main
    from judgeloop.studies.ablation import run_job

    steps = ["max_steps=4", "eval_every_n_steps=2"]
    run_job(_cfg(tmp_path / "whole", *steps), "raw", 0)
    whole = json.loads((tmp_path / "whole" / "raw" / "seed0" / "report.json").read_text())

    out = tmp_path / "killed"
    args = ["ablate", "--config", str(TINY), *FAST, *steps, f"output_dir={out}", "--job", "raw:0"]
    driver = tmp_path / "driver.py"
    driver.write_text(_KILL_DRIVER)
    proc = subprocess.run(
        [sys.executable, str(driver), *args], env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True
    )
    assert proc.returncode == -9, proc.stderr[-2000:]
    folder = out / "raw" / "seed0"
    assert [p.name for p in (folder / "checkpoints").iterdir()] == ["step_2"]  # keeps the newest only
    assert not (folder / "report.json").exists()
    import contextlib
    import io

    with contextlib.redirect_stdout(io.StringIO()):
        assert main(args) == 0
    rerun = json.loads((folder / "report.json").read_text())
    assert [seg["from_step"] for seg in rerun["numerics"]] == [0, 2]  # continued, not started over
    assert rerun.keys() == whole.keys()
    for key in whole:
        if key in _SEGMENT_FIELDS:
            continue
        if key in ("final",):
            for m in whole[key]:
                assert rerun[key][m] == pytest.approx(whole[key][m], rel=1e-6, abs=1e-9), m
        elif key in ("train_log", "history", "refits"):
            assert len(rerun[key]) == len(whole[key]), key
            for r, w in zip(rerun[key], whole[key]):
                assert r.keys() == w.keys()
                for k in w:
                    if isinstance(w[k], float):
                        assert r[k] == pytest.approx(w[k], rel=1e-6, abs=1e-9), (key, k)
                    else:
                        assert r[k] == w[k], (key, k)
        else:
            assert rerun[key] == whole[key], key


_STOP_DRIVER = """
import os, signal, sys, time
import judgeloop.loop.recalibration as rn
from judgeloop.cli import main

flag, pids = sys.argv[1], sys.argv[2]
if __name__ == "__mp_main__":  # a worker: note its pid
    with open(pids, "a") as f:
        f.write(f"{os.getpid()}\\n")
real = rn.maybe_recalibrate
def maybe_recalibrate(step, *args, **kwargs):  # the first worker mid-step 1 sends SIGTERM to the parent
    if step == 1 and __name__ == "__mp_main__":
        try:
            os.close(os.open(flag, os.O_CREAT | os.O_EXCL))
            os.kill(os.getppid(), signal.SIGTERM)
            time.sleep(3)  # the parent passes the signal on: this job stops after its step 1 too
        except FileExistsError:
            pass
    return real(step, *args, **kwargs)
rn.maybe_recalibrate = maybe_recalibrate
if __name__ == "__main__":
    sys.exit(main(sys.argv[3:]))
"""


@pytest.mark.slow
def test_sigterm_to_the_ablation_stops_every_worker_at_a_checkpoint_and_the_rerun_finishes_the_grid(
    one_process, tmp_path
):
    """SIGTERM to `judgeloop ablate`'s parent while two workers run: no further job starts, each running
    job finishes its step and checkpoints, no worker is left running, the exit status is 143 with one line
    saying which jobs stopped where; the same command then finishes the grid with the one-process numbers."""
    import contextlib
    import io
    import subprocess
    import sys
    import time

    from judgeloop.cli import main

    out = tmp_path / "stopped"
    args = ["ablate", "--config", str(TINY), *FAST, "ablation.num_workers=2", f"output_dir={out}"]
    driver = tmp_path / "driver.py"
    driver.write_text(_STOP_DRIVER)
    flag, pids = tmp_path / "sent", tmp_path / "pids"
    proc = subprocess.run(
        [sys.executable, str(driver), str(flag), str(pids), *args],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 143, proc.stderr[-3000:]
    line = proc.stderr.strip().splitlines()[-1]
    m = re.fullmatch(
        r"judgeloop ablate: stopped by SIGTERM: (\d) job\(s\) done, (\d) running job\(s\) checkpointed \((.*)\), "
        r"(\d) not started: "
        r"run the same command again to continue \(each job from its checkpoint\)",
        line,
    )
    assert m, line
    stopped = re.findall(r"(raw|platt):(\d) at step (\d)", m.group(3))
    finished = list(out.glob("*/seed*/report.json"))  # a job past its last step when the signal came
    assert len(finished) == int(m.group(1)) and len(stopped) == int(m.group(2)) >= 1
    assert len(stopped) + len(finished) + int(m.group(4)) == 4
    assert any(step == "1" for *_, step in stopped), line  # the job that sent it stopped after its step 1
    for arm, seed, step in stopped:
        folder = out / arm / f"seed{seed}"
        assert (folder / "checkpoints" / f"step_{step}").is_dir() and not (folder / "report.json").exists()
    deadline = time.monotonic() + 10  # the pool's workers end with the parent
    alive = [int(p) for p in pids.read_text().split()]
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if _running(p)]
        time.sleep(0.2)
    assert not alive, f"workers still running: {alive}"
    assert not (out / "results.json").exists()

    with contextlib.redirect_stdout(io.StringIO()):
        assert main(args) == 0  # the same command continues the stopped jobs and runs the rest
    assert _final_metrics(out) == pytest.approx(_final_metrics(one_process), rel=1e-6, abs=1e-9)


def _running(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie waiting to be reaped is not)."""
    try:
        return "zombie" not in Path(f"/proc/{pid}/status").read_text().lower()
    except OSError:  # gone
        return False


def _final_metrics(out: Path) -> dict[str, float]:
    finals = {}
    for report in sorted(out.glob("*/seed*/report.json")):
        for k, v in json.loads(report.read_text())["final"].items():
            if isinstance(v, float):
                finals[f"{report.parent.parent.name}/{report.parent.name}/{k}"] = v
    return finals


@pytest.mark.slow
def test_aggregate_with_none_some_and_all_jobs_finished(one_process, tmp_path, capsys):
    import shutil

    from judgeloop.cli import main
    from judgeloop.config import ConfigError
    from judgeloop.studies.ablation_report import aggregate

    empty = tmp_path / "empty"  # no job has finished: an error naming the folder and --list-jobs
    args = ["ablate", "--config", str(TINY), *FAST, f"output_dir={empty}", "--aggregate"]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        f"judgeloop ablate: error: --aggregate: no job has finished under {empty} (0 of 4 have a report.json); "
        "run them first, one per line of --list-jobs (judgeloop ablate ... --job ARM:SEED), or check output_dir"
    )
    assert not empty.exists()  # a mistyped output_dir: nothing created, not even the folder's lock

    some = tmp_path / "some"
    shutil.copytree(one_process, some)
    (some / "platt" / "seed1" / "report.json").unlink()
    (some / "results.md").unlink()
    with pytest.raises(
        ConfigError, match=re.escape("1 of 4 jobs under") + ".*not finished: platt:1.*--allow-missing"
    ):
        aggregate(_cfg(some))
    assert not (some / "results.md").exists()
    res = aggregate(_cfg(some), allow_missing=True)
    md = (some / "results.md").read_text().splitlines()
    assert md[0].endswith(
        "test articles, 2 steps; 3 of 4 jobs finished)"
    )  # the title says the grid is partial
    assert md[2].startswith("**Incomplete grid.** Missing jobs (no report): platt:1.")
    assert md[4].startswith("**Premise.**")  # after the missing jobs
    d = res["paired"]["platt"]["rouge_l_neutral"]
    assert (d["n"], d["n_seeds"]) == (6, 1)  # seed 0 only: the pairs both arms have
    assert any(line.startswith("| platt | 6 (1 seed) |") for line in md)
    assert res["premise"]["metrics"]["copy_rate"]["n"] == 12  # the baseline has both seeds

    full = _results(one_process)  # all finished: no missing line, every pair counted
    assert full["missing_jobs"] == [] and full["paired"]["platt"]["rouge_l_neutral"]["n"] == 12
    text = (one_process / "results.md").read_text()
    assert "Incomplete grid" not in text and "| platt | 12 (2 seeds) |" in text
    assert text.splitlines()[0].endswith("test articles, 2 steps)")  # a finished grid: no count in the title


def test_absolute_intervals_stay_within_the_metric_range():
    """Two seeds far apart: the t-interval over seeds (t = 12.7) leaves [0, 1]; the two-level bootstrap of
    the per-article values stays inside the values' range, and a per-seed metric (ECE) with 2 seeds gets no
    interval but a reason; with 6 seeds, a percentile interval inside the seeds' range."""
    from judgeloop.studies.ablation_report import article_cells, summarize

    per_seed = {
        0: {f"a{i}": {"copy_rate": v} for i, v in enumerate([1.0, 1.0, 0.9, 1.0, 1.0, 0.95])},
        1: {f"a{i}": {"copy_rate": v} for i, v in enumerate([0.2, 0.0, 0.1, 0.0, 0.3, 0.1])},
    }
    cells = article_cells(per_seed, "copy_rate")
    assert cells.shape == (2, 6)
    finals = [float(np.mean([r["copy_rate"] for r in per_seed[s].values()])) for s in (0, 1)]
    s = summarize(finals, cells, 1000, 0)
    lo, hi = s["ci95"]
    assert 0.0 <= lo <= s["mean"] <= hi <= 1.0 and s["interval"].startswith("two-level bootstrap")
    from scipy.stats import t

    half = t.ppf(0.975, 1) * np.std(finals, ddof=1) / np.sqrt(2)  # what the table printed before
    assert s["mean"] - half < 0.0 and s["mean"] + half > 1.0

    ece = summarize([0.05, 0.30], None, 1000, 0)  # one value per seed, two seeds
    assert ece["ci95"] == [None, None] and ece["interval"].startswith(
        "none: one value per seed and 2 seed(s)"
    )
    six = [0.05, 0.30, 0.12, 0.2, 0.08, 0.15]
    ece6 = summarize(six, None, 1000, 0)
    assert min(six) <= ece6["ci95"][0] <= ece6["mean"] <= ece6["ci95"][1] <= max(six)
    assert summarize([None], None)["interval"] == "none: no finished run"


@pytest.mark.slow
def test_every_absolute_interval_of_the_ablation_lies_within_its_values(one_process):
    res = _results(one_process)
    for arm, summary in res["arms"].items():
        for metric, s in summary["final"].items():
            lo, hi = s["ci95"]
            if metric == "ece":  # one value per seed, 2 seeds: no interval, and the reason
                assert lo is None and s["interval"].startswith("none:"), arm
                continue
            assert lo is not None and lo <= s["mean"] <= hi, (arm, metric)
            if metric in (
                "copy_rate",
                "win_rate",
                "rouge_l_neutral",
                "rouge_l_extractive",
                "novel_bigram_rate",
            ):
                assert 0.0 <= lo <= hi <= 1.0, (arm, metric)
    assert "t-interval" not in (one_process / "results.md").read_text()


@pytest.mark.slow
def test_results_open_with_a_reversed_judge(one_process, tmp_path):
    """Job reports whose step-0 coupling has the judge's AUC below 0.5 (edited by hand): results.md names
    the judge reversed in its first lines, before the premise; the real grid's judge is not."""
    import shutil

    from judgeloop.studies.ablation_report import aggregate

    assert "is reversed" not in (one_process / "results.md").read_text()
    out = tmp_path / "reversed"
    shutil.copytree(one_process, out)
    for arm in ("raw", "platt"):
        for seed in (0, 1):
            path = out / arm / f"seed{seed}" / "report.json"
            report = json.loads(path.read_text())
            report["judge_coupling"][0]["auc_label"] = 0.37
            path.write_text(json.dumps(report))
    res = aggregate(_cfg(out))
    assert res["judge_health"]["reversed"] and res["judge_health"]["mean_auc"] == pytest.approx(0.37)
    md = (out / "results.md").read_text().splitlines()
    assert md[2].startswith("**The judge (`embedding` on `judgeloop-tiny/encoder`) is reversed**")
    assert "AUC 0.37 < 0.5 on average; raw:0 0.37, raw:1 0.37, platt:0 0.37, platt:1 0.37" in md[2]
    assert md[4].startswith("**Premise.**")


@pytest.mark.parametrize(("lo", "learns"), [(-0.003, False), (0.004, True)])
def test_the_report_says_what_its_length_can_show_from_the_oracle_arms_gain(lo, learns):
    from judgeloop.studies.ablation_report import scope_lines

    gain = {"delta": 0.014, "ci95": [lo, 0.031], "mdd": 0.024}
    line = scope_lines({"num_steps": 8, "vs_start": {"oracle": {"rouge_l_neutral": gain}}})[0]
    assert line.startswith("**What 8 steps can show.** The `oracle` arm")
    assert f"+0.014 [{lo:+.3f}, +0.031]" in line
    assert ("the policy learns the task at this length" in line) is learns
    assert ("not whether calibration trains a better summarizer" in line) is not learns
    assert ("configs/feedback_loop/study_long.yaml" in line) is not learns  # where to read the longer run
    assert scope_lines({"num_steps": 8, "vs_start": {"raw": {}}}) == []  # no oracle arm: nothing claimed


def _same_figures(new, old, where="results.json"):
    """``new`` equals ``old`` key for key, numbers to 12 significant digits (a last-bit difference in a
    float sum on another CPU is not a changed result; anything else is)."""
    assert type(new) is type(old), where
    if isinstance(old, dict):
        assert list(new) == list(old), where
        for key in old:
            _same_figures(new[key], old[key], f"{where}.{key}")
    elif isinstance(old, list):
        assert len(new) == len(old), where
        for i, (a, b) in enumerate(zip(new, old)):
            _same_figures(a, b, f"{where}[{i}]")
    elif isinstance(old, float):
        assert new == pytest.approx(old, rel=1e-12, abs=1e-15), where
    else:
        assert new == old, where


@pytest.mark.parametrize(
    ("folder", "config", "missing"),
    [
        ("long", "study_long.yaml", 0),  # the whole grid is committed
        (
            "teach",
            "study_teach.yaml",
            0,
        ),  # the whole grid is committed
    ],
)
def test_the_committed_48_step_study_is_what_aggregate_writes_from_its_rows(
    tmp_path, folder, config, missing
):
    """docs/study/long and docs/study/teach: `--aggregate` on a copy of the committed job folders (config,
    metrics, per-article rows, report; no results, plots, shared start work or checkpoints) writes the
    committed results."""
    import shutil

    from judgeloop.studies.ablation_report import aggregate

    study = REPO / "docs" / "study" / folder
    out = tmp_path / folder
    shutil.copytree(study, out, ignore=shutil.ignore_patterns("results.*", "*.png", "_shared"))
    cfg = load_config(AblateConfig, REPO / "configs" / "feedback_loop" / config, [f"output_dir={out}"])
    res = aggregate(cfg, allow_missing=bool(missing))
    assert len(res["missing_jobs"]) == missing and len(res["seeds"]) == 3
    assert (out / "results.md").read_text() == (study / "results.md").read_text()
    _same_figures(
        json.loads((out / "results.json").read_text()), json.loads((study / "results.json").read_text())
    )


def test_fractions_against_the_ceiling_arm_equal_a_hand_computation():
    """recovered_fractions(reference=ceiling) on the committed 48-step rows, with feature_platt's runs
    standing in for a ceiling arm: platt's fraction is mean(platt - raw) / mean(ceiling - raw) over the
    (seed, article) cells; the oracle is left out of it, and results.md gets its own section."""
    import dataclasses

    from judgeloop.studies.ablation_report import (
        RECOVERED_METRIC,
        ceiling_arm,
        recovered_fractions,
        recovered_lines,
        summarize_arm,
    )

    cfg = load_config(
        AblateConfig,
        REPO / "configs" / "feedback_loop" / "study_long.yaml",
        [f"output_dir={REPO / 'docs' / 'study' / 'long'}"],
    )
    finals = {arm: summarize_arm(cfg, arm)[1] for arm in ("raw", "platt", "feature_platt", "oracle")}
    finals["ceiling"] = finals.pop("feature_platt")
    grid = dataclasses.replace(cfg.ablation, arms=["raw", "platt", "ceiling", "oracle"])
    cfg = dataclasses.replace(cfg, ablation=grid)
    assert ceiling_arm(cfg) == "ceiling"
    rec = recovered_fractions(cfg, finals, "ceiling")
    assert list(rec["arms"]) == ["platt"] and rec["reference"] == "ceiling"

    def cells(arm):
        return np.array(
            [[finals[arm][s][i][RECOVERED_METRIC] for i in sorted(finals[arm][s])] for s in (0, 1, 2)]
        )

    raw = cells("raw")
    hand = float(np.mean(cells("platt") - raw) / np.mean(cells("ceiling") - raw))
    platt = rec["arms"]["platt"]
    assert platt["defined"]  # feature_platt's gain over raw on these rows is clearly above 0
    assert platt["fraction"] == pytest.approx(hand, rel=1e-9)
    assert platt["ci95"][0] <= platt["fraction"] <= platt["ci95"][1]
    md = recovered_lines({"recovered_ceiling": rec}, "recovered_ceiling")
    assert md[0] == "## Fraction of the ceiling's gain recovered (`rouge_l_neutral`, against `raw`)"
    # against the oracle, the ceiling has a fraction of its own: what this judge can teach at all
    assert "ceiling" in recovered_fractions(cfg, finals)["arms"]
