"""Evaluation of the policy on held-out articles (greedy decoding).

Metrics (means over articles): neutral ROUGE-1/2/L (the task's real target), ROUGE-L against the
extractive references (how far the policy moved toward the judge's style), copy rate (3-grams
copied from the article) and novel bigram rate, mean length in words, KL(pi || pi_ref) (k1 on one
sampled summary per article), the share of summaries each reward-hacking detector flags
(:mod:`judgeloop.judges.hacking`: injected verdicts, repetition, a copied lead, keyword stuffing, empty),
the judge's win rate of the policy's summary against the reference
policy's, and the calibrator's ECE on (greedy, sampled) pairs labeled by neutral ROUGE-L.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

from judgeloop.calibration import Calibrator
from judgeloop.data import SummExample
from judgeloop.judges import Judge, references_for
from judgeloop.judges.hacking import HACK_KINDS, detect_hacks
from judgeloop.loop.config import GenerationConfig
from judgeloop.loop.losses import kl_per_sequence
from judgeloop.loop.policy import reference_logprobs
from judgeloop.loop.recalibration import CalibrationPairs, label_pairs, pair_ece
from judgeloop.loop.rollout import PromptBuilder, decode, generate, token_logprobs
from judgeloop.metrics.text import copy_rate, novel_ngram_rate, rouge_max, tokens


@contextlib.contextmanager
def eval_mode(model: Any) -> Iterator[Any]:
    """``model`` in eval mode for the block, then back to the mode it was in."""
    was_training = model.training
    model.eval()
    try:
        yield model
    finally:
        if was_training:
            model.train()


def greedy_summaries(
    model: Any,
    tokenizer: Any,
    build_prompt: PromptBuilder,
    examples: Sequence[SummExample],
    gen: GenerationConfig,
    batch_size: int,
) -> list[str]:
    """Greedy summaries of ``examples`` by the current policy, in batches (eval mode)."""
    out: list[str] = []
    for i in range(0, len(examples), batch_size):
        prompts = [build_prompt(e.article) for e in examples[i : i + batch_size]]
        out += decode(tokenizer, generate(model, tokenizer, prompts, gen, greedy=True))
    return out


def text_metrics(ex: SummExample, summary: str) -> dict[str, float]:
    """Per-article text metrics of one summary."""
    neutral = (
        rouge_max(summary, ex.neutral)
        if ex.neutral
        else {"rouge1": np.nan, "rouge2": np.nan, "rougeL": np.nan}
    )
    extractive = rouge_max(summary, ex.extractive)["rougeL"] if ex.extractive else np.nan
    return {
        "rouge_1_neutral": neutral["rouge1"],
        "rouge_2_neutral": neutral["rouge2"],
        "rouge_l_neutral": neutral["rougeL"],
        "rouge_l_extractive": extractive,
        "copy_rate": copy_rate(summary, ex.article),
        "novel_bigram_rate": novel_ngram_rate(summary, ex.article, 2),
        "length": float(len(tokens(summary))),
        **hack_flags(ex.article, summary),
    }


def hack_flags(article: str, summary: str) -> dict[str, float]:
    """The reward-hacking detectors on one summary: ``hack_KIND`` 1.0 when KIND fires, and ``hack_any``."""
    flags = detect_hacks(article, summary)
    return {**{f"hack_{k}": float(v) for k, v in flags.as_dict().items()}, "hack_any": float(flags.any)}


@torch.no_grad()
def sampled_kl(
    model: Any,
    ref: Any | None,
    tokenizer: Any,
    build_prompt: PromptBuilder,
    examples: Sequence[SummExample],
    gen: GenerationConfig,
    batch_size: int,
    seed: int,
) -> tuple[list[float], list[str]]:
    """k1 estimate of KL(pi || pi_ref) per article from one sample of pi each; also returns the samples."""
    kls: list[float] = []
    texts: list[str] = []
    for i in range(0, len(examples), batch_size):
        prompts = [build_prompt(e.article) for e in examples[i : i + batch_size]]
        comps = generate(model, tokenizer, prompts, gen, num_samples=1, seed=seed + i)
        pol, mask = token_logprobs(model, prompts, comps, tokenizer.pad_token_id)
        refl, _ = reference_logprobs(model, ref, prompts, comps, tokenizer.pad_token_id)
        kls += kl_per_sequence(pol, refl, mask, "k1").tolist()
        texts += decode(tokenizer, comps)
    return kls, texts


def evaluate_shard(
    model: Any,
    ref: Any | None,
    tokenizer: Any,
    build_prompt: PromptBuilder,
    examples: Sequence[SummExample],
    ref_summaries: Sequence[str],
    judge: Judge,
    gen: GenerationConfig,
    batch_size: int,
    seed: int,
    greedy: Sequence[str] | None = None,
    sampled: tuple[Sequence[float], Sequence[str]] | None = None,
) -> list[dict[str, Any]]:
    """Per-article evaluation rows for this process's shard of ``examples`` (gathered by the caller).

    ``greedy`` (the greedy summaries) and ``sampled`` (k1 KL and the sample, per article) may be given
    when already computed (the starting policy's, shared across the runs of an ablation).
    """
    if not examples:
        return []
    with eval_mode(model):
        if greedy is None:
            greedy = greedy_summaries(model, tokenizer, build_prompt, examples, gen, batch_size)
        if sampled is None:
            sampled = sampled_kl(model, ref, tokenizer, build_prompt, examples, gen, batch_size, seed)
    kls, samples = sampled
    wins = judge(
        [e.article for e in examples], list(greedy), list(ref_summaries), references_for(judge, examples)
    )
    rows = []
    for ex, g, s, k, w, ok in zip(examples, greedy, samples, kls, wins.scores, wins.valid):
        k = float("nan") if k is None else float(k)
        row: dict[str, Any] = {"id": ex.id, "summary": g, "sample": s, "kl": k, **text_metrics(ex, g)}
        # win = 1, tie = 0.5, loss = 0; a failed judgement (e.g. an empty summary) is None, never a loss
        row["win"] = (1.0 if w > 0 else 0.5 if w == 0 else 0.0) if ok else None
        rows.append(row)
    return rows


def aggregate(
    rows: Sequence[dict[str, Any]], pairs: CalibrationPairs, calibrator: Calibrator, n_bins: int
) -> dict[str, float]:
    """Mean metrics over all gathered rows, plus the calibrator's ECE on the labeled (greedy, sample)
    ``pairs`` (judged by each process on its own share: :func:`shard_pairs`)."""
    out: dict[str, float] = {}
    keys = [
        "rouge_1_neutral",
        "rouge_2_neutral",
        "rouge_l_neutral",
        "rouge_l_extractive",
        "copy_rate",
        "novel_bigram_rate",
        "length",
        "kl",
    ]
    for k in keys:
        vals = np.array([r[k] for r in rows], dtype=float)
        out[k] = float(np.nanmean(vals)) if np.isfinite(vals).any() else float("nan")
    for kind in (
        *HACK_KINDS,
        "any",
    ):  # the share of the policy's summaries each reward-hacking detector flags
        flags = [r[f"hack_{kind}"] for r in rows]
        out[f"hack_{kind}_rate"] = float(np.mean(flags)) if flags else float("nan")
    wins = [r["win"] for r in rows if r["win"] is not None]
    out["win_rate"] = float(np.mean(wins)) if wins else float("nan")
    out["judge_failures"] = float(sum(r["win"] is None for r in rows))
    out["ece"] = pair_ece(calibrator, pairs, n_bins)
    out["ece_pairs"] = float(len(pairs))
    return out


def validation_metrics(examples: Sequence[SummExample], greedy: Sequence[str]) -> list[dict[str, float]]:
    """Per-article text metrics of the policy's greedy summaries of the validation slice: neutral ROUGE-L
    (the early-stopping criterion) and the style metrics, so settings can be chosen without the test split."""
    return [text_metrics(e, g) for e, g in zip(examples, greedy)]


def shard_pairs(
    rows: Sequence[dict[str, Any]], examples_by_id: dict[str, SummExample], train_judge: Judge
) -> CalibrationPairs:
    """This process's (greedy, sample) pairs of its evaluation rows, judged by the training judge and
    ROUGE-labeled: every process judges its own share once (not every gathered row on every rank)."""
    exs = [examples_by_id[r["id"]] for r in rows]
    return label_pairs(exs, [r["summary"] for r in rows], [r["sample"] for r in rows], train_judge)


def merge_pairs(parts: Sequence[dict[str, Any]]) -> CalibrationPairs:
    """One :class:`CalibrationPairs` from the processes' ``as_dict()`` parts, in process order."""
    out = CalibrationPairs()
    for part in parts:
        for name, value in part.items():
            if isinstance(value, list):
                getattr(out, name).extend(value)
            else:
                setattr(out, name, getattr(out, name) + value)
    return out
