"""The ``oracle`` arm's judge: the neutral ROUGE labeler itself, as a preference logit.

s = scale * (ROUGE-L F1(a, neutral refs) - ROUGE-L F1(b, neutral refs)). Training against it is the
upper bound of the ablation: it tells how much of the gap between the biased judge and the task's
real target calibration closes.
"""

from __future__ import annotations

from collections.abc import Sequence

from judgeloop.judges import Judge, Pair
from judgeloop.metrics.text import rouge_max


class RougeOracleJudge(Judge):
    """A judge whose logit is the scaled ROUGE-L difference against each pair's neutral references."""

    def __init__(self, scale: float = 20.0, batch_size: int = 64):
        super().__init__(name=f"rouge_oracle@{scale}", position_debias=False, batch_size=batch_size)
        self.scale = scale

    def _score_ordered(self, pairs: Sequence[Pair]) -> tuple[list[float], list[str]]:
        vals: list[float] = []
        status: list[str] = []
        for p in pairs:
            if not p.references:
                vals.append(float("nan"))
                status.append("nonfinite")
                continue
            ra = rouge_max(p.a, p.references)["rougeL"]
            rb = rouge_max(p.b, p.references)["rougeL"]
            vals.append(self.scale * (ra - rb))
            status.append("ok")
        return vals, status
