"""Reliability diagrams: observed frequency of "a better" against predicted probability, per method."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np

from judgeloop.calibration.metrics import ece, reliability_bins
from judgeloop.io import atomic_path


def reliability_diagram(
    probs: Mapping[str, np.ndarray], labels: np.ndarray, path: str | Path, n_bins: int = 15, title: str = ""
) -> None:
    """Write a PNG with one reliability curve per method (and a histogram of the raw confidences)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, hist) = plt.subplots(
        2, 1, figsize=(5.5, 6.5), gridspec_kw={"height_ratios": [3, 1]}, sharex=True
    )
    ax.plot([0, 1], [0, 1], linestyle="--", color="grey", linewidth=1, label="perfect")
    for name, p in probs.items():
        bins = reliability_bins(p, labels, n_bins, "uniform")
        ok = bins["count"] > 0
        ax.plot(
            bins["confidence"][ok],
            bins["frequency"][ok],
            marker="o",
            markersize=3,
            label=f"{name} (ECE {ece(p, labels, n_bins):.3f})",
        )
        hist.hist(p, bins=np.linspace(0, 1, n_bins + 1), histtype="step", label=name)
    ax.set_ylabel("observed P(a better)")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.legend(loc="upper left", fontsize=8)
    ax.set_title(title or "reliability (both orientations)")
    hist.set_xlabel("predicted P(a better)")
    hist.set_ylabel("pairs")
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)
