"""The model card (``README.md``) of an exported policy: what made it and how well it did.

It names judgeloop's version, the arm (the calibration method the policy was trained against), the
judge and the calibrator, the data, the training settings, the final test metrics of the kept step
with 95% bootstrap intervals over the test articles (the run's own ``per_article.jsonl`` rows), the
calibrator's held-out ECE with its interval from the last refit, and the command that reruns the run
(the config is stored beside the card as ``training_config.yaml``). Its YAML header is what the
Hugging Face Hub reads (``base_model``, ``library_name``, ``tags``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from judgeloop.hashing import derive_seed
from judgeloop.loop.config import FeedbackLoopConfig
from judgeloop.loop.metrics_table import shown_in
from judgeloop.version import __version__

#: ``(per-article key, what it is)`` of each final metric on the card: the metrics table's ``card`` column
CARD_METRICS = tuple((m.per_article, m.label) for m in shown_in("card"))


def bootstrap_mean(values: Sequence[float], n_boot: int = 1000, seed: int = 0) -> tuple[float, float, float]:
    """Mean of the finite ``values`` and its 95% percentile-bootstrap interval (``nan`` when none)."""
    x = np.array([v for v in values if v is not None and np.isfinite(v)], dtype=float)
    if not len(x):
        return (float("nan"),) * 3
    rng = np.random.default_rng(seed)
    means = x[rng.integers(0, len(x), size=(n_boot, len(x)))].mean(axis=1)
    return float(x.mean()), float(np.quantile(means, 0.025)), float(np.quantile(means, 0.975))


def _fmt(x: Any, digits: int = 4) -> str:
    if x is None or (isinstance(x, float) and not np.isfinite(x)):
        return "n/a"
    return f"{x:.{digits}f}"


def final_metric_rows(
    per_article: Sequence[dict[str, Any]], step: int, seed: int
) -> list[tuple[str, str, int, float, float, float]]:
    """``(key, what, n, mean, low, high)`` for each card metric over the test rows of ``step``."""
    rows = [r for r in per_article if r.get("step") == step]
    out = []
    for key, what in CARD_METRICS:
        vals = [r.get(key) for r in rows]
        finite = [v for v in vals if v is not None and np.isfinite(v)]
        mean, lo, hi = bootstrap_mean(finite, seed=derive_seed(seed, "card", key))
        out.append((key, what, len(finite), mean, lo, hi))
    return out


def policy_card(
    cfg: FeedbackLoopConfig, report: dict[str, Any], per_article: Sequence[dict[str, Any]]
) -> str:
    """The exported policy's ``README.md`` for run ``cfg`` with its ``report`` (:func:`~judgeloop.loop.run.finish_run`)."""
    p, j, d = cfg.policy, cfg.judge, cfg.data
    kept = int(report["kept_step"])
    lines = [
        "---",
        f"base_model: {p.model}",
        "library_name: peft" if p.lora else "library_name: transformers",
        "tags:",
        "- judgeloop",
        f"- {cfg.loss.type}",
        *(["- lora"] if p.lora else []),
        "---",
        "",
        f"# {p.model}, trained by judgeloop against the {cfg.calibration.method} arm",
        "",
        f"Made by judgeloop {__version__} (`judgeloop train`): online "
        f"{'DPO' if cfg.loss.type == 'dpo' else 'GRPO'} against a judge whose preferences were mapped to "
        f"probabilities by the `{cfg.calibration.method}` arm, "
        + (
            f"LoRA adapters (r={p.lora_r}, alpha={p.lora_alpha}, on {', '.join(p.lora_target_modules)})"
            if p.lora
            else "full fine-tuning"
        )
        + f" of `{p.model}`.",
        "",
        "## What made it",
        "",
        f"- judge: `{j.name or j.type}` (type `{j.type}`, model `{j.model}`, prompt `{j.prompt}`)",
        f"- calibrator: `{cfg.calibration.method}` (refit every {cfg.calibration.recalibrate_every_n_steps} "
        f"steps, labels: {cfg.calibration.labels}); refits taken: {report.get('num_refits', 0)}",
        f"- data: format `{d.format}`"
        + (f", path `{d.path}`" if d.path else "")
        + (f", {d.embedded_size} embedded articles" if d.format == "embedded" else ""),
        f"- steps: {report['steps_run']} of batch {cfg.batch_size}, learning rate {cfg.optim.learning_rate}, "
        f"KL coefficient {cfg.loss.kl_coef}, seed {cfg.seed}; kept step {kept} ({report['kept_reason']})",
        f"- generation: `{cfg.generation.backend}` backend, temperature {cfg.generation.temperature}, "
        f"top_p {cfg.generation.top_p}, max {cfg.generation.max_new_tokens} new tokens",
        "",
        f"## Final metrics (test split, step {kept})",
        "",
        "Means over the test articles, with 95% bootstrap intervals over those articles (1000 replicates).",
        "",
        "| metric | n | mean | 95% interval |",
        "| --- | --- | --- | --- |",
    ]
    for _key, what, n, mean, lo, hi in final_metric_rows(per_article, kept, cfg.seed):
        lines.append(f"| {what} | {n} | {_fmt(mean)} | [{_fmt(lo)}, {_fmt(hi)}] |")
    taken = [r for r in report.get("refits", []) if r.get("refit")]
    if taken:
        last = taken[-1]
        lo, hi = (last.get("ece_after_ci95") or [None, None])[:2]
        lines += [
            "",
            f"Calibrator's held-out ECE at its last fit (step {last['step']}, {last['n_holdout']} held-out "
            f"pairs): {_fmt(last['ece_after'])}, 95% interval [{_fmt(lo)}, {_fmt(hi)}].",
        ]
    lines += [
        "",
        "## Reproduce",
        "",
        "The run's config is `training_config.yaml` beside this card:",
        "",
        "```bash",
        f"judgeloop train --config training_config.yaml output_dir={cfg.output_dir}",
        "```",
        "",
        "## Load",
        "",
        "```python",
    ]
    if p.lora:
        lines += [
            "from peft import AutoPeftModelForCausalLM",
            "model = AutoPeftModelForCausalLM.from_pretrained('PATH_TO_THIS_FOLDER')",
        ]
    else:
        lines += [
            "from transformers import AutoModelForCausalLM",
            "model = AutoModelForCausalLM.from_pretrained('PATH_TO_THIS_FOLDER')",
        ]
    lines += ["```", ""]
    return "\n".join(lines)
