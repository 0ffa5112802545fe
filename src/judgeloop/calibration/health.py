"""Two ways a judge fails that no attack table shows: reversed and position-only.

A *reversed* judge ranks labeled pairs below chance: its position-debiased logit
``(s(a,b) - s(b,a)) / 2`` has AUC < 0.5 for the label, so it prefers the worse summary, and a
calibrator fit on it (Platt with a negative slope) turns its verdicts around. A *position-only* judge
prefers whichever summary is shown first (or second) whatever they say: in at least
``POSITION_ONLY_SHARE`` of the pairs scored in both orders, ``s(a,b)`` and ``s(b,a)`` have the same sign.
A report that says such a judge is "fooled by no attack" or "robust" flatters it; the reports that use
a judge (probe, calibrate, ablation) name either failure in their first lines (:func:`health_lines`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from scipy.special import expit

from judgeloop.calibration.metrics import auc

# The share of pairs with one preferred position in both orders from which a judge is called position-only.
POSITION_ONLY_SHARE = 0.9


def judge_health(
    forward: np.ndarray, reverse: np.ndarray, labels: np.ndarray | None = None
) -> dict[str, Any]:
    """Reversed / position-only diagnosis from a judge's raw logits in both orders.

    Args:
        forward: ``s(a, b)`` per pair (NaN: failed).
        reverse: ``s(b, a)`` per pair (NaN: failed).
        labels: 1 where ``a`` is the better summary, 0 where ``b`` is (None: no labels, no AUC).

    Returns:
        ``n_pairs`` (both orders valid), ``auc_debiased`` (None without both label classes),
        ``first_share`` / ``second_share`` (pairs where the judge prefers that position in both orders),
        ``reversed``, ``position_only`` and ``position_side`` ("first", "second" or None).
    """
    f, r = np.asarray(forward, float), np.asarray(reverse, float)
    ok = np.isfinite(f) & np.isfinite(r)
    n = int(ok.sum())
    auc_deb = None
    if labels is not None and n:
        y = np.asarray(labels, float)[ok]
        if 0 < y.sum() < y.size:
            auc_deb = float(auc(expit((f[ok] - r[ok]) / 2), y))
    first = float(np.mean((f[ok] > 0) & (r[ok] > 0))) if n else 0.0
    second = float(np.mean((f[ok] < 0) & (r[ok] < 0))) if n else 0.0
    side = None
    if max(first, second) >= POSITION_ONLY_SHARE:
        side = "first" if first >= second else "second"
    return {
        "n_pairs": n,
        "auc_debiased": auc_deb,
        "first_share": first,
        "second_share": second,
        "reversed": auc_deb is not None and auc_deb < 0.5,
        "position_only": side is not None,
        "position_side": side,
    }


def health_lines(name: str, health: dict[str, Any] | None, pairs: str = "calibration pairs") -> list[str]:
    """The warnings a report opens with for one judge (none for a healthy one)."""
    if not health:
        return []
    lines = []
    if health["position_only"]:
        side = health["position_side"]
        share = health[f"{side}_share"]
        lines.append(
            f"**`{name}` is a position-only judge**: it prefers the summary shown {side} in "
            f"{share:.0%} of {health['n_pairs']} {pairs} scored in both orders, whatever they say. Its "
            'verdicts measure the order, not the summaries: read no "fooled by" or "robust" below as a '
            "statement about their content."
        )
    if health["reversed"]:
        lines.append(
            f"**`{name}` is a reversed judge**: its position-debiased logit ranks the labels of "
            f"{health['n_pairs']} {pairs} below chance (AUC {health['auc_debiased']:.2f} < 0.5): it prefers "
            'the worse summary, a calibrator fit on it turns its verdicts around, and what it is "fooled by" '
            "is judged against a preference that is upside down."
        )
    return lines
