"""Evaluation of the policy on held-out articles (greedy decoding).

Metrics (means over articles): neutral ROUGE-1/2/L (the task's real target), ROUGE-L and ROUGE-1 against the
extractive references (how far the policy moved toward the judge's style), copy rate (3-grams
copied from the article) and novel bigram rate, mean length in words, KL(pi || pi_ref) (k1 on one
sampled summary per article), the share of summaries each reward-hacking detector flags
(:mod:`judgeloop.judges.hacking`: injected verdicts, repetition, a copied lead, keyword stuffing, empty),
the judge's win rate of the policy's summary against the reference
policy's, and the calibrator's ECE on (greedy, sampled) pairs labeled by neutral ROUGE-L.

The loop's glue is here too, taking the run's parts: :func:`run_evaluation` (one evaluation of a run,
sharded over processes), :func:`reference_summaries` (the reference policy's, once) and
:func:`early_stopping` (the best validation policy, and patience); the run schedules them
(:func:`judgeloop.loop.setup.evaluate_when_due`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from accelerate import Accelerator
from accelerate.utils import gather_object

from judgeloop.calibration import Calibrator
from judgeloop.data import SummExample
from judgeloop.distributed import real_part, shard
from judgeloop.hashing import derive_seed
from judgeloop.io import finite_or_none
from judgeloop.judges import Judge, references_for
from judgeloop.judges.hacking import detect_hacks
from judgeloop.logging import get_logger
from judgeloop.loop.config import FeedbackLoopConfig, GenerationConfig
from judgeloop.loop.metrics_table import Metric, evaluated, shown_in
from judgeloop.loop.pairs import CalibrationPairs, gather_pairs, judge_and_label_pairs, pair_ece
from judgeloop.loop.policy import Policy
from judgeloop.loop.run_state_files import save_policy
from judgeloop.loop.state import LoopState, Splits
from judgeloop.metrics.text import copy_rate, novel_ngram_rate, rouge_max, tokens

if TYPE_CHECKING:
    from judgeloop.loop.start_cache import StartWork

logger = get_logger(__name__)


def text_metrics(ex: SummExample, summary: str) -> dict[str, float]:
    """Per-article text metrics of one summary."""
    neutral = (
        rouge_max(summary, ex.neutral)
        if ex.neutral
        else {"rouge1": np.nan, "rouge2": np.nan, "rougeL": np.nan}
    )
    extractive = rouge_max(summary, ex.extractive) if ex.extractive else {"rouge1": np.nan, "rougeL": np.nan}
    return {
        "rouge_1_neutral": neutral["rouge1"],
        "rouge_2_neutral": neutral["rouge2"],
        "rouge_l_neutral": neutral["rougeL"],
        "rouge_l_extractive": extractive["rougeL"],
        "rouge_1_extractive": extractive["rouge1"],
        "copy_rate": copy_rate(summary, ex.article),
        "novel_bigram_rate": novel_ngram_rate(summary, ex.article, 2),
        "length": float(len(tokens(summary))),
        **hack_flags(ex.article, summary),
    }


def hack_flags(article: str, summary: str) -> dict[str, float]:
    """The reward-hacking detectors on one summary: ``hack_KIND`` 1.0 when KIND fires, and ``hack_any``."""
    flags = detect_hacks(article, summary)
    return {**{f"hack_{k}": float(v) for k, v in flags.as_dict().items()}, "hack_any": float(flags.any)}


def greedy_text_metrics(
    policy: Policy,
    examples: Sequence[SummExample],
    gen: GenerationConfig,
    batch_size: int,
    greedy: Sequence[str] | None = None,
) -> tuple[list[str], list[dict[str, float]]]:
    """The policy's greedy summaries of ``examples`` (:meth:`Policy.greedy`; ``greedy``: already made, e.g.
    the starting policy's from the start cache) and each one's :func:`text_metrics`: what the evaluation,
    the validation slice and the curve all measure."""
    if greedy is None:
        greedy = policy.greedy(examples, gen, batch_size)
    return list(greedy), [text_metrics(e, g) for e, g in zip(examples, greedy)]


def evaluate_shard(
    policy: Policy,
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
    when already computed (the starting policy's, shared across the runs of an ablation); the others are
    generated where the policy's backend says.
    """
    if not examples:
        return []
    greedy, texts = greedy_text_metrics(policy, examples, gen, batch_size, greedy)
    if sampled is None:
        sampled = policy.sampled_kl(examples, gen, batch_size, seed)
    kls, samples = sampled
    wins = judge(
        [e.article for e in examples], list(greedy), list(ref_summaries), references_for(judge, examples)
    )
    rows = []
    for ex, g, t, s, k, w, ok in zip(examples, greedy, texts, samples, kls, wins.scores, wins.valid):
        k = float("nan") if k is None else float(k)
        row: dict[str, Any] = {"id": ex.id, "summary": g, "sample": s, "kl": k, **t}
        # win = 1, tie = 0.5, loss = 0; a failed judgement (e.g. an empty summary) is None, never a loss
        row["win"] = (1.0 if w > 0 else 0.5 if w == 0 else 0.0) if ok else None
        rows.append(row)
    return rows


def aggregate_metric(
    metric: Metric,
    rows: Sequence[dict[str, Any]],
    pairs: CalibrationPairs | None = None,
    calibrator: Calibrator | None = None,
    n_bins: int = 0,
) -> float:
    """``metric`` over the per-article ``rows`` as its row of the metrics table says
    (:data:`judgeloop.loop.metrics_table.AGGREGATES`); ECE and its pair count from ``pairs``."""
    if metric.aggregate == "pairs":
        assert pairs is not None and calibrator is not None
        return pair_ece(calibrator, pairs, n_bins)
    if metric.aggregate == "pair_count":
        assert pairs is not None
        return float(len(pairs))
    values = [r[metric.per_article] for r in rows]
    if metric.aggregate == "nanmean":
        vals = np.array(values, dtype=float)
        return float(np.nanmean(vals)) if np.isfinite(vals).any() else float("nan")
    if metric.aggregate == "mean":
        return float(np.mean(values)) if values else float("nan")
    if metric.aggregate == "judged":
        judged = [v for v in values if v is not None]
        return float(np.mean(judged)) if judged else float("nan")
    assert metric.aggregate == "failures", metric
    return float(sum(v is None for v in values))


def evaluation_metrics(
    rows: Sequence[dict[str, Any]], pairs: CalibrationPairs, calibrator: Calibrator, n_bins: int
) -> dict[str, float]:
    """Mean metrics over all gathered rows (each as its row of :mod:`judgeloop.loop.metrics_table` says),
    plus the calibrator's ECE on the labeled (greedy, sample) ``pairs`` (judged by each process on its own
    share: :func:`shard_pairs`)."""
    return {m.name: aggregate_metric(m, rows, pairs, calibrator, n_bins) for m in evaluated()}


def shard_pairs(
    rows: Sequence[dict[str, Any]], examples_by_id: dict[str, SummExample], train_judge: Judge
) -> CalibrationPairs:
    """This process's (greedy, sample) pairs of its evaluation rows, judged by the training judge and
    ROUGE-labeled: every process judges its own share once (not every gathered row on every rank)."""
    exs = [examples_by_id[r["id"]] for r in rows]
    return judge_and_label_pairs(exs, [r["summary"] for r in rows], [r["sample"] for r in rows], train_judge)


def run_evaluation(
    policy: Policy,
    splits: Splits,
    state: LoopState,
    judge: Judge,
    train_judge: Judge,
    calibrator: Calibrator,
    cfg: FeedbackLoopConfig,
    step: int,
    start: StartWork | None = None,
) -> dict[str, float]:
    """Test-split metrics (reported, never used to choose a checkpoint) and validation ROUGE-L.

    The per-article rows (summary, sample, every text metric, win, KL) are kept in
    ``state.per_article`` with their step. The policy generates where its backend says (the run's
    :class:`judgeloop.loop.rollout.GenerationBackend`). ``start``: at step 0, the starting policy's
    shared outputs.
    """
    accelerator = policy.accelerator
    ids = list(range(len(splits.test)))
    mine = shard(ids, accelerator)
    exs = [splits.test[i] for i in mine]
    seed = derive_seed(cfg.seed, "eval", step, accelerator.process_index)
    greedy = sampled = val_greedy = None
    gen, bs = cfg.generation, cfg.eval_batch_size
    if start is not None and start.cache is not None:
        greedy = start.greedy("policy", exs, lambda: policy.greedy(exs, gen, bs))
        kls, samples = start.get(
            "sampled",
            {"policy": start.policy_fp, "reference": start.ref_fp, "seed": seed, "ids": [e.id for e in exs]},
            lambda: list(policy.sampled_kl(exs, gen, bs, seed)),
        )
        sampled = ([float("nan") if k is None else k for k in kls], samples)
        vexs = shard(splits.validation, accelerator)
        if vexs:
            val_greedy = start.greedy("policy", vexs, lambda: policy.greedy(vexs, gen, bs))
    rows = evaluate_shard(
        policy,
        exs,
        [state.ref_summaries[i] for i in mine],
        judge,
        gen,
        bs,
        seed=seed,
        greedy=greedy,
        sampled=sampled,
    )
    rows = real_part(rows, len(ids), accelerator)
    pairs = gather_pairs(shard_pairs(rows, {e.id: e for e in exs}, train_judge))
    rows = gather_object(rows)
    state.per_article.extend(finite_or_none({"step": step, **r}) for r in rows)
    metrics = evaluation_metrics(rows, pairs, calibrator, cfg.calibration.num_bins)
    if splits.validation:  # the early-stopping criterion and the style metrics, without the test split
        vexs = shard(splits.validation, accelerator)
        _, val = greedy_text_metrics(policy, vexs, gen, bs, val_greedy)
        val = gather_object(real_part(val, len(splits.validation), accelerator))
        metrics |= {f"val_{m.name}": aggregate_metric(m, val) for m in shown_in("validation")}
    metrics["step"] = step
    metrics["num_refits"] = sum(1 for r in state.refits if r["refit"] and r["reason"] != "initial")
    return finite_or_none(metrics)


def keeps_best(cfg: FeedbackLoopConfig) -> bool:
    """Whether the run keeps its best validation policy: under early stopping, or when a divergence
    alarm may stop it."""
    return bool(cfg.early_stopping_patience or (cfg.alarms.enabled and cfg.alarms.action == "stop"))


def early_stopping(
    metrics: dict[str, float], state: LoopState, cfg: FeedbackLoopConfig, accelerator: Accelerator, model: Any
) -> bool:
    """Track the best validation ROUGE-L (saving that policy); True when patience is exhausted."""
    val = metrics.get("val_rouge_l_neutral")
    if val is None:
        return False
    if val > state.best_val + 1e-9:
        state.best_val, state.best_step, state.bad_evals = val, int(metrics["step"]), 0
        if keeps_best(cfg):  # every process: under FSDP / ZeRO-3 the weights are gathered
            save_policy(Path(cfg.output_dir) / "best_policy", accelerator, model)
        return False
    state.bad_evals += 1
    return bool(cfg.early_stopping_patience and state.bad_evals >= cfg.early_stopping_patience)


def reference_summaries(
    policy: Policy, test: Sequence[SummExample], cfg: FeedbackLoopConfig, start: StartWork | None = None
) -> list[str]:
    """Greedy summaries of the reference policy on the test articles (computed once: pi_ref never changes),
    in this process under either backend (:meth:`Policy.reference_greedy`)."""
    mine = shard(list(range(len(test))), policy.accelerator)
    exs = [test[i] for i in mine]

    def compute() -> list[str]:
        return policy.reference_greedy(exs, cfg.generation, cfg.eval_batch_size)

    out = start.greedy("reference", exs, compute) if start is not None else compute()
    pairs = list(zip(mine, out))
    pairs = gather_object(pairs)
    texts = dict(pairs)
    return [texts[i] for i in range(len(test))]
