"""The judge's coupling on labeled pairs: how its raw logit relates to the neutral label and to style.

Reported by ``judgeloop calibrate`` and logged by the feedback loop on its calibration pairs, so a
reader sees whether there is a bias to correct before reading what a calibrator did about it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from scipy.special import expit

from judgeloop.calibration.features import FEATURE_NAMES, both_orientations, feature_matrix
from judgeloop.calibration.metrics import auc
from judgeloop.metrics.text import novel_ngram_rate


def _corr(x: np.ndarray, z: np.ndarray) -> float | None:
    if x.size < 3 or np.std(x) == 0 or np.std(z) == 0:
        return None
    return float(np.corrcoef(x, z)[0, 1])


def judge_coupling(
    scores: Sequence[float],
    labels: Sequence[int],
    articles: Sequence[str],
    a: Sequence[str],
    b: Sequence[str],
) -> dict[str, Any]:
    """Coupling of a judge's raw logits with the label and with each style feature (both orientations).

    ``auc_label``: ROC AUC of the logit for the neutral label (0.5 = no signal); ``corr_label``:
    Pearson correlation of logit and label; per antisymmetric style feature (log length ratio,
    copy-rate difference, novel-bigram difference): ``corr_logit``, its correlation with the logit (the
    judge's coupling to that style), and ``corr_label``, with the label (what the style itself says
    about quality on these pairs).
    """
    n = len(scores)
    out: dict[str, Any] = {"n_pairs": n}
    if n < 3:
        return out
    s = np.asarray(scores, dtype=float)
    y = np.asarray(labels, dtype=float)
    both_s, both_y = np.concatenate([s, -s]), np.concatenate([y, 1 - y])
    out["auc_label"] = float(auc(expit(both_s), both_y))
    out["corr_label"] = _corr(both_s, both_y)
    feats = dict(zip(FEATURE_NAMES, feature_matrix(articles, a, b).T))
    feats["novel_bigram_diff"] = np.array(
        [novel_ngram_rate(x, art, 2) - novel_ngram_rate(z, art, 2) for art, x, z in zip(articles, a, b)]
    )
    out["features"] = {}
    for name, f in feats.items():
        both_f = both_orientations(f)
        out["features"][name] = {"corr_logit": _corr(both_s, both_f), "corr_label": _corr(both_f, both_y)}
    return out


def coupling_line(c: dict[str, Any]) -> str:
    """One line of :func:`judge_coupling` for a log or a report."""
    if "auc_label" not in c:
        return f"judge coupling: too few labeled pairs ({c['n_pairs']})"

    def fmt(v: float | None) -> str:
        return "n/a" if v is None else f"{v:+.2f}"

    feats = ", ".join(
        f"{k} {fmt(v['corr_logit'])} (with the label {fmt(v['corr_label'])})"
        for k, v in c["features"].items()
    )
    warn = ""
    if c["auc_label"] < 0.5:
        warn = f"WARNING: the judge prefers the worse summary (AUC {c['auc_label']:.2f} < 0.5): a calibrator fit on it has a reversed map. "
    return warn + (
        f"judge coupling on {c['n_pairs']} labeled pairs: AUC for the neutral label {c['auc_label']:.3f} "
        f"(corr {fmt(c['corr_label'])}); correlation of the logit with {feats}"
    )
