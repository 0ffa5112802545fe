"""The calibrated feedback loop, top to bottom.

Each step of training reads as five named functions:

    1. rollout        the policy samples two summaries per training article
    2. judge_step     the judge gives a raw preference logit per pair
    3. calibrate      the arm's calibrator maps it to p = P(a better than b)
    4. policy_update  soft-target DPO on p, plus kl_coef * KL(pi || pi_ref)
    5. maybe_recalibrate  refit the calibrator on fresh samples of calibration articles

and, around them, evaluation (test split), early stopping (validation split) and checkpoints.
Runs unchanged under ``accelerate launch`` (each process takes its share of every batch).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.utils import gather_object

from judgeloop.calibration import Calibrator, calibrator_from_state
from judgeloop.calibration.coupling import coupling_line
from judgeloop.config import check_output_places, default_dict, to_yaml
from judgeloop.data import SummExample, load_examples, split_examples
from judgeloop.io import atomic_write_json, atomic_write_jsonl, atomic_write_text
from judgeloop.judges import Judge, build_judge, references_for
from judgeloop.logging import get_logger
from judgeloop.loop.checkpoint import (
    checked_resume,
    export_policy,
    load_checkpoint,
    load_policy_weights,
    remove_orphans,
    save_checkpoint,
    save_policy,
)
from judgeloop.loop.config import RESUME_FREE_KEYS, FeedbackLoopConfig, LossConfig
from judgeloop.loop.evaluation import (
    aggregate,
    eval_mode,
    evaluate_shard,
    greedy_summaries,
    sampled_kl,
    validation_metrics,
)
from judgeloop.loop.losses import (
    AdaptiveKLController,
    dpo_margin,
    kl_per_sequence,
    soft_dpo_loss,
    targets_from_probs,
)
from judgeloop.loop.policy import load_policy, reference_logprobs
from judgeloop.loop.recalibration import (
    CalibrationPairs,
    build_calibrator,
    build_training_judge,
    calibrate,
    check_calibration_budget,
    check_calibration_disjoint,
    holdout_mask,
    judge_coupling,
    label_pairs,
    monitor_due,
    needs_fit,
    pair_ece,
    recalibration_reason,
    refit,
)
from judgeloop.loop.rollout import PromptBuilder, Rollout, derive_seed, rollout, token_logprobs
from judgeloop.loop.shared import StartCache, model_fingerprint
from judgeloop.loop.tracking import make_trackers, truncate_jsonl_log
from judgeloop.models import load_tokenizer

logger = get_logger(__name__)


@dataclass
class LoopState:
    """Everything besides weights/optimizer that a resumed run needs (saved as state.json)."""

    step: int = 0
    epoch: int = 0
    cursor: int = 0
    kl_coef: float = 0.0
    history: list[dict[str, Any]] = field(default_factory=list)
    train_log: list[dict[str, Any]] = field(default_factory=list)
    refits: list[dict[str, Any]] = field(default_factory=list)
    ref_summaries: list[str] = field(default_factory=list)
    per_article: list[dict[str, Any]] = field(default_factory=list)
    coupling: list[dict[str, Any]] = field(default_factory=list)
    # run-long counters, so a resumed run's report counts the whole run
    judge_status: dict[str, int] = field(default_factory=dict)
    judge_cache_hits: int = 0
    truncated_articles: list[str] = field(default_factory=list)
    best_val: float = -1.0  # ROUGE is >= 0, so any first evaluation improves on it
    best_step: int = 0
    bad_evals: int = 0
    stopped_early: bool = False
    last_monitored_ece: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class Splits:
    train: list[SummExample]
    calibration: list[SummExample]
    validation: list[SummExample]
    test: list[SummExample]


def load_splits(cfg: FeedbackLoopConfig) -> Splits:
    """Load the articles, split them by stable hash, and check the calibration/train disjointness."""
    parts = split_examples(load_examples(cfg.data), cfg.data.split)
    splits = Splits(
        parts["train"],
        parts["calibration"],
        parts["validation"][: cfg.num_validation_articles],
        parts["test"][: cfg.num_eval_articles],
    )
    for name in ("train", "calibration", "test"):
        if not getattr(splits, name):
            raise ValueError(
                f"the '{name}' split is empty; use more articles (data.max_articles) or change "
                f"data.split fractions (now {cfg.data.split})"
            )
    if len(splits.train) < cfg.batch_size:
        raise ValueError(
            f"the train split has {len(splits.train)} articles, fewer than batch_size={cfg.batch_size}"
        )
    check_calibration_disjoint(splits.train, splits.calibration)
    return splits


def finite_or_none(values: dict[str, Any]) -> dict[str, Any]:
    """NaN/inf -> None, so metrics compare equal after a JSON round trip (checkpoint resume)."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in values.items()}


def shard(items: Sequence[Any], accelerator: Accelerator) -> list[Any]:
    return list(items[accelerator.process_index :: accelerator.num_processes])


def _batch_at(
    epoch: int, cursor: int, train: Sequence[SummExample], cfg: FeedbackLoopConfig, accelerator: Accelerator
) -> tuple[list[SummExample], int, int]:
    """This process's share of the global batch at (epoch, cursor), and the (epoch, cursor) after it."""
    global_bs = cfg.batch_size * accelerator.num_processes
    if cursor + global_bs > len(train):
        epoch, cursor = epoch + 1, 0
    order = np.random.RandomState(derive_seed(cfg.seed, "order", epoch)).permutation(len(train))
    idx = order[cursor : cursor + global_bs]
    mine = idx[accelerator.process_index * cfg.batch_size : (accelerator.process_index + 1) * cfg.batch_size]
    return [train[i] for i in mine], epoch, cursor + global_bs


def next_batch(
    state: LoopState, train: Sequence[SummExample], cfg: FeedbackLoopConfig, accelerator: Accelerator
) -> list[SummExample]:
    """This process's share of the next global batch (a seeded permutation per epoch; the cursor is checkpointed)."""
    batch, state.epoch, state.cursor = _batch_at(state.epoch, state.cursor, train, cfg, accelerator)
    return batch


def peek_batch(
    state: LoopState, train: Sequence[SummExample], cfg: FeedbackLoopConfig, accelerator: Accelerator
) -> list[SummExample]:
    """The batch :func:`next_batch` will return next, without moving the cursor."""
    return _batch_at(state.epoch, state.cursor, train, cfg, accelerator)[0]


class StartWork:
    """What the starting policy computes before step 1, shared with the other runs of an ablation.

    With a :class:`StartCache` (``cfg.start_cache``, one process), each result is stored under a key
    made of the model's fingerprint and every setting it depends on, so the runs that share them (every
    arm of a seed; every seed too when the start is seed-free) compute it once. Without one, or under
    several processes, everything is computed here as always. Either way the values are the same.
    """

    def __init__(
        self,
        cfg: FeedbackLoopConfig,
        accelerator: Accelerator,
        model: Any,
        ref: Any | None,
        tokenizer: Any,
        build_prompt: PromptBuilder,
        probe_article: str,
    ):
        self.cache: StartCache | None = None
        if cfg.start_cache and accelerator.num_processes == 1:
            self.cache = StartCache(cfg.start_cache)
        elif cfg.start_cache:
            logger.info("start_cache is ignored under %d processes", accelerator.num_processes)
        if self.cache is None:
            return
        probe = torch.tensor([build_prompt(probe_article)])
        unwrapped = accelerator.unwrap_model(model)
        self.policy_fp = model_fingerprint(unwrapped, probe)
        if ref is not None:
            self.ref_fp = model_fingerprint(ref, probe)
        else:
            with unwrapped.disable_adapter():
                self.ref_fp = model_fingerprint(unwrapped, probe)
        self.base = {
            "policy": dataclasses.asdict(cfg.policy),
            "data": dataclasses.asdict(cfg.data),
            "generation": dataclasses.asdict(cfg.generation),
            "eval_batch_size": cfg.eval_batch_size,
            "mixed_precision": cfg.mixed_precision,
        }

    def get(self, kind: str, key: dict[str, Any], compute: Any) -> Any:
        if self.cache is None:
            return compute()
        return self.cache.get_or_compute(kind, {**self.base, **key}, compute)

    def greedy(self, which: str, examples: Sequence[SummExample], compute: Any) -> list[str]:
        """Greedy summaries of the starting policy (``which="policy"``) or the reference (``"reference"``):
        one entry when their fingerprints agree (the LoRA reference is the start)."""
        fp = None if self.cache is None else (self.policy_fp if which == "policy" else self.ref_fp)
        return list(self.get("greedy", {"model": fp, "ids": [e.id for e in examples]}, compute))


class JudgePrefetch:
    """The summary-independent half of step 2, one step ahead.

    While the policy generates and updates on batch t, a background thread lets the judge do for
    batch t+1 what does not depend on the summaries (an embedding judge embeds the articles or
    references, :meth:`Judge.prepare`). The judge call of step t+1 then finds that work cached.
    Scores are unchanged (same texts, same batching); only when the work runs moves. The thread
    re-enters the caller's autocast state, since autocast is thread-local. A no-op for judges with
    nothing to prepare, or with ``enabled=False``.

    On CPU the cores are split while the judge thread works, so the two OpenMP pools never
    oversubscribe them: the judge thread has ``threads`` intra-op threads (default: half the cores),
    and the calling thread the rest from :meth:`start` until :meth:`wait` returns, then every core
    again (for the judge call itself). Without the split, measured on 2 cores, the overlap cost more
    than it saved. The split pays when the policy's own step is small or serial (the tiny config);
    with a policy whose matrix products use every core it does not, so ``enabled=None`` (auto) turns
    the prefetch on only when the judge runs on an accelerator.
    """

    def __init__(self, judge: Judge, enabled: bool | None = None, threads: int | None = None):
        self.judge = judge
        self._pool = None
        self._split: tuple[int, int] | None = None  # (all threads, the caller's share while work is pending)
        on_cpu = str(getattr(judge, "device", "cpu")) == "cpu"
        if enabled is None:
            enabled = not on_cpu
        if enabled and judge.can_prepare:
            from concurrent.futures import ThreadPoolExecutor

            initializer = None
            total = torch.get_num_threads()
            if on_cpu and total > 1:
                judge_threads = min(total - 1, threads or max(1, total // 2))
                self._split = (total, total - judge_threads)

                def initializer() -> None:
                    # per thread: the judge's share. The get first: ATen sets a new thread's count lazily
                    # from the process-wide one at its first query, which would undo a set made before.
                    torch.get_num_threads()
                    torch.set_num_threads(judge_threads)

            self._pool = ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="judge-prefetch", initializer=initializer
            )
        self._future: Any = None

    def start(self, batch: Sequence[SummExample]) -> None:
        """Begin preparing ``batch`` in the background (after waiting for any earlier request)."""
        if self._pool is None or not batch:
            return
        self.wait()
        autocast = [
            (dev, torch.get_autocast_dtype(dev)) for dev in ("cpu", "cuda") if torch.is_autocast_enabled(dev)
        ]
        cache = torch.is_autocast_cache_enabled()
        articles = [e.article for e in batch]
        refs = references_for(self.judge, batch)

        def work() -> None:
            with contextlib.ExitStack() as stack:
                for dev, dtype in autocast:
                    stack.enter_context(torch.autocast(dev, dtype=dtype, cache_enabled=cache))
                self.judge.prepare(articles, refs)

        self._future = self._pool.submit(work)
        if self._split is not None:
            torch.set_num_threads(self._split[1])  # the caller's share while the judge thread works

    def wait(self) -> None:
        """Block until the pending request is done (re-raising its error, if any)."""
        if self._future is not None:
            future, self._future = self._future, None
            try:
                future.result()
            finally:
                if self._split is not None:
                    torch.set_num_threads(self._split[0])  # the judge thread is idle: every core again

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self._future = None
        if self._split is not None:
            torch.set_num_threads(self._split[0])
            self._split = None


# --- the five steps -------------------------------------------------------------------------------


def judge_step(judge: Judge, batch: Sequence[SummExample], roll: Rollout) -> Any:
    """Step 2: raw preference logits for each (a, b) pair (both orders when the judge debiases position)."""
    return judge(roll.articles, roll.a_text, roll.b_text, references_for(judge, batch))


def policy_update(
    accelerator: Accelerator,
    model: Any,
    ref: Any | None,
    optimizer: Any,
    scheduler: Any,
    roll: Rollout,
    targets: torch.Tensor,
    mask: torch.Tensor,
    kl_coef: float,
    loss_cfg: LossConfig,
    max_grad_norm: float,
    pad_id: int,
) -> dict[str, float]:
    """Step 4: one optimizer step of soft-target DPO + kl_coef * KL(pi || pi_ref) on this process's pairs.

    The DPO term is summed over pairs and divided by the per-process batch size (skipped pairs count
    as zero), and the KL term is a mean over samples, so the DDP gradient average equals the
    full-batch gradient when every process has the same batch size.
    """
    B = len(roll.prompts)
    comps = roll.a_ids + roll.b_ids  # (2B) a-samples then b-samples; each prompt is run once for both
    device = accelerator.device
    ref_tok, _ = reference_logprobs(accelerator.unwrap_model(model), ref, roll.prompts, comps, pad_id, 2)
    pol_tok, tok_mask = token_logprobs(model, roll.prompts, comps, pad_id, samples_per_prompt=2)  # (2B, T)
    seq_pol, seq_ref = pol_tok.sum(-1), ref_tok.sum(-1)  # (2B,)
    h = dpo_margin(seq_pol[:B], seq_pol[B:], seq_ref[:B], seq_ref[B:])  # (B,)
    dpo = soft_dpo_loss(h, targets.to(device), loss_cfg.beta, mask.to(device)).sum() / B
    kl = kl_per_sequence(pol_tok, ref_tok, tok_mask, loss_cfg.kl_estimator).mean()
    loss = dpo + kl_coef * kl
    accelerator.backward(loss)
    grad_norm = float("nan")
    if max_grad_norm > 0:
        grad_norm = float(
            accelerator.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], max_grad_norm)
        )
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    with torch.no_grad():
        k1 = kl_per_sequence(pol_tok.detach(), ref_tok, tok_mask, "k1").mean()
        acc = ((h.detach() > 0).float() == (targets.to(device) >= 0.5).float()).float()
        acc = (acc * mask.to(device)).sum() / mask.sum().clamp(min=1)
    stats = torch.stack([loss.detach(), dpo.detach(), kl.detach(), k1, acc, mask.float().mean().to(device)])
    stats = accelerator.reduce(stats, reduction="mean")
    names = ["loss", "dpo_loss", "kl", "kl_k1", "margin_agreement", "kept_fraction"]
    out = {n: float(v) for n, v in zip(names, stats.tolist())}
    out["grad_norm"] = grad_norm
    return out


def collect_calibration_pairs(
    accelerator: Accelerator,
    model: Any,
    tokenizer: Any,
    build_prompt: PromptBuilder,
    judge: Judge,
    calibration: Sequence[SummExample],
    cfg: FeedbackLoopConfig,
    step: int,
) -> CalibrationPairs:
    """Fresh pairs for the calibrator: two samples of the *current* policy per calibration article,
    judged and ROUGE-labeled (articles drawn from the calibration split only).

    ``calibration.num_articles`` articles are drawn in a seeded order. Pairs whose two summaries tie on
    ROUGE-L carry no label and are dropped; when that leaves fewer than ``calibration.min_points`` pairs
    on the fit side (articles not held out), up to ``calibration.extra_rounds`` more batches of
    ``num_articles`` articles are drawn from the same order, so a weak policy whose samples often tie
    still gets a calibrator.
    """
    ccfg = cfg.calibration
    order = np.random.RandomState(derive_seed(cfg.seed, "calib_articles", step)).permutation(len(calibration))
    out = CalibrationPairs()
    for round_ in range(ccfg.extra_rounds + 1):
        pick = order[round_ * ccfg.num_articles : (round_ + 1) * ccfg.num_articles]
        if not len(pick):
            break
        # round 0 keeps the seed the loop has always used; later rounds get their own
        tag: tuple[Any, ...] = (step, accelerator.process_index) + ((round_,) if round_ else ())
        rows = _calibration_rows(
            accelerator,
            model,
            tokenizer,
            build_prompt,
            judge,
            shard([calibration[i] for i in sorted(pick)], accelerator),
            cfg,
            derive_seed(cfg.seed, "calib", *tag),
        )
        all_rows = gather_object(rows) if accelerator.num_processes > 1 else rows
        for r in all_rows:
            if "ties" in r:
                out.ties_dropped += r["ties"]
                out.judge_failures += r["failures"]
                continue
            out.article_ids.append(r["id"])
            out.articles.append(r["article"])
            out.a.append(r["a"])
            out.b.append(r["b"])
            out.scores.append(r["s"])
            out.labels.append(r["y"])
        fit = int((~holdout_mask(out.article_ids, ccfg.holdout_fraction, cfg.seed)).sum())
        if fit >= ccfg.min_points:  # the same on every process: the rows were gathered
            break
    return out


def _calibration_rows(
    accelerator: Accelerator,
    model: Any,
    tokenizer: Any,
    build_prompt: PromptBuilder,
    judge: Judge,
    mine: Sequence[SummExample],
    cfg: FeedbackLoopConfig,
    seed: int,
) -> list[dict[str, Any]]:
    """This process's labeled pairs for its share of the calibration articles, plus one counts row."""
    if not mine:
        return []
    roll = rollout(
        accelerator.unwrap_model(model),
        tokenizer,
        build_prompt,
        [e.article for e in mine],
        cfg.generation,
        seed=seed,
        num_pairs=cfg.calibration.pairs_per_article,
    )
    exs = [e for e in mine for _ in range(cfg.calibration.pairs_per_article)]
    pairs = label_pairs(exs, roll.a_text, roll.b_text, judge)
    rows: list[dict[str, Any]] = [
        {"id": i, "article": a, "a": x, "b": y, "s": s, "y": lab}
        for i, a, x, y, s, lab in zip(
            pairs.article_ids, pairs.articles, pairs.a, pairs.b, pairs.scores, pairs.labels
        )
    ]
    rows.append({"ties": pairs.ties_dropped, "failures": pairs.judge_failures})
    return rows


def maybe_recalibrate(
    step: int, state: LoopState, calibrator: Calibrator, collect: Any, cfg: FeedbackLoopConfig
) -> Calibrator:
    """Step 5: monitor ECE on fresh samples when due; refit on schedule or when ECE exceeds the threshold."""
    pairs = None
    if monitor_due(step, cfg.calibration):
        pairs = collect(step)
        monitored = pair_ece(calibrator, pairs, cfg.calibration.n_bins)
        state.last_monitored_ece = monitored if math.isfinite(monitored) else None
    reason = recalibration_reason(step, cfg.calibration, state.last_monitored_ece)
    if reason is None:
        return calibrator
    pairs = pairs if pairs is not None else collect(step)
    calibrator, record = refit(calibrator, pairs, cfg.calibration, step, reason, cfg.seed)
    state.coupling.append(finite_or_none({"step": step, **judge_coupling(pairs)}))
    logger.info("step %d: %s", step, coupling_line(state.coupling[-1]))
    state.refits.append(
        finite_or_none(
            {**record.as_dict(), "ties_dropped": pairs.ties_dropped, "judge_failures": pairs.judge_failures}
        )
    )
    state.last_monitored_ece = None
    ci = record.ece_delta_ci95
    logger.info(
        "step %d: recalibrated (%s) on %d pairs; held-out ECE %.4f -> %.4f on %d pairs (change 95%% CI %s)%s",
        step,
        reason,
        record.n_fit,
        record.ece_before,
        record.ece_after,
        record.n_holdout,
        "n/a" if ci[0] is None else f"[{ci[0]:+.4f}, {ci[1]:+.4f}]",
        "" if record.refit else f" (kept old: {record.error})",
    )
    return calibrator


# --- evaluation and early stopping -----------------------------------------------------------------


def run_evaluation(
    accelerator: Accelerator,
    model: Any,
    ref: Any | None,
    tokenizer: Any,
    build_prompt: PromptBuilder,
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
    ``state.per_article`` with their step. ``start``: at step 0, the starting policy's shared outputs.
    """
    unwrapped = accelerator.unwrap_model(model)
    ids = list(range(len(splits.test)))
    mine = shard(ids, accelerator)
    exs = [splits.test[i] for i in mine]
    seed = derive_seed(cfg.seed, "eval", step, accelerator.process_index)
    greedy = sampled = val_greedy = None
    gen, bs = cfg.generation, cfg.eval_batch_size
    if start is not None and start.cache is not None:
        with eval_mode(unwrapped):
            greedy = start.greedy(
                "policy", exs, lambda: greedy_summaries(unwrapped, tokenizer, build_prompt, exs, gen, bs)
            )
            kls, samples = start.get(
                "sampled",
                {
                    "policy": start.policy_fp,
                    "reference": start.ref_fp,
                    "seed": seed,
                    "ids": [e.id for e in exs],
                },
                lambda: list(sampled_kl(unwrapped, ref, tokenizer, build_prompt, exs, gen, bs, seed)),
            )
            sampled = ([float("nan") if k is None else k for k in kls], samples)
            vexs = shard(splits.validation, accelerator)
            if vexs:
                val_greedy = start.greedy(
                    "policy",
                    vexs,
                    lambda: greedy_summaries(unwrapped, tokenizer, build_prompt, vexs, gen, bs),
                )
    rows = evaluate_shard(
        unwrapped,
        ref,
        tokenizer,
        build_prompt,
        exs,
        [state.ref_summaries[i] for i in mine],
        judge,
        gen,
        bs,
        seed=seed,
        greedy=greedy,
        sampled=sampled,
    )
    rows = gather_object(rows) if accelerator.num_processes > 1 else rows
    state.per_article.extend(finite_or_none({"step": step, **r}) for r in rows)
    by_id = {e.id: e for e in splits.test}
    metrics = aggregate(rows, by_id, train_judge, calibrator, cfg.calibration.n_bins)
    if splits.validation:
        val = validation_metrics(
            unwrapped,
            tokenizer,
            build_prompt,
            shard(splits.validation, accelerator),
            cfg.generation,
            cfg.eval_batch_size,
            greedy=val_greedy,
        )
        val = gather_object(val) if accelerator.num_processes > 1 else val
        for key in ("rouge_l_neutral", "rouge_l_extractive", "copy_rate", "length"):
            vals = np.array([v[key] for v in val], dtype=float)
            metrics[f"val_{key}"] = float(np.nanmean(vals)) if np.isfinite(vals).any() else float("nan")
    metrics["step"] = step
    metrics["num_refits"] = sum(1 for r in state.refits if r["refit"] and r["reason"] != "initial")
    return finite_or_none(metrics)


def early_stopping(
    metrics: dict[str, float], state: LoopState, cfg: FeedbackLoopConfig, accelerator: Accelerator, model: Any
) -> bool:
    """Track the best validation ROUGE-L (saving that policy); True when patience is exhausted."""
    val = metrics.get("val_rouge_l_neutral")
    if val is None:
        return False
    if val > state.best_val + 1e-9:
        state.best_val, state.best_step, state.bad_evals = val, int(metrics["step"]), 0
        if cfg.early_stopping_patience and accelerator.is_main_process:
            save_policy(Path(cfg.output_dir) / "best_policy", accelerator.unwrap_model(model))
        accelerator.wait_for_everyone()
        return False
    state.bad_evals += 1
    return bool(cfg.early_stopping_patience and state.bad_evals >= cfg.early_stopping_patience)


# --- set-up -------------------------------------------------------------------------------------


def make_optimizer(model: Any, cfg: FeedbackLoopConfig) -> tuple[Any, Any]:
    from judgeloop.optim import adamw

    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = adamw(params, lr=cfg.optim.lr, weight_decay=cfg.optim.weight_decay)
    warm, total = cfg.optim.warmup_steps, cfg.num_steps

    def factor(i: int) -> float:
        if warm and i < warm:
            return (i + 1) / warm
        if cfg.optim.scheduler == "linear":
            return max(0.0, (total - i) / max(1, total - warm))
        return 1.0

    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def reference_summaries(
    accelerator: Accelerator,
    model: Any,
    ref: Any | None,
    tokenizer: Any,
    build_prompt: PromptBuilder,
    test: Sequence[SummExample],
    cfg: FeedbackLoopConfig,
    start: StartWork | None = None,
) -> list[str]:
    """Greedy summaries of the reference policy on the test articles (computed once: pi_ref never changes)."""
    unwrapped = accelerator.unwrap_model(model)
    mine = shard(list(range(len(test))), accelerator)
    exs = [test[i] for i in mine]

    def compute() -> list[str]:
        if ref is not None:
            return greedy_summaries(ref, tokenizer, build_prompt, exs, cfg.generation, cfg.eval_batch_size)
        with unwrapped.disable_adapter():
            return greedy_summaries(
                unwrapped, tokenizer, build_prompt, exs, cfg.generation, cfg.eval_batch_size
            )

    out = start.greedy("reference", exs, compute) if start is not None else compute()
    pairs = list(zip(mine, out))
    pairs = gather_object(pairs) if accelerator.num_processes > 1 else pairs
    texts = dict(pairs)
    return [texts[i] for i in range(len(test))]


def initial_calibration_pairs(
    start: StartWork, cfg: FeedbackLoopConfig, splits: Splits, collect: Any
) -> CalibrationPairs:
    """The step-0 calibration pairs: samples of the starting policy, judged and labeled; shared by the
    calibrated arms of a seed (they differ only in the map fitted on these pairs)."""
    ccfg = cfg.calibration
    key = {
        "policy_fp": getattr(start, "policy_fp", None),
        "seed": cfg.seed,
        "judge": dataclasses.asdict(cfg.judge),
        "calibration_ids": [e.id for e in splits.calibration],
        "sampling": [ccfg.num_articles, ccfg.extra_rounds, ccfg.pairs_per_article, ccfg.holdout_fraction],
        "min_points": ccfg.min_points,
    }
    return CalibrationPairs.from_dict(start.get("calibration_pairs", key, lambda: collect().as_dict()))


def check_models(cfg: FeedbackLoopConfig) -> None:
    """Every model the config names resolves (before data or weights load); a ConfigError names the key."""
    from judgeloop.config import ConfigError
    from judgeloop.models import check_model

    for key, name in (("policy.model", cfg.policy.model), ("judge.model", cfg.judge.model)):
        try:
            check_model(name, key)
        except ValueError as err:
            raise ConfigError(str(err)) from None


def train(cfg: FeedbackLoopConfig) -> dict[str, Any]:
    """Run the feedback loop described by ``cfg``; returns (and writes) the run report.

    Writes under ``cfg.output_dir``: ``config.yaml``, ``metrics.jsonl``, ``checkpoints/step_N``,
    ``report.json`` (final metrics of the kept policy, curves, refits, early-stopping decision) and
    ``policy/`` (the kept policy, its tokenizer and the final calibrator, when ``save_final_policy``).
    """
    out_dir = Path(cfg.output_dir)
    # checked before any work: the output folder can be written, the models the config names resolve
    check_output_places(cfg)
    check_models(cfg)
    accelerator = Accelerator(
        cpu=cfg.cpu,
        log_with=make_trackers(cfg.log_with, out_dir),
        project_dir=str(out_dir),
        **mixed_precision_kwargs(cfg.mixed_precision),
    )
    # bf16 autocast (when mixed_precision=bf16) covers the reference pass, the judge and evaluation too,
    # not only the prepared model's forward; master weights and optimizer state stay fp32.
    with accelerator.autocast():
        return _train(cfg, accelerator, out_dir)


def mixed_precision_kwargs(mixed_precision: str) -> dict[str, Any]:
    """``Accelerator`` arguments for ``mixed_precision`` ("no" or "bf16").

    mixed_precision is passed only when asked for: accelerate refuses to re-set it once its
    process-wide state exists (e.g. a second run in the same process, as in the ablation).

    Under bf16 the autocast weight-cast cache is off. The loop runs in one autocast context, across
    optimizer steps, and autocast keeps its bf16 copy of a trainable weight until the outermost context
    exits: with the cache on, every forward after the first step would use the step-0 weights (the LoRA
    adapters or the full model, as first cast) while the optimizer updated the fp32 ones. Without it the
    trainable weights are cast at each use, as frozen weights always are.
    """
    if mixed_precision == "no":
        return {}
    from accelerate.utils import AutocastKwargs

    return {"mixed_precision": mixed_precision, "kwargs_handlers": [AutocastKwargs(cache_enabled=False)]}


def _train(cfg: FeedbackLoopConfig, accelerator: Accelerator, out_dir: Path) -> dict[str, Any]:
    # a resume is checked before any work too: a checkpoint, made with the same run-changing settings
    ckpt_step = (
        checked_resume(to_yaml(cfg), cfg.resume_from, RESUME_FREE_KEYS, default_dict(type(cfg)))
        if cfg.resume_from
        else None
    )
    if accelerator.is_main_process:
        for orphan in remove_orphans(out_dir):
            what = "restored" if orphan.name.endswith(".old") and not orphan.exists() else "removed"
            logger.info("%s %s, left by a killed checkpoint write", what, orphan)
        if ckpt_step is not None:
            dropped = truncate_jsonl_log(out_dir / "metrics.jsonl", ckpt_step)
            if dropped:
                logger.info(
                    "metrics.jsonl: dropped %d rows logged after the checkpoint's step %d", dropped, ckpt_step
                )
        atomic_write_text(out_dir / "config.yaml", to_yaml(cfg))
    accelerator.init_trackers("feedback_loop")
    torch.manual_seed(cfg.seed)
    np.random.seed(cfg.seed)

    splits = load_splits(cfg)
    check_calibration_budget(cfg.calibration, [e.id for e in splits.calibration], cfg.seed)
    tokenizer = load_tokenizer(cfg.policy.model)
    build_prompt = PromptBuilder(tokenizer, cfg.policy)
    sft = (
        [build_prompt(e.article) for e in splits.train],
        [e.neutral[0] if e.neutral else "" for e in splits.train],
    )
    model, tokenizer, ref = load_policy(cfg.policy, cfg.seed, sft if cfg.policy.sft_steps else None)
    if ref is not None:
        ref.to(accelerator.device)
    judge_cfg = cfg.judge
    if accelerator.device.type == "cuda" and judge_cfg.device.startswith("cuda"):
        judge_cfg = dataclasses.replace(
            judge_cfg, device=str(accelerator.device)
        )  # one judge per process's GPU
    judge = build_judge(judge_cfg)
    train_judge = build_training_judge(cfg.calibration, judge)
    optimizer, scheduler = make_optimizer(model, cfg)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    pad_id = tokenizer.pad_token_id
    kl_ctl = AdaptiveKLController(
        cfg.loss.kl_coef, cfg.loss.kl_adaptive, cfg.loss.kl_target, cfg.loss.kl_horizon
    )

    def collect(step: int) -> CalibrationPairs:
        return collect_calibration_pairs(
            accelerator, model, tokenizer, build_prompt, train_judge, splits.calibration, cfg, step
        )

    start = StartWork(cfg, accelerator, model, ref, tokenizer, build_prompt, splits.test[0].article)

    def evaluate(step: int) -> dict[str, float]:
        return run_evaluation(
            accelerator,
            model,
            ref,
            tokenizer,
            build_prompt,
            splits,
            state,
            judge,
            train_judge,
            calibrator,
            cfg,
            step,
            start if step == 0 else None,
        )

    state = LoopState(kl_coef=kl_ctl.coef)
    calibrator = build_calibrator(cfg.calibration)
    if cfg.resume_from:
        cal_state, saved = load_checkpoint(
            cfg.resume_from, accelerator.unwrap_model(model), optimizer, scheduler
        )
        state = LoopState(**saved)
        calibrator = calibrator_from_state(cal_state)
        kl_ctl.coef = state.kl_coef
        train_judge.stats.status.update(state.judge_status)
        train_judge.stats.cache_hits += state.judge_cache_hits
        build_prompt.truncated.update(state.truncated_articles)
        logger.info("resumed from %s at step %d", cfg.resume_from, state.step)
    else:
        state.ref_summaries = reference_summaries(
            accelerator, model, ref, tokenizer, build_prompt, splits.test, cfg, start
        )
        if (
            cfg.calibration.method != "oracle"
        ):  # samples of the initial policy: the judge's coupling, the first fit
            pairs = initial_calibration_pairs(start, cfg, splits, lambda: collect(0))
            state.coupling.append(finite_or_none({"step": 0, **judge_coupling(pairs)}))
            line = coupling_line(state.coupling[-1])
            (logger.warning if line.startswith("WARNING") else logger.info)("step 0: %s", line)
        if needs_fit(cfg.calibration):  # the first fit
            calibrator, record = refit(
                calibrator, pairs, cfg.calibration, 0, "initial", cfg.seed, first_fit=True
            )
            state.refits.append(
                finite_or_none(
                    {
                        **record.as_dict(),
                        "ties_dropped": pairs.ties_dropped,
                        "judge_failures": pairs.judge_failures,
                    }
                )
            )
        if cfg.eval_every_n_steps:
            metrics = evaluate(0)
            state.history.append(metrics)
            early_stopping(metrics, state, cfg, accelerator, model)
            accelerator.log({f"eval/{k}": v for k, v in metrics.items()}, step=0)

    bar = None
    if cfg.progress_bar and accelerator.is_local_main_process:
        from tqdm.auto import tqdm

        bar = tqdm(total=cfg.num_steps, initial=state.step, desc=f"feedback loop [{cfg.calibration.method}]")
    steps_this_run = 0
    prefetch = JudgePrefetch(train_judge, cfg.judge_prefetch, cfg.judge_prefetch_threads)
    try:
        if state.step < cfg.num_steps:
            prefetch.start(peek_batch(state, splits.train, cfg, accelerator))  # overlaps the first rollout
        while state.step < cfg.num_steps and not state.stopped_early:
            step = state.step + 1
            batch = next_batch(state, splits.train, cfg, accelerator)
            roll = rollout(
                accelerator.unwrap_model(model),
                tokenizer,
                build_prompt,
                [e.article for e in batch],
                cfg.generation,
                seed=derive_seed(cfg.seed, "rollout", step, accelerator.process_index),
            )
            prefetch.wait()
            judged = judge_step(train_judge, batch, roll)
            if step < cfg.num_steps:  # the next batch's article-side judge work runs during this update
                prefetch.start(peek_batch(state, splits.train, cfg, accelerator))
            p = calibrate(calibrator, judged.scores, roll.articles, roll.a_text, roll.b_text)
            targets, mask = targets_from_probs(
                torch.tensor(p, dtype=torch.float32), cfg.loss.target, cfg.loss.margin
            )
            stats = policy_update(
                accelerator,
                model,
                ref,
                optimizer,
                scheduler,
                roll,
                targets,
                mask,
                kl_ctl.coef,
                cfg.loss,
                cfg.optim.max_grad_norm,
                pad_id,
            )
            stats.update(
                kl_coef=kl_ctl.coef,
                p_mean=float(np.nanmean(p)) if np.isfinite(p).any() else float("nan"),
                judge_failures=float((~judged.valid).sum()),
                lr=float(scheduler.get_last_lr()[0]),
            )
            kl_ctl.update(stats["kl"])
            state.kl_coef = kl_ctl.coef
            state.step = step
            state.train_log.append(finite_or_none({"step": step, **stats}))
            accelerator.log({f"train/{k}": v for k, v in stats.items()}, step=step)
            calibrator = maybe_recalibrate(step, state, calibrator, collect, cfg)
            if cfg.eval_every_n_steps and step % cfg.eval_every_n_steps == 0:
                metrics = evaluate(step)
                state.history.append(metrics)
                accelerator.log({f"eval/{k}": v for k, v in metrics.items()}, step=step)
                if early_stopping(metrics, state, cfg, accelerator, model):
                    state.stopped_early = True
                    logger.info(
                        "early stopping at step %d: validation ROUGE-L has not improved for %d evaluations "
                        "(best %.4f at step %d)",
                        step,
                        cfg.early_stopping_patience,
                        state.best_val,
                        state.best_step,
                    )
            steps_this_run += 1
            interrupted = cfg.stop_after_n_steps is not None and steps_this_run >= cfg.stop_after_n_steps
            if (cfg.save_every_n_steps and step % cfg.save_every_n_steps == 0) or interrupted:
                state.judge_status = dict(train_judge.stats.status)
                state.judge_cache_hits = train_judge.stats.cache_hits
                state.truncated_articles = sorted(build_prompt.truncated)
                if accelerator.is_main_process:
                    save_checkpoint(
                        out_dir / "checkpoints" / f"step_{step}",
                        accelerator.unwrap_model(model),
                        optimizer,
                        scheduler,
                        calibrator.state_dict(),
                        state.as_dict(),
                        to_yaml(cfg),
                    )
                accelerator.wait_for_everyone()
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{stats['loss']:.3f}", kl=f"{stats['kl']:.3f}")
            if interrupted and state.step < cfg.num_steps:
                if bar is not None:
                    bar.close()
                accelerator.end_training()
                return {
                    "interrupted": True,
                    "step": state.step,
                    "checkpoint": str(out_dir / "checkpoints" / f"step_{state.step}"),
                }
    finally:  # also on an error or an interruption: no prefetch thread outlives the run
        prefetch.close()
    if bar is not None:
        bar.close()

    # The kept policy: the best validation checkpoint when early stopping is on, else the last one.
    kept_step, why = state.step, "last step (early stopping off)"
    if cfg.early_stopping_patience:
        kept_step = state.best_step
        why = f"best validation ROUGE-L {state.best_val:.4f}; " + (
            "stopped early" if state.stopped_early else "ran all steps"
        )
        if kept_step != state.step:
            accelerator.wait_for_everyone()
            load_policy_weights(out_dir / "best_policy", accelerator.unwrap_model(model))
    final = next((h for h in state.history if h["step"] == kept_step), None)
    if final is None:
        final = evaluate(state.step)
        final["step"] = kept_step
        state.history.append(final)
    report = {
        "arm": cfg.calibration.method,
        "seed": cfg.seed,
        "steps_run": state.step,
        "kept_step": kept_step,
        "kept_reason": why,
        "stopped_early": state.stopped_early,
        "final": final,
        "history": state.history,
        "train_log": state.train_log,
        "refits": state.refits,
        "judge_coupling": state.coupling,
        "num_refits": sum(1 for r in state.refits if r["refit"] and r["reason"] != "initial"),
        "judge_stats": {"status": dict(train_judge.stats.status), "cache_hits": train_judge.stats.cache_hits},
        "prompts_truncated": build_prompt.num_truncated,
        "per_article": "per_article.jsonl",
        "start_cache": None
        if start.cache is None
        else {"hits": start.cache.hits, "misses": start.cache.misses},
    }
    if accelerator.is_main_process:
        if cfg.save_final_policy:
            export_policy(
                out_dir / "policy", accelerator.unwrap_model(model), tokenizer, calibrator.state_dict()
            )
        atomic_write_jsonl(out_dir / "per_article.jsonl", state.per_article)
        atomic_write_json(out_dir / "report.json", report)
    accelerator.end_training()
    return report
