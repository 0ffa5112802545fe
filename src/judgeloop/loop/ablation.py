"""The raw-vs-calibrated ablation: the same loop per arm over several seeds, with the same articles
and seeds in every arm, summarized as mean, std and a 95% t-interval over seeds.

Writes ``results.json`` (per arm: final metrics with mean/std/ci95/per-seed values, curves, refits),
``results.md`` (the table a person reads first) and ``curves.png`` (neutral vs extractive ROUGE-L
over steps per arm) under ``output_dir``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from judgeloop.calibration import CalibrationError
from judgeloop.config import replace
from judgeloop.io import atomic_path, atomic_write_json, atomic_write_text
from judgeloop.logging import get_logger
from judgeloop.loop.config import FeedbackLoopConfig

logger = get_logger(__name__)

FINAL_METRICS = (
    "rouge_l_neutral",
    "rouge_1_neutral",
    "rouge_2_neutral",
    "rouge_l_extractive",
    "copy_rate",
    "novel_bigram_rate",
    "length",
    "kl",
    "win_rate",
    "ece",
)
TABLE_METRICS = ("rouge_l_neutral", "rouge_l_extractive", "copy_rate", "length", "kl", "win_rate", "ece")


def summarize(values: Sequence[float | None]) -> dict[str, Any]:
    """Mean, sample std and 95% Student-t interval over seeds (None values are dropped and counted)."""
    xs = np.array([v for v in values if v is not None and math.isfinite(v)], dtype=float)
    out: dict[str, Any] = {"values": list(values), "n": int(xs.size)}
    if xs.size == 0:
        return {**out, "mean": None, "std": None, "ci95": [None, None]}
    mean = float(xs.mean())
    if xs.size == 1:
        return {**out, "mean": mean, "std": None, "ci95": [None, None]}
    from scipy.stats import t

    std = float(xs.std(ddof=1))
    half = float(t.ppf(0.975, xs.size - 1) * std / math.sqrt(xs.size))
    return {**out, "mean": mean, "std": std, "ci95": [mean - half, mean + half]}


def arm_config(cfg: FeedbackLoopConfig, arm: str, seed: int) -> FeedbackLoopConfig:
    out = Path(cfg.output_dir) / arm / f"seed{seed}"
    return replace(
        cfg,
        [
            f"calibration.method={arm}",
            f"seed={seed}",
            f"output_dir={out}",
            "resume_from=null",
            "stop_after_n_steps=null",
        ],
    )


def run_ablation(cfg: FeedbackLoopConfig) -> dict[str, Any]:
    """Run every arm x seed and write the summary files; returns results.json's content."""
    from judgeloop.loop.runner import train

    arms: dict[str, Any] = {}
    for arm in cfg.ablation.arms:
        runs, failed = [], []
        for seed in cfg.ablation.seeds:
            logger.info("ablation: arm=%s seed=%d", arm, seed)
            try:
                runs.append(train(arm_config(cfg, arm, seed)))
            except CalibrationError as err:  # a failed run is reported as failed, never as numbers
                logger.error("ablation: arm=%s seed=%d failed: %s", arm, seed, err)
                failed.append({"seed": seed, "error": str(err)})
        if not runs:
            arms[arm] = {
                "failed": failed,
                "final": {m: summarize([]) for m in FINAL_METRICS},
                "num_refits": 0,
                "num_refits_per_seed": [],
                "refits": [],
                "kept_steps": [],
                "curves": [],
            }
            continue
        final = {m: summarize([r["final"].get(m) for r in runs]) for m in FINAL_METRICS}
        refits = [r["refits"] for r in runs]
        arms[arm] = {
            "final": final,
            "num_refits": int(sum(r["num_refits"] for r in runs)),
            "num_refits_per_seed": [r["num_refits"] for r in runs],
            "refits": refits,
            "kept_steps": [r["kept_step"] for r in runs],
            "failed": failed,
            "curves": [
                {
                    "seed": r["seed"],
                    "steps": [h["step"] for h in r["history"]],
                    **{
                        m: [h.get(m) for h in r["history"]]
                        for m in ("rouge_l_neutral", "rouge_l_extractive", "kl", "ece", "win_rate")
                    },
                }
                for r in runs
            ],
        }
    results = {
        "arms": arms,
        "seeds": list(cfg.ablation.seeds),
        "num_steps": cfg.num_steps,
        "judge": {
            "type": cfg.judge.type,
            "model": cfg.judge.model,
            "prompt": cfg.judge.prompt,
            "embedding_target": cfg.judge.embedding_target,
        },
        "policy": cfg.policy.model,
        "data": {"format": cfg.data.format, "path": cfg.data.path},
    }
    out = Path(cfg.output_dir)
    atomic_write_json(out / "results.json", results)
    atomic_write_text(out / "results.md", results_table(results))
    plot_curves(results, out / "curves.png")
    return results


def _fmt(s: dict[str, Any]) -> str:
    if s["mean"] is None:
        return "n/a"
    if s["ci95"][0] is None:
        return f"{s['mean']:.4f}"
    return f"{s['mean']:.4f} [{s['ci95'][0]:.4f}, {s['ci95'][1]:.4f}]"


def results_table(results: dict[str, Any]) -> str:
    """Markdown table: one row per arm, final metric means with 95% CI over seeds, plus refits."""
    lines = [
        f"# Feedback-loop ablation ({len(results['seeds'])} seeds, {results['num_steps']} steps)",
        "",
        f"Policy `{results['policy']}`; judge `{results['judge']['type']}` on `{results['judge']['model']}`; "
        f"data `{results['data']['format']}`. Mean [95% CI] over seeds of the kept policy, test split.",
        "",
        "| arm | " + " | ".join(TABLE_METRICS) + " | refits (ECE before -> after, mean) |",
        "|---|" + "---|" * (len(TABLE_METRICS) + 1),
    ]
    for arm, res in results["arms"].items():
        recs = [r for seed in res["refits"] for r in seed if r["refit"] and r["reason"] != "initial"]
        before = [r["ece_before"] for r in recs if r["ece_before"] is not None]
        after = [r["ece_after"] for r in recs if r["ece_after"] is not None]
        ref_txt = str(res["num_refits"])
        if before and after:
            ref_txt += f" ({np.mean(before):.3f} -> {np.mean(after):.3f})"
        lines.append(
            f"| {arm} | " + " | ".join(_fmt(res["final"][m]) for m in TABLE_METRICS) + f" | {ref_txt} |"
        )
    lines += [
        "",
        "rouge_l_neutral: the task's real target; rouge_l_extractive / copy_rate: the judge's style; "
        "kl: KL(pi || pi_ref) per summary; win_rate: the judge's preference for the policy over the "
        "reference policy; ece: the arm's calibrator on fresh (greedy, sampled) pairs.",
        "",
    ]
    return "\n".join(lines)


def plot_curves(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for i, (arm, res) in enumerate(results["arms"].items()):
        color = f"C{i}"
        for j, curve in enumerate(res["curves"]):
            for ax, key in zip(axes, ("rouge_l_neutral", "rouge_l_extractive")):
                ys = [np.nan if v is None else v for v in curve[key]]
                ax.plot(
                    curve["steps"],
                    ys,
                    color=color,
                    alpha=0.8,
                    label=arm if j == 0 else None,
                    marker="o",
                    ms=3,
                )
    axes[0].set_title("neutral ROUGE-L (task target)")
    axes[1].set_title("extractive ROUGE-L (judge's style)")
    for ax in axes:
        ax.set_xlabel("step")
        ax.legend()
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)
