"""The validation curve: is the policy learning the task, and is the judge still giving it a signal?

Every ``curve.every_n_steps`` (and at step 0) the current policy summarizes a fixed subset of the
validation split (the first ``curve.num_articles`` articles, the same ones each time): one greedy
summary and one sample per article (the sample drawn from the same seed at every point, so the
curve's noise is common to its points). Each point holds, with 95% percentile-bootstrap intervals over
the articles:

* neutral ROUGE-L of the greedy and of the sampled summaries (the task's target), and the greedy
  summary's **gain from step 0**, paired on the article (the figure that says whether the loop learns);
* the style metrics (extractive ROUGE-L: how far toward the judge's style; copy rate; length);
* KL(pi || pi_ref) (k1 on the sample);
* the judge's signal over the steps since the last point: the mean |soft target - 0.5| of the pairs
  that entered the DPO loss (``target_margin``), or the mean |advantage| under GRPO
  (``advantage_abs_mean``); a calibrator that shrinks p toward 0.5 flattens the objective, and this
  column shows it next to the calibrator's latest ECE.

The test split is never read here: settings (the length of a run, the learning rate, the KL weight) are
chosen on this curve.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from accelerate.utils import gather_object

from judgeloop.data import SummExample
from judgeloop.distributed import real_part, shard
from judgeloop.hashing import derive_seed
from judgeloop.intervals import bootstrap_mean_interval
from judgeloop.io import finite_or_none
from judgeloop.loop.config import FeedbackLoopConfig
from judgeloop.loop.evaluation import greedy_text_metrics
from judgeloop.loop.metrics_table import keys
from judgeloop.loop.policy import Policy
from judgeloop.loop.state import LoopState
from judgeloop.metrics.text import rouge_max

#: per-article values of a curve point: greedy summary's metrics, the sample's neutral ROUGE-L, its KL
#: (the metrics table's ``curve`` column)
ROW_KEYS = keys("curve", per_article=True)
#: the judge's signal in a step's training row, per objective
SIGNAL_KEYS = ("target_margin", "advantage_abs_mean")


def curve_articles(validation: Sequence[SummExample], cfg: FeedbackLoopConfig) -> list[SummExample]:
    """The curve's fixed validation subset: the first ``curve.num_articles`` of the validation split."""
    return list(validation[: cfg.curve.num_articles])


def curve_due(cfg: FeedbackLoopConfig, step: int) -> bool:
    """Whether the curve has a point at ``step`` (step 0 always, when the curve is on; and the last step)."""
    every = cfg.curve.every_n_steps
    return bool(every) and (step % every == 0 or step == cfg.max_steps)


def curve_rows(
    policy: Policy, examples: Sequence[SummExample], cfg: FeedbackLoopConfig, step: int
) -> list[dict[str, Any]]:
    """Per-article rows of the curve at ``step`` (every process summarizes its shard, the policy
    generating where its backend says; all rows returned on every process, in article order)."""
    accelerator = policy.accelerator
    mine = shard(examples, accelerator)
    gen, bs = cfg.generation, cfg.eval_batch_size
    seed = derive_seed(cfg.seed, "curve", accelerator.process_index)  # the same at every point
    rows: list[dict[str, Any]] = []
    if mine:
        _, texts = greedy_text_metrics(policy, mine, gen, bs)
        kls, samples = policy.sampled_kl(mine, gen, bs, seed)
        for ex, t, s, k in zip(mine, texts, samples, kls):
            values = {
                **t,
                "sampled_rouge_l_neutral": rouge_max(s, ex.neutral)["rougeL"] if ex.neutral else np.nan,
                "kl": np.nan if k is None else float(k),
            }
            rows.append({"step": step, "id": ex.id, **{key: values[key] for key in ROW_KEYS}})
    return [finite_or_none(r) for r in gather_object(real_part(rows, len(examples), accelerator))]


def _values(rows: Sequence[dict[str, Any]], key: str) -> np.ndarray:
    return np.array([np.nan if r.get(key) is None else r[key] for r in rows], dtype=float)


def _mean_ci(x: np.ndarray, seed: int) -> dict[str, Any]:
    finite = x[np.isfinite(x)]
    mean = float(finite.mean()) if finite.size else float("nan")
    lo, hi = bootstrap_mean_interval(finite, seed=seed)
    return {"mean": mean, "ci95": [lo, hi], "n": int(finite.size)}


def curve_point(
    rows: Sequence[dict[str, Any]],
    start_rows: Sequence[dict[str, Any]],
    train_log: Sequence[dict[str, Any]],
    since_step: int,
    step: int,
    ece: float | None,
    seed: int = 0,
) -> dict[str, Any]:
    """One point of the curve from its per-article ``rows`` and step 0's (``start_rows``): each metric's
    mean with its interval, the paired gain from step 0, and the judge's signal over the training rows
    of steps ``since_step + 1 .. step``."""
    point: dict[str, Any] = {"step": step}
    for key in ROW_KEYS:
        point[key] = _mean_ci(_values(rows, key), seed)
    start = {r["id"]: r for r in start_rows}
    for key in keys("gain", per_article=True):
        diffs = np.array(
            [
                (r[key] if r.get(key) is not None else np.nan)
                - (start[r["id"]][key] if start.get(r["id"], {}).get(key) is not None else np.nan)
                for r in rows
            ],
            dtype=float,
        )
        point[f"{key}_gain"] = _mean_ci(diffs, seed)
    window = [t for t in train_log if since_step < t["step"] <= step]
    for key in SIGNAL_KEYS:
        vals = _values(window, key)
        if np.isfinite(vals).any():
            point["signal"] = {
                "key": key,
                "mean": float(np.nanmean(vals)),
                "steps": int(np.isfinite(vals).sum()),
            }
    point["ece"] = ece
    return finite_or_none(point)


def record_curve_point(
    state: LoopState, rows: Sequence[dict[str, Any]], step: int, seed: int
) -> dict[str, Any]:
    """Add the point at ``step`` (and its rows) to the run's state; returns the point."""
    start_rows = rows if step == 0 else [r for r in state.curve_rows if r["step"] == 0]
    state.curve_rows = [r for r in state.curve_rows if r["step"] != step] + list(rows)
    since = max((p["step"] for p in state.curve if p["step"] < step), default=0)
    ece = state.last_monitored_ece
    if ece is None:
        taken = [r for r in state.refits if r.get("refit")]
        ece = taken[-1].get("ece_after") if taken else None
    point = curve_point(rows, start_rows, state.train_log, since, step, ece, seed)
    state.curve = [p for p in state.curve if p["step"] != step] + [point]
    return point


def curve_log(point: dict[str, Any]) -> dict[str, float]:
    """The point's means, flat, for the trackers (``curve/KEY``)."""
    out = {k: v["mean"] for k, v in point.items() if isinstance(v, dict) and "mean" in v and "ci95" in v}
    if "signal" in point:
        out["signal"] = point["signal"]["mean"]
    if point.get("ece") is not None:
        out["ece"] = point["ece"]
    return {k: v for k, v in out.items() if v is not None}


def curve_table(curve: Sequence[dict[str, Any]]) -> list[str]:
    """Markdown table of the curve (validation subset; means with 95% intervals)."""

    def ci(v: dict[str, Any] | None, signed: bool = False) -> str:
        if not v or v.get("mean") is None:
            return "-"
        lo, hi = (v.get("ci95") or [None, None])[:2]
        f = "{:+.4f}" if signed else "{:.4f}"
        inner = "" if lo is None or hi is None else f" [{f.format(lo)}, {f.format(hi)}]"
        return f.format(v["mean"]) + inner

    lines = [
        "| step | neutral ROUGE-L (greedy) | gain from step 0 | sampled | extractive ROUGE-L | copy rate | KL "
        "| judge signal | ECE |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for p in sorted(curve, key=lambda p: p["step"]):
        sig = p.get("signal")
        sig_s = f"{sig['mean']:.4f} ({sig['key']})" if sig and sig.get("mean") is not None else "-"
        ece = "-" if p.get("ece") is None else f"{p['ece']:.4f}"
        lines.append(
            f"| {p['step']} | {ci(p.get('rouge_l_neutral'))} | {ci(p.get('rouge_l_neutral_gain'), True)} "
            f"| {ci(p.get('sampled_rouge_l_neutral'))} | {ci(p.get('rouge_l_extractive'))} "
            f"| {ci(p.get('copy_rate'))} | {ci(p.get('kl'))} | {sig_s} | {ece} |"
        )
    return lines


def plot_curve(curve: Sequence[dict[str, Any]], path: Any, title: str = "") -> None:
    """``curve.png``: neutral ROUGE-L gain from step 0, extractive ROUGE-L, KL and the judge's signal
    per step, each mean with its 95% band over the validation subset."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from judgeloop.io import atomic_path

    pts = sorted(curve, key=lambda p: p["step"])
    steps = [p["step"] for p in pts]
    panels = (
        ("rouge_l_neutral_gain", "neutral ROUGE-L gain from step 0"),
        ("rouge_l_extractive", "extractive ROUGE-L (judge's style)"),
        ("kl", "KL(pi || pi_ref)"),
    )
    fig, axes = plt.subplots(1, 4, figsize=(18, 4))
    for ax, (key, name) in zip(axes, panels):
        mean = [np.nan if (p.get(key) or {}).get("mean") is None else p[key]["mean"] for p in pts]
        lo = [
            np.nan if not (p.get(key) or {}).get("ci95") or p[key]["ci95"][0] is None else p[key]["ci95"][0]
            for p in pts
        ]
        hi = [
            np.nan if not (p.get(key) or {}).get("ci95") or p[key]["ci95"][1] is None else p[key]["ci95"][1]
            for p in pts
        ]
        ax.plot(steps, mean, marker="o", ms=3)
        ax.fill_between(steps, lo, hi, alpha=0.2)
        ax.set_title(name)
        ax.set_xlabel("step")
    ax = axes[3]
    sig = [np.nan if not p.get("signal") else p["signal"]["mean"] for p in pts]
    ax.plot(steps, sig, marker="o", ms=3, label="judge signal")
    ece = [np.nan if p.get("ece") is None else p["ece"] for p in pts]
    ax.plot(steps, ece, marker="s", ms=3, label="ECE")
    ax.set_title("judge signal and ECE")
    ax.set_xlabel("step")
    ax.legend(fontsize=8)
    fig.suptitle(title or "validation curve (band: 95% bootstrap interval over articles)")
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)
