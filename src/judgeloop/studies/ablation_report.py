"""The ablation's report: from the job folders of an ablation (:mod:`judgeloop.studies.ablation`) to
``results.json``, ``results.md``, ``curves.png`` and ``deltas.png``.

Every final metric is compared per article, paired on (seed, article), against the baseline arm and
against the starting policy (95% two-level bootstrap interval and minimum detectable difference); the
premise check, the numerics every job ran with and the divergence alarms come first in results.md.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from judgeloop.io import atomic_path, atomic_write_json, atomic_write_text
from judgeloop.logging import get_logger
from judgeloop.loop.metrics_table import TARGET, keys, shown_in
from judgeloop.studies.ablation import job_dir, jobs
from judgeloop.studies.ablation_config import AblateConfig
from judgeloop.studies.rounds_report import rounds_lines, rounds_results
from judgeloop.studies.stats import (
    PREMISE_METRICS,
    aligned_differences,
    paired_bootstrap,
    paired_matrix,
    premise_check,
    recovered_fraction,
)

logger = get_logger(__name__)


# The metrics table's columns (:mod:`judgeloop.loop.metrics_table`). Per-article metrics are compared
# paired, by their per-article key (``win`` for ``win_rate``); ECE is a property of a set of pairs, not of
# an article, and is reported per arm only.
FINAL_METRICS = keys("final")
PAIRED_METRICS = tuple(m.per_article for m in shown_in("final") if m.per_article)
TABLE_METRICS = keys("table")
DELTA_TABLE = keys("delta", per_article=True)
ARTICLE_KEY = {m.name: m.per_article for m in shown_in("final") if m.per_article}
# Below this many seeds, a metric with one value per seed (ECE) gets no interval: a bootstrap over 2-4
# values has 3-35 distinct replicates, and a t-interval over 2 seeds (t = 12.7) leaves the metric's range.
MIN_SEEDS_FOR_INTERVAL = 5


def summarize(
    values: Sequence[float | None], cells: np.ndarray | None = None, n_boot: int = 4000, seed: int = 0
) -> dict[str, Any]:
    """Mean and sample std over seeds (None values are dropped and counted) and a 95% interval that lies
    within what the metric can take: the two-level bootstrap of the per-article values ``cells`` (seeds x
    articles, NaN = missing; :func:`judgeloop.studies.stats.paired_bootstrap`, as for the paired deltas), or,
    for a metric with one value per seed, a percentile bootstrap over seeds when there are at least
    ``MIN_SEEDS_FOR_INTERVAL``; otherwise none, and ``interval`` says why. A percentile interval of means
    of values never leaves their range."""
    xs = np.array([v for v in values if v is not None and math.isfinite(v)], dtype=float)
    out: dict[str, Any] = {"values": list(values), "n": int(xs.size)}
    if xs.size == 0:
        return {**out, "mean": None, "std": None, "ci95": [None, None], "interval": "none: no finished run"}
    mean = float(xs.mean())
    std = float(xs.std(ddof=1)) if xs.size > 1 else None
    if cells is not None and np.isfinite(cells).sum() >= 2:
        d = paired_bootstrap(cells, n_boot, seed)
        how = f"two-level bootstrap: {d.n_seeds} seed(s) x articles, {d.n} values"
        return {**out, "mean": mean, "std": std, "ci95": d.ci95, "interval": how}
    if xs.size < MIN_SEEDS_FOR_INTERVAL:
        why = f"none: one value per seed and {xs.size} seed(s); an interval needs >= {MIN_SEEDS_FOR_INTERVAL}"
        return {**out, "mean": mean, "std": std, "ci95": [None, None], "interval": why}
    rng = np.random.default_rng(seed)
    means = xs[rng.integers(0, xs.size, size=(n_boot, xs.size))].mean(axis=1)
    lo, hi = np.percentile(means, [2.5, 97.5])
    how = f"percentile bootstrap over {xs.size} seeds"
    return {**out, "mean": mean, "std": std, "ci95": [float(lo), float(hi)], "interval": how}


def article_cells(per_seed: dict[int, dict[str, dict[str, Any]]], key: str) -> np.ndarray:
    """``(seeds, articles)`` values of one per-article metric (NaN where missing), for :func:`summarize`."""
    vals = _values(per_seed, key)
    ids = sorted({i for arts in vals.values() for i in arts})
    out = np.full((len(vals), len(ids)), np.nan)
    for r, s in enumerate(sorted(vals)):
        for c, i in enumerate(ids):
            v = vals[s].get(i)
            if v is not None:
                out[r, c] = float(v)
    out[~np.isfinite(out)] = np.nan
    return out


def load_run(folder: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A finished job's report and its per-article rows."""
    report = json.loads((folder / "report.json").read_text())
    path = folder / report.get("per_article", "per_article.jsonl")
    rows = (
        [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []
    )
    return report, rows


def _by_article(rows: Sequence[dict[str, Any]], step: int) -> dict[str, dict[str, Any]]:
    return {r["id"]: r for r in rows if r["step"] == step}


def _values(per_seed: dict[int, dict[str, dict[str, Any]]], metric: str) -> dict[int, dict[str, Any]]:
    return {s: {i: r.get(metric) for i, r in arts.items()} for s, arts in per_seed.items()}


CURVE_METRICS = keys("curves")


def summarize_arm(
    cfg: AblateConfig, arm: str
) -> tuple[dict[str, Any], dict[int, Any], dict[int, Any], list[str]]:
    """One arm's summary over its finished seeds, its per-article final and step-0 rows by seed, and the
    jobs that have no report yet."""
    runs, failed, missing = [], [], []
    for seed in cfg.ablation.seeds:
        folder = job_dir(cfg, arm, seed)
        if (folder / "report.json").is_file():
            report, rows = load_run(folder)
            runs.append((seed, report, rows))
        elif (folder / "failed.json").is_file():
            failed.append(json.loads((folder / "failed.json").read_text()))
        else:
            missing.append(f"{arm}:{seed}")
    finals = {s: _by_article(rows, rep["kept_step"]) for s, rep, rows in runs}
    starts = {s: _by_article(rows, 0) for s, rep, rows in runs}
    reports = [rep for _, rep, _ in runs]
    B, bseed = cfg.ablation.bootstrap_samples, cfg.ablation.bootstrap_seed
    summary = {
        "final": {
            m: summarize(
                [r["final"].get(m) for r in reports],
                article_cells(finals, ARTICLE_KEY[m]) if m in ARTICLE_KEY and finals else None,
                B,
                bseed,
            )
            for m in FINAL_METRICS
        },
        "seeds_run": [s for s, *_ in runs],
        "failed": failed,
        "num_refits": int(sum(r["num_refits"] for r in reports)),
        "num_refits_per_seed": [r["num_refits"] for r in reports],
        "refits": [r["refits"] for r in reports],
        "kept_steps": [r["kept_step"] for r in reports],
        "alarms": [r.get("alarms", []) for r in reports],
        "alarm_checks": [len(r.get("alarm_checks", [])) for r in reports],
        "per_article": [
            str(Path(arm) / f"seed{s}" / rep.get("per_article", "per_article.jsonl")) for s, rep, _ in runs
        ],
        "curves": [
            {"seed": r["seed"], "steps": [h["step"] for h in r["history"]]}
            | {m: [h.get(m) for h in r["history"]] for m in CURVE_METRICS}
            for r in reports
        ],
    }
    return summary, finals, starts, missing


def paired_comparisons(
    cfg: AblateConfig, finals: dict[str, dict[int, Any]], starts: dict[str, dict[int, Any]]
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any] | None]:
    """Each arm minus the baseline, each arm minus its start, and the premise check, all paired on
    (seed, article) with the two-level bootstrap."""
    abl = cfg.ablation
    B, bseed, base = abl.bootstrap_samples, abl.bootstrap_seed, abl.baseline
    paired: dict[str, Any] = {}
    vs_start: dict[str, Any] = {}
    for arm in abl.arms:
        if not finals[arm]:
            continue
        if arm != base and finals[base]:
            paired[arm] = {"vs": base}
            for m in PAIRED_METRICS:
                d = paired_matrix(_values(finals[arm], m), _values(finals[base], m))
                paired[arm][m] = paired_bootstrap(d, B, bseed).as_dict()
        vs_start[arm] = {"vs": "step 0"}
        for m in PAIRED_METRICS:
            d = paired_matrix(_values(finals[arm], m), _values(starts[arm], m))
            vs_start[arm][m] = paired_bootstrap(d, B, bseed).as_dict()
    premise = None
    if finals.get(base):
        premise = premise_check(
            starts[base], finals[base], abl.style_metric, abl.style_direction, B, bseed, PREMISE_METRICS
        )
    return paired, vs_start, premise


RECOVERED_METRIC = TARGET


def recovered_fractions(
    cfg: AblateConfig, finals: dict[str, dict[int, Any]], reference: str = "oracle"
) -> dict[str, Any] | None:
    """For every arm but the baseline and the references: the fraction of the ``reference`` arm's gain over
    the baseline on the task's target (neutral ROUGE-L of the kept policy) that it recovers, ``(arm - base)
    / (reference - base)``, with its two-level bootstrap interval
    (:func:`judgeloop.studies.stats.recovered_fraction`); null without that arm. ``reference``: ``oracle``
    (the perfect judge), or an arm whose name holds ``ceiling`` (the best that this judge's information
    allows: the weak-to-strong literature's "performance gap recovered" against it). Against the oracle the
    ceiling arm has a fraction too: how much of the oracle's gain this judge can teach at all."""
    abl = cfg.ablation
    base = abl.baseline
    if reference not in abl.arms or base == reference or not finals.get(reference) or not finals.get(base):
        return None
    out: dict[str, Any] = {"metric": RECOVERED_METRIC, "vs": base, "arms": {}}
    if reference != "oracle":
        out["reference"] = reference
    skip = {base, reference} | ({"oracle"} if reference != "oracle" else set())
    for arm in abl.arms:
        if arm in skip or not finals.get(arm):
            continue
        gain, ref = aligned_differences(
            _values(finals[base], RECOVERED_METRIC),
            _values(finals[arm], RECOVERED_METRIC),
            _values(finals[reference], RECOVERED_METRIC),
        )
        out["arms"][arm] = recovered_fraction(gain, ref, abl.bootstrap_samples, abl.bootstrap_seed)
    return out


def ceiling_arm(cfg: AblateConfig) -> str | None:
    """The grid's ceiling arm (the first whose name holds ``ceiling``), or None."""
    return next((a for a in cfg.ablation.arms if "ceiling" in a), None)


def recovered_lines(results: dict[str, Any], key: str = "recovered") -> list[str]:
    """``results.md``'s section on the recovered fractions of ``results[key]`` (nothing without its
    reference arm)."""
    rec = results.get(key)
    if not rec or not rec["arms"]:
        return []
    base, m, ref = rec["vs"], rec["metric"], rec.get("reference", "oracle")
    first = next(iter(rec["arms"].values()))
    lines = [
        f"## Fraction of the {ref}'s gain recovered (`{m}`, against `{base}`)",
        "",
        f"`(arm - {base}) / ({ref} - {base})` on the kept policies, paired on (seed, article), 95% interval "
        f"from the same bootstrap. The {ref}'s gain over `{base}`: {_fmt_delta(first['oracle_gain'])}.",
        "",
    ]
    if ref != "oracle":
        lines[-1:] = [
            f"`{ref}` is the best calibration of this judge's logit and style features that many oracle labels "
            "fit: the fraction of its gain is how much of what this judge's information allows an arm recovers.",
            "",
        ]
    if not first["defined"]:
        return lines + [
            f"Not defined: the {ref}'s gain over `{base}` is not clearly above 0, so there is no gain to "
            "recover; each arm's own gain is in the paired table above.",
            "",
        ]
    lines += ["| arm | recovered | arm gain |", "|---|---|---|"]
    for arm, r in rec["arms"].items():
        lo, hi = r["ci95"]
        lines.append(f"| {arm} | {r['fraction']:+.2f} [{lo:+.2f}, {hi:+.2f}] | {_fmt_delta(r['arm_gain'])} |")
    return [*lines, ""]


def job_numerics(cfg: AblateConfig) -> dict[str, list[dict[str, Any]]]:
    """Each finished job's ``numerics`` (one entry per start or resume; see
    :func:`judgeloop.devices.numerics`), by ``ARM:SEED``; jobs from before they were recorded are left out."""
    out: dict[str, list[dict[str, Any]]] = {}
    for arm, seed in jobs(cfg):
        path = job_dir(cfg, arm, seed) / "report.json"
        if path.is_file():
            segments = json.loads(path.read_text()).get("numerics")
            if segments:
                out[f"{arm}:{seed}"] = segments
    return out


def check_numerics(cfg: AblateConfig) -> dict[str, Any]:
    """The grid's numerics: an error when its jobs ran at different thread counts (a setting: their float
    rounding differs and training amplifies it into the paired differences); the kernels (CPU or GPU
    type, precision path) of each job, and the jobs resumed with other numerics, for the report to name.

    Raises:
        ConfigError: jobs ran at different intra-op thread counts.
    """
    from judgeloop.config import ConfigError

    found = job_numerics(cfg)
    by_threads: dict[int, list[str]] = {}
    by_kernels: dict[str, list[str]] = {}
    for name, segments in found.items():
        for t in sorted({seg["threads"] for seg in segments}):
            by_threads.setdefault(t, []).append(name)
        kernels = " / ".join(sorted({f"{seg['kernels']} {seg['precision']}" for seg in segments}))
        by_kernels.setdefault(kernels, []).append(name)
    if len(by_threads) > 1:
        listed = "; ".join(f"{t} thread(s): {', '.join(names)}" for t, names in sorted(by_threads.items()))
        raise ConfigError(
            f"--aggregate: the jobs under {cfg.output_dir} ran at different intra-op thread counts ({listed}), "
            "so their numbers differ by float rounding as well as by arm and seed; rerun them at one count "
            "(set ablation.threads_per_job; a finished job made at another count is rerun)"
        )
    resumed = [
        name
        for name, segments in found.items()
        if len({(seg["threads"], seg["kernels"], seg["precision"]) for seg in segments}) > 1
    ]
    return {
        "threads": next(iter(by_threads), None),
        "kernels": by_kernels,
        "resumed_with_other_numerics": resumed,
    }


def judge_reversal(cfg: AblateConfig) -> dict[str, Any] | None:
    """Whether the training judge is reversed on the finished jobs' step-0 calibration pairs: the AUC of
    its logit for the ROUGE label (``judge_coupling``, both orientations) per job, and ``reversed`` when
    their mean is below 0.5 (:mod:`judgeloop.calibration.health`). None when no job measured it (the
    oracle arm does not). The loop scores one order per pair, so position-only is not measured here."""
    aucs: dict[str, float] = {}
    for arm, seed in jobs(cfg):
        path = job_dir(cfg, arm, seed) / "report.json"
        if not path.is_file():
            continue
        coupling = json.loads(path.read_text()).get("judge_coupling") or []
        first = next((c for c in coupling if c.get("step") == 0 and c.get("auc_label") is not None), None)
        if first is not None:
            aucs[f"{arm}:{seed}"] = float(first["auc_label"])
    if not aucs:
        return None
    mean = float(np.mean(list(aucs.values())))
    return {"auc_label": aucs, "mean_auc": mean, "reversed": mean < 0.5}


def unfinished_jobs(cfg: AblateConfig) -> tuple[list[str], list[str]]:
    """The grid's jobs with no ``report.json``: (not run or stopped, failed), each as ``ARM:SEED``."""
    missing: list[str] = []
    failed: list[str] = []
    for arm, seed in jobs(cfg):
        folder = job_dir(cfg, arm, seed)
        if not (folder / "report.json").is_file():
            (failed if (folder / "failed.json").is_file() else missing).append(f"{arm}:{seed}")
    return missing, failed


def check_finished(cfg: AblateConfig, allow_missing: bool) -> None:
    """Before aggregating: an error when no job has finished, and, unless ``allow_missing``, when some
    have not (naming them).

    Raises:
        ConfigError: no finished job, or unfinished ones without ``allow_missing``.
    """
    from judgeloop.config import ConfigError

    missing, failed = unfinished_jobs(cfg)
    total = len(jobs(cfg))
    if len(missing) + len(failed) == total:
        raise ConfigError(
            f"--aggregate: no job has finished under {cfg.output_dir} (0 of {total} have a report.json); run "
            "them first, one per line of --list-jobs (judgeloop ablate ... --job ARM:SEED), or check output_dir"
        )
    if (missing or failed) and not allow_missing:
        parts = [f"not finished: {', '.join(missing)}"] if missing else []
        parts += [f"failed: {', '.join(failed)} (see their failed.json)"] if failed else []
        raise ConfigError(
            f"--aggregate: {len(missing) + len(failed)} of {total} jobs under {cfg.output_dir} have no report "
            f"({'; '.join(parts)}); run them with --job ARM:SEED, or pass --allow-missing to aggregate the "
            f"{total - len(missing) - len(failed)} finished ones"
        )


def aggregate(cfg: AblateConfig, allow_missing: bool = False) -> dict[str, Any]:
    """Build ``results.json`` / ``results.md`` / plots from the job folders under ``cfg.output_dir``.

    Every job must have finished unless ``allow_missing`` (:func:`check_finished`); then the missing and
    failed ones are listed first, and every paired comparison uses the (seed, article) pairs both of its
    arms have (counted in the table). Every number comes from the per-article rows of the runs that exist.
    """
    abl = cfg.ablation
    check_finished(cfg, allow_missing)
    numerics = check_numerics(cfg)
    arms: dict[str, Any] = {}
    finals: dict[str, dict[int, Any]] = {}
    starts: dict[str, dict[int, Any]] = {}
    missing: list[str] = []
    for arm in abl.arms:
        arms[arm], finals[arm], starts[arm], gone = summarize_arm(cfg, arm)
        missing += gone
    paired, vs_start, premise = paired_comparisons(cfg, finals, starts)
    recovered, ceiling = recovered_fractions(cfg, finals), ceiling_arm(cfg)
    n_articles = sorted({len(v) for arm in finals.values() for v in arm.values()})
    results = {
        "premise": premise,
        "paired": paired,
        "recovered": recovered,
        **({"recovered_ceiling": recovered_fractions(cfg, finals, ceiling)} if ceiling else {}),
        "vs_start": vs_start,
        "arms": arms,
        "baseline": abl.baseline,
        "seeds": list(abl.seeds),
        "articles_per_seed": n_articles,
        "missing_jobs": missing,
        "numerics": numerics,
        "num_steps": cfg.max_steps,
        "bootstrap": {
            "samples": abl.bootstrap_samples,
            "seed": abl.bootstrap_seed,
            "method": "two-level: seeds with replacement, then articles with replacement within each seed; "
            "percentile 95% interval; mdd = 2.8 x bootstrap SE (80% power, 5% two-sided)",
        },
        "judge_health": judge_reversal(cfg),
        "judge": {
            "type": cfg.judge.type,
            "model": cfg.judge.model,
            "prompt": cfg.judge.prompt,
            "embedding_target": cfg.judge.embedding_target,
        },
        "policy": cfg.policy.model,
        "data": {"format": cfg.data.format, "path": cfg.data.path},
    }
    if cfg.mode == "rounds":  # the account's table: every round, each arm and each arm against the baseline
        results["rounds"] = rounds_results(cfg)
    out = Path(cfg.output_dir)
    atomic_write_json(out / "results.json", results)
    atomic_write_text(out / "results.md", results_table(results))
    if any(finals.values()):
        plot_curves(results, out / "curves.png")
        plot_deltas(results, out / "deltas.png")
    return results


# --- the report -----------------------------------------------------------------------------------


def _fmt(s: dict[str, Any]) -> str:
    if s["mean"] is None:
        return "n/a"
    if s["ci95"][0] is None:
        return f"{s['mean']:.4f}"
    return f"{s['mean']:.4f} [{s['ci95'][0]:.4f}, {s['ci95'][1]:.4f}]"


def _fmt_delta(d: dict[str, Any] | None, mdd: bool = True) -> str:
    if not d or d["delta"] is None:
        return "n/a"
    if d["ci95"][0] is None:
        return f"{d['delta']:+.3f}"
    mark = "**" if d["ci95"][0] > 0 or d["ci95"][1] < 0 else ""
    txt = f"{mark}{d['delta']:+.3f} [{d['ci95'][0]:+.3f}, {d['ci95'][1]:+.3f}]{mark}"
    return txt + (f" (mdd {d['mdd']:.3f})" if mdd and d.get("mdd") is not None else "")


def _pairs(res: dict[str, Any]) -> str:
    """'N (S seeds)': the (seed, article) cells a paired comparison used (those both arms have)."""
    d = res.get("rouge_l_neutral") or {}
    seeds = d.get("n_seeds", 0)
    return f"{d.get('n', 0)} ({seeds} seed{'' if seeds == 1 else 's'})"


def _delta_table(by_arm: dict[str, Any], paired: bool) -> list[str]:
    """A markdown table of each arm's deltas (DELTA_TABLE); against the baseline (``paired``) it also gives
    the pairs used and the minimum detectable differences."""
    head = "| arm | pairs | " if paired else "| arm | "
    lines = [head + " | ".join(DELTA_TABLE) + " |", "|" + "---|" * (1 + paired + len(DELTA_TABLE))]
    for arm, res in by_arm.items():
        cells = [arm, _pairs(res)] if paired else [arm]
        cells += [_fmt_delta(res[m], mdd=paired) for m in DELTA_TABLE]
        lines.append("| " + " | ".join(cells) + " |")
    return [*lines, ""]


def scope_lines(results: dict[str, Any]) -> list[str]:
    """One line on what this run's length can show, from the oracle arm's own gain on the task's target
    (neutral ROUGE-L from its start): a run whose perfect judge does not clearly improve the policy can
    show whether an arm corrects the judge's bias, not whether it trains a better summarizer."""
    gain = (results.get("vs_start", {}).get("oracle") or {}).get("rouge_l_neutral")
    if not gain or gain["delta"] is None:
        return []
    head = (
        f"**What {results['num_steps']} steps can show.** The `oracle` arm (the neutral ROUGE labeler as the "
        f"judge: a perfect judge of the target) moved neutral ROUGE-L from its start by {_fmt_delta(gain)}"
    )
    if gain["ci95"][0] is not None and gain["ci95"][0] > 0:
        return [
            head + ": the policy learns the task at this length, so gains on the target are measurable.",
            "",
        ]
    return [
        head + ": at this length even a perfect judge does not clearly teach the task, so this run can show "
        "whether an arm corrects the judge's bias (the style columns), not whether calibration trains a better "
        "summarizer; docs/study.md reports the loop at 48 steps of 8 articles "
        "(configs/feedback_loop/study_long.yaml), where it does.",
        "",
    ]


def opening_lines(results: dict[str, Any]) -> list[str]:
    """What ``results.md`` says before the premise: a reversed judge, then the jobs the grid lacks."""
    lines: list[str] = []
    health = results.get("judge_health")
    if health and health["reversed"]:
        listed = ", ".join(f"{job} {v:.2f}" for job, v in health["auc_label"].items())
        lines += [
            f"**The judge (`{results['judge']['type']}` on `{results['judge']['model']}`) is reversed**: on the "
            f"step-0 calibration pairs its logit ranks the ROUGE labels below chance (AUC {health['mean_auc']:.2f} "
            f"< 0.5 on average; {listed}). It prefers the worse summary; the calibrated arms fit a reversed map "
            "to it, and the raw arm trains toward what it wrongly prefers.",
            "",
        ]
    lines += scope_lines(results)
    failed = [f"{f['arm']}:{f['seed']}" for arm in results["arms"].values() for f in arm["failed"]]
    if results["missing_jobs"] or failed:
        lines += [
            "**Incomplete grid.** "
            + (
                f"Missing jobs (no report): {', '.join(results['missing_jobs'])}. "
                if results["missing_jobs"]
                else ""
            )
            + (f"Failed jobs: {', '.join(failed)}. " if failed else "")
            + "Each paired comparison below uses only the (seed, article) pairs both of its arms have "
            "(column `pairs`).",
            "",
        ]
    return lines


def results_table(results: dict[str, Any]) -> str:
    """``results.md``: the premise in words, the paired table against the baseline, then absolute values."""
    base = results["baseline"]
    n_art = results["articles_per_seed"]
    arts = "/".join(str(n) for n in n_art) if n_art else "0"
    title = f"{len(results['seeds'])} seeds x {arts} test articles, {results['num_steps']} steps"
    unfinished = len(results["missing_jobs"]) + sum(len(arm["failed"]) for arm in results["arms"].values())
    if unfinished:  # the grid planned, and how much of it the figures below rest on
        total = len(results["arms"]) * len(results["seeds"])
        title += f"; {total - unfinished} of {total} jobs finished"
    lines = [f"# Feedback-loop ablation ({title})", ""]
    lines += opening_lines(results)
    premise = results["premise"]
    lines.append(
        f"**Premise.** {premise['sentence']}" if premise else "**Premise.** No baseline runs to check it."
    )
    lines.append("")
    lines += numerics_lines(results.get("numerics"))
    if premise:
        lines += [
            f"Change of the `{base}` arm from the starting policy (step 0) to the kept policy, paired on (seed, "
            "article), 95% interval; bold when the interval excludes 0:",
            "",
            "| " + " | ".join(premise["metrics"]) + " |",
            "|" + "---|" * len(premise["metrics"]),
            "| " + " | ".join(_fmt_delta(d, mdd=False) for d in premise["metrics"].values()) + " |",
            "",
        ]
    if results["paired"]:
        lines += [
            f"## Paired differences against `{base}` (kept policy, test split)",
            "",
            "Arm minus baseline per (seed, article), mean [95% interval] (minimum detectable difference at "
            "80% power); bold when the interval excludes 0.",
            "",
            *_delta_table(results["paired"], paired=True),
        ]
    lines += recovered_lines(results) + recovered_lines(results, "recovered_ceiling")
    if results["vs_start"]:
        lines += [
            "## Change from the starting policy (each arm, paired)",
            "",
            *_delta_table(results["vs_start"], paired=False),
        ]
    lines += [
        "## Absolute values",
        "",
        f"Policy `{results['policy']}`; judge `{results['judge']['type']}` on `{results['judge']['model']}`; "
        f"data `{results['data']['format']}`. Mean over seeds of the kept policy [95% interval: the two-level "
        "bootstrap over (seed, article), as for the paired differences; `ece` is one value per seed and gets "
        f"an interval (a bootstrap over seeds) only with >= {MIN_SEEDS_FOR_INTERVAL} seeds].",
        "",
        "| arm | "
        + " | ".join(TABLE_METRICS)
        + " | refits (held-out ECE before -> after, mean; kept previous) |",
        "|---|" + "---|" * (len(TABLE_METRICS) + 1),
    ]
    for arm, res in results["arms"].items():
        recs = [r for seed in res["refits"] for r in seed if r["reason"] != "initial"]
        before = [r["ece_before"] for r in recs if r["ece_before"] is not None]
        after = [r["ece_after"] for r in recs if r["ece_after"] is not None]
        kept = sum(1 for r in recs if r.get("kept_previous"))
        ref_txt = str(res["num_refits"])
        if before and after:
            ref_txt += f" ({np.mean(before):.3f} -> {np.mean(after):.3f}; {kept} kept)"
        init = [r["n_fit"] for seed in res["refits"] for r in seed if r["reason"] == "initial"]
        if init:
            ref_txt += f"; first fit on {min(init)}-{max(init)} pairs"
        lines.append(
            f"| {arm} | " + " | ".join(_fmt(res["final"][m]) for m in TABLE_METRICS) + f" | {ref_txt} |"
        )
    b = results["bootstrap"]
    lines += [
        "",
        glossary(),
        "",
        f"Method: {b['method']}; {b['samples']} replicates, seed {b['seed']}. "
        + (
            "With fewer than 5 seeds the seed level is resampled from few distinct draws and its variance is "
            "underestimated: read the intervals as article-level ones. "
            if len(results["seeds"]) < 5
            else ""
        )
        + "Per-article rows of every run: `results.json` -> `arms.<arm>.per_article`.",
        "",
    ]
    rounds = rounds_lines(results["rounds"]) if results.get("rounds") else []
    return "\n".join(lines + rounds + alarm_lines(results))


def glossary() -> str:
    """The line under ``results.md``'s table of absolute values: what each metric tells (the metrics table's
    ``legend`` column; side-by-side metrics with the same gloss share an entry)."""
    groups: list[tuple[list[str], str]] = []
    for m in shown_in("legend"):
        if groups and groups[-1][1] == m.gloss:
            groups[-1][0].append(m.per_article or m.name)
        else:
            groups.append(([m.per_article or m.name], m.gloss))
    return "; ".join(f"{' / '.join(names)}: {gloss}" for names, gloss in groups) + "."


def numerics_lines(numerics: dict[str, Any] | None) -> list[str]:
    """A warning in ``results.md`` when the jobs ran on different kernels or were resumed with other
    numerics (their numbers then differ by float rounding too); nothing when they all agree."""
    if not numerics:
        return []
    lines = []
    if len(numerics["kernels"]) > 1:
        listed = "; ".join(f"`{k}`: {', '.join(names)}" for k, names in numerics["kernels"].items())
        lines.append(
            f"**Numerics differ between jobs** ({listed}): beside arm and seed, their numbers differ by "
            "float rounding, which training amplifies."
        )
    if numerics["resumed_with_other_numerics"]:
        lines.append(
            "Resumed with other numerics than they started with (float rounding differs from an "
            f"uninterrupted run): {', '.join(numerics['resumed_with_other_numerics'])}."
        )
    return [*lines, ""] if lines else []


def alarm_lines(results: dict[str, Any]) -> list[str]:
    """The divergence-alarm section of ``results.md`` (none when no arm ran a check)."""
    arms = {a: r for a, r in results["arms"].items() if sum(r.get("alarm_checks", [])) > 0}
    if not arms:
        return []
    lines = [
        "## Divergence alarms",
        "",
        "Agreement of the training judge with each objective signal (and of panel members with each other) "
        "on fresh calibration-split pairs; an alarm is a rolling agreement below the threshold.",
        "",
        "| arm | checks | alarms (seeds with one) | lowest agreement [95% CI], channel, step |",
        "|---|---|---|---|",
    ]
    for arm, res in arms.items():
        fired = [a for seed in res["alarms"] for a in seed]
        seeds = sum(1 for seed in res["alarms"] if seed)
        low = min(fired, key=lambda a: a["agreement"], default=None)
        where = (
            f"{low['agreement']:.3f} [{low['ci95'][0]:.3f}, {low['ci95'][1]:.3f}], {low['channel']}, step {low['step']}"
            if low
            else "none below the threshold"
        )
        lines.append(f"| {arm} | {sum(res['alarm_checks'])} | {len(fired)} ({seeds}) | {where} |")
    return [*lines, ""]


def plot_curves(results: dict[str, Any], path: Path) -> None:
    """Means over seeds per step, with the min-max band over seeds, for three metrics."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(m.name, m.title) for m in shown_in("figure")]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for i, (arm, res) in enumerate(results["arms"].items()):
        if not res["curves"]:
            continue
        steps = sorted({s for c in res["curves"] for s in c["steps"]})
        for ax, (key, title) in zip(axes, panels):
            table = np.full((len(res["curves"]), len(steps)), np.nan)
            for r, c in enumerate(res["curves"]):
                for s, v in zip(c["steps"], c[key]):
                    table[r, steps.index(s)] = np.nan if v is None else v
            with np.errstate(all="ignore"):
                mean = np.nanmean(table, 0)
                lo, hi = np.nanmin(table, 0), np.nanmax(table, 0)
            ax.plot(steps, mean, color=f"C{i}", marker="o", ms=3, label=f"{arm} ({len(res['curves'])} seeds)")
            ax.fill_between(steps, lo, hi, color=f"C{i}", alpha=0.15)
            ax.set_title(title)
    for ax in axes:
        ax.set_xlabel("step")
        ax.legend(fontsize=8)
    fig.suptitle("mean over seeds; band: min-max over seeds")
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)


def plot_deltas(results: dict[str, Any], path: Path) -> None:
    """Forest plot: each arm's paired delta (vs the baseline) with its 95% interval, three metrics."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = (
        [("premise: " + results["baseline"] + " final - step 0", results["premise"]["metrics"])]
        if results["premise"]
        else []
    )
    rows += [(f"{arm} - {res['vs']}", res) for arm, res in results["paired"].items()]
    fig, axes = plt.subplots(1, 3, figsize=(15, 1.2 + 0.5 * max(len(rows), 1)), sharey=True)
    for ax, key in zip(axes, keys("figure", per_article=True)):
        for y, (_label, res) in enumerate(rows):
            d = res.get(key)
            if not d or d["delta"] is None:
                continue
            lo, hi = d["ci95"]
            err = None if lo is None else [[d["delta"] - lo], [hi - d["delta"]]]
            ax.errorbar(
                d["delta"],
                y,
                xerr=err,
                fmt="o",
                color="C3" if y == 0 and results["premise"] else "C0",
                capsize=3,
            )
        ax.axvline(0, color="grey", lw=0.8, ls="--")
        ax.set_title(f"delta {key}")
        ax.set_yticks(range(len(rows)), [r[0] for r in rows])
        ax.invert_yaxis()
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)
