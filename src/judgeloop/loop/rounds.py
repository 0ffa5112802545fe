"""The rounds' account of one run under ``mode: rounds`` (iterated batch DPO): each round's figures.

Round 0 is the starting policy, round r the policy after r rounds. Each row holds the metrics the
metrics table shows in its ``rounds`` column (:mod:`judgeloop.loop.metrics_table`: ROUGE-1 against the
neutral references, ROUGE-1 against the extractive ones, the copy rate) as means over the test articles
with a 95% bootstrap interval over the articles, and each one's change from round 0 paired on the article
with its interval; then what the round trained on (its pairs, those in the loss, the mean calibrated p,
the optimizer steps, the DPO loss and KL) and the calibrator it used (the fit before it, on fresh
calibration-split samples of the policy that generated its pairs, with its held-out ECE).
:func:`round_rows` builds them from the run's state, :func:`rounds_markdown` is ``rounds.md``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from judgeloop.hashing import derive_seed
from judgeloop.intervals import bootstrap_mean_interval
from judgeloop.loop.metrics_table import shown_in
from judgeloop.loop.state import LoopState

TRAINED = ("p_mean", "kept_fraction", "optimizer_steps", "dpo_loss", "kl")


def _interval(x: np.ndarray, seed: int) -> dict[str, Any]:
    """The mean of the finite values and its 95% bootstrap interval."""
    ok = x[np.isfinite(x)]
    if ok.size == 0:
        return {"mean": None, "ci95": [None, None], "n": 0}
    lo, hi = bootstrap_mean_interval(ok, seed=seed)
    fin = [float(v) if np.isfinite(v) else None for v in (lo, hi)]
    return {"mean": float(ok.mean()), "ci95": fin, "n": int(ok.size)}


def round_rows(state: LoopState, batch_size: int, seed: int) -> list[dict[str, Any]]:
    """One row per evaluated round (the run's evaluations at steps 0..R; under ``mode: rounds`` a step is
    a round), from ``state.per_article``, ``state.train_log`` and ``state.refits``; ``batch_size``: the
    round's articles (``rounds.prompts_per_round``), for its pair count."""
    by_step: dict[int, dict[str, dict[str, Any]]] = {}
    for r in state.per_article:
        by_step.setdefault(int(r["step"]), {})[r["id"]] = r
    if 0 not in by_step:
        return []
    ids = sorted(by_step[0])
    trained = {int(t["step"]): t for t in state.train_log}
    fits = [f for f in state.refits if f.get("refit")]
    rows = []
    for step in sorted(by_step):
        arts = by_step[step]
        row: dict[str, Any] = {"round": step, "articles": len(arts)}
        for m in shown_in("rounds"):
            now = np.array([_finite(arts.get(i, {}).get(m.per_article)) for i in ids])
            start = np.array([_finite(by_step[0][i].get(m.per_article)) for i in ids])
            row[m.name] = _interval(now, derive_seed(seed, "rounds", m.name, step))
            if step:
                row[f"{m.name}_change"] = _interval(
                    now - start, derive_seed(seed, "rounds_change", m.name, step)
                )
        if step in trained:
            t = trained[step]
            row["trained"] = {k: t.get(k) for k in TRAINED}
            kept = t.get("kept_fraction")
            row["trained"]["pairs"] = batch_size
            row["trained"]["pairs_in_loss"] = None if kept is None else round(kept * batch_size)
        used = [f for f in fits if f["step"] < step]  # the calibrator this round's pairs were mapped by
        if step and used:
            f = used[-1]
            row["calibrator"] = {"fit_at": f["step"], "n_fit": f["n_fit"], "heldout_ece": f["ece_after"]}
        rows.append(row)
    return rows


def _finite(v: Any) -> float:
    return float(v) if v is not None and np.isfinite(float(v)) else np.nan


def _ci(d: dict[str, Any] | None, signed: bool = False) -> str:
    if not d or d.get("mean") is None:
        return "n/a"
    lo, hi = d["ci95"]
    fmt = "{:+.3f}" if signed else "{:.3f}"
    if lo is None:
        return fmt.format(d["mean"])
    return f"{fmt.format(d['mean'])} [{fmt.format(lo)}, {fmt.format(hi)}]"


def rounds_markdown(rows: Sequence[dict[str, Any]], title: str) -> str:
    """``rounds.md``: the rounds table (each metric per round with its interval, its paired change from
    round 0), then what each round trained on and the calibrator it used."""
    metrics = shown_in("rounds")
    head = "| round | " + " | ".join(f"{m.title or m.name} | change from round 0" for m in metrics) + " |"
    lines = [
        f"# Rounds: {title}",
        "",
        "Means over the test articles (greedy summaries) with 95% bootstrap intervals over the articles; each "
        "change from round 0 is paired on the article. Round 0 is the starting policy.",
        "",
        head,
        "|" + "---|" * (1 + 2 * len(metrics)),
    ]
    for r in rows:
        cells = []
        for m in metrics:
            cells += [_ci(r.get(m.name)), _ci(r.get(f"{m.name}_change"), signed=True) if r["round"] else ""]
        lines.append(f"| {r['round']} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "| round | pairs | in the loss | mean calibrated p | optimizer steps | DPO loss | KL | calibrator "
        "(fit after round, pairs, held-out ECE) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        t, c = r.get("trained"), r.get("calibrator")
        if not t:
            continue

        def f(v: Any, digits: int = 3) -> str:
            return "n/a" if v is None else f"{v:.{digits}f}" if isinstance(v, float) else str(v)

        cal = "n/a" if not c else f"{c['fit_at']}, {c['n_fit']}, {f(c['heldout_ece'])}"
        lines.append(
            f"| {r['round']} | {t['pairs']} | {f(t['pairs_in_loss'])} | {f(t['p_mean'])} | "
            f"{f(t['optimizer_steps'], 0)} | {f(t['dpo_loss'])} | {f(t['kl'])} | {cal} |"
        )
    return "\n".join(lines) + "\n"
