"""Objective signals as judges: pairwise preferences that need no judge model's opinion.

Each signal values a summary on its own, so ``s(a, b) = scale * (v(a) - v(b))`` like any pointwise
judge, and it mixes with other judges in a panel (:mod:`judgeloop.judges.panel`) or trains the policy
alone. The signals:

* ``rouge``: ROUGE-L F1 against the example's references (the best-matching one);
* ``length``: minus the log of the summary's length in words (a length penalty: shorter is better);
* ``copy_rate``: minus the share of the summary's word 3-grams copied from the article (a copy penalty);
* ``factual``: log P(entailment) of the summary given the article under a natural-language-inference
  model the user names (``judge.model``, a sequence classifier with an entailment label), the
  factual-consistency signal of SummaC-style checks. The article is cut to fit ``max_length``.

The text signals are deterministic functions of the texts: cheap, reproducible, and, unlike a judge
model, they cannot be talked into a verdict.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from judgeloop.judges.base import PointwiseJudge
from judgeloop.judges.tokens import ModelBacked
from judgeloop.metrics.text import copy_rate, rouge_max, tokens

OBJECTIVE_SIGNALS = ("rouge", "length", "copy_rate", "factual")


def signal_value(signal: str, article: str, summary: str, references: Sequence[str] = ()) -> float:
    """The text signal ``signal`` of one summary (higher is better); ``nan`` for ``rouge`` without
    references. ``factual`` needs a model: see :class:`ObjectiveJudge`."""
    if signal == "rouge":
        return rouge_max(summary, list(references))["rougeL"] if references else float("nan")
    if signal == "length":
        return -math.log(max(len(tokens(summary)), 1))
    if signal == "copy_rate":
        return -copy_rate(summary, article)
    raise ValueError(
        f"objective signal {signal!r} is not a text signal; use one of {list(OBJECTIVE_SIGNALS[:3])}"
    )


class ObjectiveJudge(PointwiseJudge, ModelBacked):
    """An objective signal (see the module docstring) as a judge: ``s = scale * (v(a) - v(b))``.

    Args:
        signal: ``rouge``, ``length``, ``copy_rate`` or ``factual``.
        scale: multiplies the value difference (ROUGE and copy rates live in [0, 1]: 20 makes a
            difference of 0.1 a logit of 2, as the embedding judge's scale does for cosines).
        model: ``factual`` only: the NLI model (hub id, local path).
        entailment_label: ``factual`` only: the name (or index) of the entailment class.
        max_length: ``factual`` only: token budget of (article, summary); the article is cut to fit.
    """

    def __init__(
        self,
        signal: str,
        scale: float = 20.0,
        model: str | None = None,
        entailment_label: str = "entailment",
        max_length: int = 512,
        batch_size: int = 8,
        device: str = "cpu",
        dtype: str = "float32",
        cache_size: int = 100_000,
        position_debias: bool = False,
    ):
        if signal not in OBJECTIVE_SIGNALS:
            raise ValueError(
                f"judge.signal={signal!r} is not an objective signal; use one of {list(OBJECTIVE_SIGNALS)}"
            )
        super().__init__(
            f"objective:{signal}" + (f":{model}" if signal == "factual" else ""),
            position_debias=position_debias,
            batch_size=batch_size,
            cache_size=cache_size,
        )
        self.signal, self.scale, self.max_length = signal, float(scale), max_length
        # ROUGE reads the neutral references; the other signals read none
        self.reference_style = "neutral" if signal == "rouge" else "none"
        self.device = device  # type: ignore[assignment]  # a text signal runs nowhere; factual: resolved
        if signal == "factual":
            self._load_nli(model, entailment_label, device, dtype)

    def _load_nli(self, model: str | None, entailment_label: str, device: str, dtype: str) -> None:
        from judgeloop.judges.tokens import attach_judge_model
        from judgeloop.models import load_sequence_classifier

        if not model:
            raise ValueError("judge.signal=factual needs judge.model: an NLI sequence classifier")

        def load(name: str, dtype: str) -> Any:
            return load_sequence_classifier(name, num_labels=None, dtype=dtype)  # the checkpoint's classes

        attach_judge_model(self, model, None, load, dtype, device, self.max_length)
        labels = {str(v).lower(): int(k) for k, v in (self.model.config.id2label or {}).items()}
        if entailment_label.lower() in labels:
            self.entail_index = labels[entailment_label.lower()]
        elif entailment_label.isdigit() and int(entailment_label) < self.model.config.num_labels:
            self.entail_index = int(entailment_label)
        else:
            raise ValueError(
                f"judge.entailment_label={entailment_label!r} is not a class of {model!r} "
                f"(its labels: {sorted(labels)}); name one of them, or give its index"
            )

    def _value_points(
        self, points: Sequence[tuple[str, str, tuple[str, ...]]]
    ) -> tuple[list[float], list[str]]:
        if self.signal == "factual":
            return self._entailment(points)
        values = [self.scale * signal_value(self.signal, art, summ, refs) for art, summ, refs in points]
        status = ["ok" if math.isfinite(v) else "nonfinite" for v in values]
        return values, status

    def _entailment(
        self, points: Sequence[tuple[str, str, tuple[str, ...]]]
    ) -> tuple[list[float], list[str]]:
        """``scale`` x log P(entailment | article, summary), the article truncated to fit."""
        enc: Any = self.tokenizer(
            [art for art, _, _ in points],
            [summ for _, summ, _ in points],
            truncation="only_first",
            max_length=self.max_length,
            padding=True,
            return_tensors="pt",
        )
        full = self.tokenizer([art for art, _, _ in points], [summ for _, summ, _ in points])["input_ids"]
        with torch.inference_mode():
            logits = self.model(**{k: v.to(self.device) for k, v in enc.items()}).logits.float()
        logp = torch.log_softmax(logits, dim=-1)[:, self.entail_index].cpu().tolist()
        status = ["truncated" if len(ids) > self.max_length else "ok" for ids in full]
        return [self.scale * v for v in logp], status
