"""The account's table for an ablation under ``mode: rounds``: each arm's metrics per round, and each arm
against the baseline per round, paired on (seed, article).

The metrics are the metrics table's ``rounds`` column (:mod:`judgeloop.loop.metrics_table`: ROUGE-1
against the neutral references, ROUGE-1 against the extractive ones, the copy rate). Per arm and round:
the mean over (seed, article) cells with the two-level bootstrap of :func:`judgeloop.studies.stats.paired_bootstrap`
(seeds, then articles within a seed); per arm other than the baseline and round: the paired difference
arm - baseline with its interval and minimum detectable difference. :func:`rounds_results` builds them from
the job folders' per-article rows, :func:`rounds_lines` is their section of ``results.md``, beside the
account's published figures (:data:`ACCOUNT`).
"""

from __future__ import annotations

from typing import Any

from judgeloop.loop.metrics_table import shown_in
from judgeloop.studies.ablation import job_dir
from judgeloop.studies.ablation_config import AblateConfig
from judgeloop.studies.stats import paired_bootstrap, paired_matrix

#: the account's table (ROUGE-1 after its 5 rounds; "start" is before its first round): the raw arm's
#: extractive ROUGE-1 rose from 0.32 to 0.48 and its neutral ROUGE-1 from 0.35 to 0.37; the calibrated arm
#: ended at 0.38 extractive and 0.42 neutral.
ACCOUNT = {
    "rounds": 5,
    "raw": {"rouge_1_extractive": (0.32, 0.48), "rouge_1_neutral": (0.35, 0.37)},
    "calibrated": {"rouge_1_extractive": (None, 0.38), "rouge_1_neutral": (None, 0.42)},
}


def _rows_by_step(folder: Any) -> dict[int, dict[str, dict[str, Any]]]:
    import json

    path = folder / "per_article.jsonl"
    out: dict[int, dict[str, dict[str, Any]]] = {}
    if not path.is_file():
        return out
    for line in path.read_text().splitlines():
        if line.strip():
            r = json.loads(line)
            out.setdefault(int(r["step"]), {})[r["id"]] = r
    return out


def rounds_results(cfg: AblateConfig) -> dict[str, Any]:
    """Per round: each arm's mean of each ``rounds`` metric with its interval, and each arm minus the
    baseline, paired on (seed, article); from the finished jobs' ``per_article.jsonl``."""
    abl = cfg.ablation
    B, bseed, base = abl.bootstrap_samples, abl.bootstrap_seed, abl.baseline
    rows = {arm: {s: _rows_by_step(job_dir(cfg, arm, s)) for s in abl.seeds} for arm in abl.arms}
    steps = sorted({st for arm in rows.values() for per in arm.values() for st in per})
    metrics = [m.per_article for m in shown_in("rounds")]
    out: dict[str, Any] = {
        "rounds": steps,
        "baseline": base,
        "metrics": metrics,
        "arms": {},
        "vs_baseline": {},
    }

    def values(arm: str, step: int, m: str) -> dict[int, dict[str, Any]]:
        return {s: {i: r.get(m) for i, r in per.get(step, {}).items()} for s, per in rows[arm].items()}

    for arm in abl.arms:
        out["arms"][arm] = {
            str(st): {
                m: paired_bootstrap(
                    paired_matrix(values(arm, st, m), _zeros(values(arm, st, m))), B, bseed
                ).as_dict()
                for m in metrics
            }
            for st in steps
        }
        if arm != base:
            out["vs_baseline"][arm] = {
                str(st): {
                    m: paired_bootstrap(
                        paired_matrix(values(arm, st, m), values(base, st, m)), B, bseed
                    ).as_dict()
                    for m in metrics
                }
                for st in steps
            }
    return out


def _zeros(v: dict[int, dict[str, Any]]) -> dict[int, dict[str, float]]:
    """A zero beside every cell: the mean of the cells themselves through the paired bootstrap."""
    return {s: {i: 0.0 for i in arts} for s, arts in v.items()}


def _ci(d: dict[str, Any] | None, signed: bool = False) -> str:
    if not d or d.get("delta") is None:
        return "n/a"
    fmt = "{:+.3f}" if signed else "{:.3f}"
    lo, hi = d["ci95"]
    text = fmt.format(d["delta"])
    return text if lo is None else f"{text} [{fmt.format(lo)}, {fmt.format(hi)}]"


def rounds_lines(res: dict[str, Any]) -> list[str]:
    """The rounds section of ``results.md``: per round, each arm's ROUGE-1 (neutral, extractive) and copy
    rate, then each arm minus the baseline; the account's figures after them."""
    metrics = [m for m in shown_in("rounds")]
    lines = [
        "## The account's table: per round",
        "",
        "Round 0 is the starting policy. Means over (seed, article) with 95% two-level bootstrap intervals; "
        f"the differences from {res['baseline']} are paired on (seed, article) (mdd: the minimum detectable "
        "difference at 80% power).",
        "",
        "| round | arm | " + " | ".join(m.title or m.name for m in metrics) + " |",
        "|---|---|" + "---|" * len(metrics),
    ]
    for st in res["rounds"]:
        for arm, per in res["arms"].items():
            cells = [_ci(per[str(st)].get(m.per_article)) for m in metrics]
            lines.append(f"| {st} | {arm} | " + " | ".join(cells) + " |")
    for arm, per in res["vs_baseline"].items():
        lines += [
            "",
            f"**{arm} - {res['baseline']}**, paired:",
            "",
            "| round | " + " | ".join(f"{m.title or m.name} (mdd)" for m in metrics) + " |",
            "|---|" + "---|" * len(metrics),
        ]
        for st in res["rounds"]:
            cells = []
            for m in metrics:
                d = per[str(st)].get(m.per_article)
                mdd = "" if not d or d.get("mdd") is None else f" ({d['mdd']:.3f})"
                cells.append(_ci(d, signed=True) + mdd)
            lines.append(f"| {st} | " + " | ".join(cells) + " |")
    acc = ACCOUNT
    lines += [
        "",
        f"The account's figures (ROUGE-1, {acc['rounds']} rounds): raw extractive "
        f"{acc['raw']['rouge_1_extractive'][0]:.2f} -> {acc['raw']['rouge_1_extractive'][1]:.2f}, neutral "
        f"{acc['raw']['rouge_1_neutral'][0]:.2f} -> {acc['raw']['rouge_1_neutral'][1]:.2f}; calibrated extractive "
        f"{acc['calibrated']['rouge_1_extractive'][1]:.2f}, neutral {acc['calibrated']['rouge_1_neutral'][1]:.2f}.",
        "",
    ]
    return lines
