"""The report of ``judgeloop agent``: each policy's quality and cost per test question with bootstrap
intervals, the paired differences against ``one_shot`` (interval and minimum detectable difference), and
its markdown."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from judgeloop.intervals import bootstrap_mean_interval
from judgeloop.studies.stats import paired_bootstrap
from judgeloop.text import fmt_number

METRICS = (
    "quality",
    "em",
    "f1",
    "evidence_recall",
    "judged_support",
    "refused",
    "rounds",
    "retrievals",
    "lm_calls",
    "tokens",
    "seconds",
    "repeats",
    "reward_true",
    "reward_judged",
)
PAIRED = ("quality", "em", "f1", "evidence_recall", "reward_true", "tokens", "seconds")


def _column(rows: Sequence[Mapping[str, float]], key: str) -> np.ndarray:
    return np.asarray([r[key] for r in rows], dtype=np.float64)


def summarize_policy(
    rows: Sequence[Mapping[str, float]],
    baseline: Sequence[Mapping[str, float]],
    num_bootstrap: int,
    seed: int,
) -> dict[str, Any]:
    """One policy's mean of each metric with its 95% percentile-bootstrap interval over questions (``ci95``),
    and its paired difference from ``baseline`` on the same questions (``vs_one_shot``)."""
    out: dict[str, Any] = {"n": len(rows)}
    for key in METRICS:
        x = _column(rows, key)
        if not np.isfinite(x).any():
            out[key] = {"mean": None, "ci95": [None, None], "n": 0}
            continue
        lo, hi = bootstrap_mean_interval(x, num_bootstrap, seed=seed)
        out[key] = {"mean": float(np.nanmean(x)), "ci95": [lo, hi], "n": int(np.isfinite(x).sum())}
    out["ci95"] = out["quality"]["ci95"]  # the headline interval: mean quality
    vs: dict[str, Any] = {}
    for key in PAIRED:
        d = _column(rows, key) - _column(baseline, key)
        if not np.isfinite(d).any():
            continue
        vs[key] = paired_bootstrap(d, num_bootstrap, seed).as_dict()
    out["vs_one_shot"] = vs
    return out


def action_counts(traces: Sequence[Mapping[str, Any]], policy: str) -> dict[str, int]:
    """How often ``policy`` took each action over the test questions."""
    c: Counter[str] = Counter()
    for row in traces:
        c.update(row["policies"][policy]["actions"])
    return dict(sorted(c.items()))


def _ci(x: Mapping[str, Any], digits: int = 3) -> str:
    if x.get("mean") is None:
        return "n/a"
    lo, hi = x["ci95"]
    return f"{fmt_number(x['mean'], digits)} [{fmt_number(lo, digits)}, {fmt_number(hi, digits)}]"


def _delta(d: Mapping[str, Any] | None, digits: int = 3) -> str:
    if not d or d.get("delta") is None:
        return "n/a"
    lo, hi = d["ci95"]
    mdd = f", mdd {fmt_number(d['mdd'], digits)}" if d.get("mdd") is not None else ""
    return f"{fmt_number(d['delta'], digits)} [{fmt_number(lo, digits)}, {fmt_number(hi, digits)}]{mdd}"


def render_markdown(report: Mapping[str, Any]) -> str:
    """The report as markdown (what the command writes to ``report.md``)."""
    d = report["data"]
    qa = d["format"] != "beir"
    quality = "F1" if qa else "evidence recall of the window"
    lines = [
        "# Retrieval agent: policies compared",
        "",
        f"- data: `{d['source']}` ({d['format']}): {d['num_questions']} questions ({d['n_cal']} calibration / "
        f"{d['n_test']} test), corpus of {d['corpus_size']} documents",
        f"- reader / LM `{report['model']}`; dense `{report['encoder']}`; BM25; window top-{report['answer_k']}; "
        f"budget: max_rounds {report['budget']['max_rounds']}, max_tokens {report['budget']['max_tokens']}, "
        f"max_seconds {report['budget']['max_seconds']}",
        f"- quality = {quality}; cost per action {report['costs']}; refusal worth {report['refuse_reward']} "
        "to the learned controllers",
        f"- judge: {report['judge']['name']}; test AUC for the label ({report['judge']['label']}): "
        f"{fmt_number(report['judge']['auc_test'])}; Brier on test leaves: calibrated "
        f"{fmt_number(report['judge']['brier_calibrated_test'])}, raw sigmoid {fmt_number(report['judge']['brier_raw_test'])}",
        f"- gate: {_gate_line(report['gate'])}; conformal set at alpha {report['conformal']['alpha']}; answer "
        f"confidence threshold {fmt_number(report['confidence']['threshold'], 4, none='inf')} for target risk "
        f"{report['confidence']['target_risk']} (cal coverage {fmt_number(report['confidence']['cal_coverage'])})",
        "",
        "## Test split (mean per question, 95% bootstrap CI over questions)",
        "",
        "| policy | quality | EM | F1 | evidence recall | judged support | refused | rounds | retrievals | LM calls | tokens | seconds |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, p in report["policies"].items():
        lines.append(
            f"| {name} | {_ci(p['quality'])} | {_ci(p['em'])} | {_ci(p['f1'])} | {_ci(p['evidence_recall'])} | "
            f"{_ci(p['judged_support'])} | {_ci(p['refused'], 2)} | {fmt_number(p['rounds']['mean'], 2)} | "
            f"{fmt_number(p['retrievals']['mean'], 2)} | {fmt_number(p['lm_calls']['mean'], 2)} | "
            f"{fmt_number(p['tokens']['mean'], 0)} | {fmt_number(p['seconds']['mean'], 2)} |"
        )
    lines += [
        "",
        "## Paired against one_shot (same test questions; 95% CI, mdd = minimum detectable difference)",
        "",
        "| policy | quality | evidence recall | reward (quality - cost) | tokens |",
        "|---|---|---|---|---|",
    ]
    for name, p in report["policies"].items():
        if name == "one_shot":
            continue
        v = p["vs_one_shot"]
        lines.append(
            f"| {name} | {_delta(v.get('quality'))} | {_delta(v.get('evidence_recall'))} | "
            f"{_delta(v.get('reward_true'))} | {_delta(v.get('tokens'), 0)} |"
        )
    lines += ["", "## Actions taken on the test split", "", "| policy | actions |", "|---|---|"]
    for name, counts in report["actions_taken"].items():
        lines.append(f"| {name} | {', '.join(f'{a} {n}' for a, n in counts.items())} |")
    lines += ["", report["note"], ""]
    return "\n".join(lines)


def _gate_line(g: Mapping[str, Any]) -> str:
    if not g.get("fitted"):
        return f"not fitted ({g.get('why')}); gate_once never escalates"
    t = g["threshold"]
    return f"weak when {g['signal']} {g['fires_when']} {fmt_number(t, 4) if math.isfinite(t) else t}"
