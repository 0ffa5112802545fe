"""``report.md`` of ``judgeloop probe-judge``: the answer first (attacks x judges, final success rates),
one line per judge on what fooled it and what debiasing and calibration did, then each judge's stages
and the detectors' rates. Everything here reads the report dict of :func:`judgeloop.studies.judge_probe.probe`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from judgeloop.calibration.health import health_lines
from judgeloop.studies.judge_probe import STAGES, ci_key
from judgeloop.text import fmt_number


def _cell(entry: dict[str, Any], key: str, bold: bool = False) -> str:
    lo, hi = entry[key]
    text = f"{fmt_number(entry['success_rate'], 2)} [{fmt_number(lo, 2)}, {fmt_number(hi, 2)}]"
    return f"**{text}**" if bold else text


def fooling_attacks(judge: dict[str, Any], key: str, stage: str = "calibrated") -> list[str]:
    """The attacks whose lift over the control at ``stage`` has an interval above 0: those that fool the
    judge there."""
    out = []
    for kind, e in judge["attacks"].items():
        lo = e["stages"][stage].get("lift_vs_control", {}).get(key, [None])[0]
        if lo is not None and np.isfinite(lo) and lo > 0:
            out.append(kind)
    return out


def stage_means(judge: dict[str, Any]) -> dict[str, float]:
    """The mean success rate over the attacks (the control excluded) at each stage."""
    attacks = [e for k, e in judge["attacks"].items() if k != "control"]
    return {
        s: float(np.mean([e["stages"][s]["success_rate"] for e in attacks])) if attacks else float("nan")
        for s in STAGES
    }


def _names(kinds: Sequence[str]) -> str:
    return ", ".join(f"`{k}`" for k in kinds) if kinds else "no attack"


def health_warnings(report: dict[str, Any]) -> list[str]:
    """The report's opening warnings: each judge that is reversed or position-only on the calibration pairs
    (:mod:`judgeloop.calibration.health`), before any "fooled by"."""
    return [
        line
        for name, judge in report["judges"].items()
        for line in health_lines(
            name, judge.get("health"), f"`{report['calibration']['split']}` calibration pairs"
        )
    ]


def _health_tag(judge: dict[str, Any]) -> str:
    h = judge.get("health") or {}
    tags = [t for t, on in (("position-only", h.get("position_only")), ("reversed", h.get("reversed"))) if on]
    return f" **{' and '.join(tags)} judge (see above)**;" if tags else ""


def verdict_line(name: str, judge: dict[str, Any], key: str) -> str:
    """One judge's answer in words: which attacks fool it, and what debiasing and calibration did."""
    m = stage_means(judge)
    judged = sum(e["n"] - e["n_failed"] for e in judge["attacks"].values())
    flips, fit_auc = judge["calibration_flips"], judge["fit_auc"]
    if not flips:
        calib = "calibration turned no verdict around (it moved the confidence only)"
    else:
        calib = (
            f"calibration turned {flips} of {judged} verdicts around: the debiased logit ranks the calibration "
            f"pairs' human labels at AUC {fmt_number(fit_auc, 2)}"
            + (", below chance, so the calibrator inverts the judge" if fit_auc < 0.5 else "")
        )
    return (
        f"- `{name}` ({judge['type']}, `{judge['model']}`):{_health_tag(judge)} fooled by {_names(fooling_attacks(judge, key))} "
        f"(before calibration, debiased: {_names(fooling_attacks(judge, key, 'debiased'))}). Mean success over "
        f"the attacks: shown first {fmt_number(m['forward'], 2)}, shown second {fmt_number(m['reverse'], 2)}, "
        f"both orders combined {fmt_number(m['debiased'], 2)}, calibrated {fmt_number(m['calibrated'], 2)}; "
        f"{calib}."
    )


def _stage_table(judge: dict[str, Any], key: str) -> list[str]:
    lines = [
        "| attack | shown first | shown second | debiased | calibrated | mean p | failed | lift vs control (calibrated) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for kind, e in judge["attacks"].items():
        st = e["stages"]
        lift = e.get("lift_vs_control")
        lift_text = (
            f"{fmt_number(lift['value'], 2)} [{fmt_number(lift[key][0], 2)}, {fmt_number(lift[key][1], 2)}]"
            if lift
            else ""
        )
        lines.append(
            f"| {kind} | "
            + " | ".join(_cell(st[s], key) for s in STAGES)
            + f" | {fmt_number(e['mean_calibrated_p'], 2)} | {e['n_failed']}/{e['n']} | {lift_text} |"
        )
    return lines


def _detector_table(det: dict[str, Any]) -> list[str]:
    cols = ["verdict", "repetition", "lead_copy", "keyword_stuffing", "empty", "any"]
    lines = ["| summaries | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    rows = [
        *det["attacks"].items(),
        ("honest", det["honest"]),
        (f"references ({det['n_references']})", det["references"]),
    ]
    for label, rates in rows:
        lines.append(
            f"| {label} | " + " | ".join(fmt_number(rates[f"hack_{c}_rate"], 2) for c in cols) + " |"
        )
    return lines


def render_markdown(report: dict[str, Any]) -> str:
    """``report.md``: the answer table first (attacks x judges), the verdict per judge, then the stages of
    each judge and the detectors."""
    key = ci_key(report["confidence"])
    pct = round(100 * report["confidence"])
    names = list(report["judges"])
    a = report["articles"]
    warnings = health_warnings(report)
    lines = [
        "# Judge probe: which attacks fool which judge, and do debiasing and calibration help?",
        "",
        *[w for line in warnings for w in (line, "")],
        f"Each cell: the share of {a['test']} test articles where the judge prefers the adversarial summary to "
        f"the honest one (the best-rated by mean {', '.join(report['honest_rating'])}), after position "
        f"debiasing and `{report['calibration']['method']}` calibration (p > 0.5), [{pct}% Wilson interval]. "
        f"`control` is the weak base (the worst-rated summary) with no attack. **Bold**: the attack's lift "
        f"over the control is above 0 ({pct}% paired bootstrap over articles).",
        "",
        "| attack | " + " | ".join(f"`{n}`" for n in names) + " |",
        "|---" * (len(names) + 1) + "|",
    ]
    for kind in report["attacks"]:
        cells = [
            _cell(
                report["judges"][n]["attacks"][kind], key, kind in fooling_attacks(report["judges"][n], key)
            )
            for n in names
        ]
        lines.append(f"| {kind} | " + " | ".join(cells) + " |")
    lines += ["", *[verdict_line(n, report["judges"][n], key) for n in names], ""]
    cal = report["calibration"]
    lines += [
        f"Calibrators: `{cal['method']}` on {cal['n_pairs']} labeled candidate pairs of {a['calibration']} "
        f"`{cal['split']}` articles (labels `{cal['labels']['type']}`"
        + (f", `{cal['labels']['dimension']}`" if cal["labels"]["type"] == "human" else "")
        + f"), disjoint from the test articles. Run time {report['runtime_s']} s.",
        "",
    ]
    for n in names:
        j = report["judges"][n]
        lines += [
            f"## `{n}`: success by stage",
            "",
            f"Position bias (mean s(a,b) + s(b,a); 0: order-free) on the calibration pairs "
            f"{fmt_number(j['position_bias'], 3)}; calibrator fit on {j['n_fit']} pairs, where the debiased "
            f"logit's AUC for the human label is {fmt_number(j['fit_auc'], 3)}"
            + (" (the judge was fit on them too: it learns from labels)" if j["fit_labels"] else "")
            + f"; {j['runtime_s']} s.",
            "",
            *_stage_table(j, key),
            "",
        ]
    lines += [
        "## Detectors",
        "",
        "Share of summaries each detector flags (`judgeloop.judges.hacking.hack_rates`); the references row "
        "is the false-positive rate on the test articles' human references.",
        "",
        *_detector_table(report["detectors"]),
        "",
        "Every number can be recomputed from `pairs.jsonl` (one row per judge, attack and article).",
        "",
    ]
    return "\n".join(lines)
