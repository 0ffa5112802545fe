"""The calibrated feedback loop, top to bottom.

One training step (:func:`training_step`) is seven named functions over one :class:`PairBatch`:

    1. rollout_step       the policy samples two summaries per training article (and keeps its pass over
                          the prompts, with gradients, for step 5: optim.share_prompt_pass)
    2. judge_step         the judge (or a panel of judges) gives a raw preference logit per pair
    3. calibrate_step     the arm's calibrator maps it to p = P(a better than b)
    4. make_pairs         p becomes each pair's soft DPO target (and the mask / weights of pairs that count)
    5. policy_update      soft-target DPO on the targets, plus kl_coef * KL(pi || pi_ref)
    6. maybe_recalibrate  refit the calibrator (and a panel's members) on fresh calibration-split samples
    7. watch_divergence   when due, the judge's agreement with objective signals; alarms act on it

with evaluation on the test split and early stopping on validation inside it. Under ``loss.type: grpo``
(:mod:`judgeloop.loop.grpo`) step 1 samples a group of k per article, steps 2-3 are
:func:`judge_groups_step` (comparisons inside each group, judged and calibrated in one call, aggregated
into one reward per sample), step 4 is :func:`make_advantages` (group-relative advantages) and step 5
:func:`grpo_update`; 6 and 7 are the same. :func:`train` is the whole run, and ``recipes/feedback_loop.py`` spells out its lines:

    with open_run(cfg) as run:          # setup_run, then resume_run or start_run (step 0: the first fit)
        with stepping(run) as steps:    # the judge's prefetch thread and the progress bar live meanwhile
            for step in steps:
                after_step(run, training_step(run, step))   # checkpoints
        return close_run(run)           # finish_run: the kept policy and the report

Runs unchanged under ``accelerate launch`` (each process takes its share of every batch).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, gather_object

from judgeloop.calibration import Calibrator, calibrator_from_state
from judgeloop.calibration.coupling import coupling_line
from judgeloop.checkpointing import prune_checkpoints, save_only_trainable
from judgeloop.config import ConfigError, check_output_places, default_dict, to_dict, to_yaml
from judgeloop.data import SummExample, load_examples, split_examples
from judgeloop.devices import (
    check_device,
    intra_op_threads,
    numerics,
    numerics_differences,
    on_cpu,
    process_device,
)
from judgeloop.distributed import (
    accelerator_kwargs,
    configure_deepspeed,
    generation_context,
    load_trainable_state,
    prepare_for_inference,
    trainable_state,
    whole_models,
)
from judgeloop.io import atomic_write_json, atomic_write_jsonl, atomic_write_text
from judgeloop.judges import Judge, build_judge, members_models, models_of, references_for
from judgeloop.logging import get_logger
from judgeloop.loop.alarms import check_divergence
from judgeloop.loop.checkpoint import (
    checked_resume,
    export_policy,
    latest_checkpoint,
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
    merge_pairs,
    sampled_kl,
    shard_pairs,
    validation_metrics,
)
from judgeloop.loop.grpo import grpo_chunk_terms, judge_groups, num_completion_tokens, reward_matrix
from judgeloop.loop.losses import (
    AdaptiveKLController,
    dpo_margin,
    group_advantages,
    kl_per_sequence,
    soft_dpo_loss,
    targets_from_probs,
)
from judgeloop.loop.policy import load_policy, reference_logprobs
from judgeloop.loop.prefetch import JudgePrefetch
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
from judgeloop.loop.rollout import (
    PromptBuilder,
    Rollout,
    derive_seed,
    prefix_reusable,
    rollout,
    token_logprobs,
)
from judgeloop.loop.shared import StartCache, model_fingerprint
from judgeloop.models import load_tokenizer
from judgeloop.signals import Stopped, StopRequest, stop_signals
from judgeloop.tracking import check_trackers, init_trackers, make_trackers, truncate_jsonl_log

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
    judge_state: dict[str, Any] | None = None  # a panel's fitted members (what its refits learned)
    judge_weight: float = 1.0  # shrinks when a divergence alarm down-weights the judge
    alarm_checks: list[dict[str, Any]] = field(default_factory=list)
    alarms: list[dict[str, Any]] = field(default_factory=list)
    stop_reason: str = ""
    # what set the run's float rounding (:func:`judgeloop.devices.numerics`), one entry per start or resume
    numerics: list[dict[str, Any]] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class Splits:
    """The four disjoint article splits of a run."""

    train: list[SummExample]
    calibration: list[SummExample]
    validation: list[SummExample]
    test: list[SummExample]


def load_splits(cfg: FeedbackLoopConfig, num_processes: int = 1) -> Splits:
    """Load the articles, split them by stable hash, and check the calibration/train disjointness and
    that the train split fills one global batch (``batch_size`` on each of ``num_processes``)."""
    parts = split_examples(load_examples(cfg.data), cfg.data.split)
    splits = Splits(
        parts["train"],
        parts["calibration"],
        parts["validation"][: cfg.num_validation_articles],
        parts["test"][: cfg.num_eval_articles],
    )
    for name in ("train", "calibration", "test"):
        if not getattr(splits, name):
            raise ConfigError(
                f"the '{name}' split is empty; use more articles (data.max_articles) or change "
                f"data.split fractions (now {cfg.data.split})"
            )
    if len(splits.train) < cfg.batch_size * num_processes:  # a process would get a short or empty batch
        per = f" x {num_processes} processes" if num_processes > 1 else ""
        raise ConfigError(
            f"the train split has {len(splits.train)} articles, fewer than batch_size={cfg.batch_size}{per}; "
            "lower batch_size or use more data (data.max_articles)"
        )
    for name, asked, have in (
        ("num_eval_articles", cfg.num_eval_articles, len(splits.test)),
        ("num_validation_articles", cfg.num_validation_articles, len(splits.validation)),
    ):
        if have < asked:  # evaluated on what there is, and said so (the report's counts show it too)
            logger.warning(
                "%s=%d but its split has %d articles: evaluating on %d (raise data.max_articles or the "
                "split fraction for more)", name, asked, have, have,
            )  # fmt: skip
    check_calibration_disjoint(splits.train, splits.calibration)
    return splits


def finite_or_none(values: dict[str, Any]) -> dict[str, Any]:
    """NaN/inf -> None, so metrics compare equal after a JSON round trip (checkpoint resume)."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in values.items()}


def shard(items: Sequence[Any], accelerator: Accelerator) -> list[Any]:
    """This process's share of ``items`` (every ``num_processes``-th item, from its index), padded so that
    every process gets the same number: the last item repeats where a process would have one fewer.

    Under FSDP and ZeRO-3 each forward pass is a collective (every rank gathers the weights), so a rank
    with one batch fewer would leave the others waiting forever. Results for the padding are dropped
    with :func:`real_part` before they are gathered.
    """
    n, size = len(items), accelerator.num_processes
    padded = list(items) + [items[-1]] * (-n % size) if n else []
    return padded[accelerator.process_index :: size]


def real_part(results: Sequence[Any], num_items: int, accelerator: Accelerator) -> list[Any]:
    """The results of this process's real items of a :func:`shard` of ``num_items`` (the padding dropped)."""
    return list(results[: len(range(accelerator.process_index, num_items, accelerator.num_processes))])


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


# --- one step's data, and the steps over it ---------------------------------------------------------


@dataclass
class PairBatch:
    """One training step's pairs, filled in as they flow through the loop:
    ``rollout -> judge -> calibrate -> make_pairs -> update``."""

    step: int
    examples: list[SummExample]  # this process's training articles
    rollout: Rollout | None = None  # prompts, the two (grpo: k) samples' token ids and texts
    judged: Any = None  # the judge's output: raw logit and status per pair (grpo: the GroupScores)
    p: np.ndarray | None = None  # calibrated P(a better than b) per pair
    targets: torch.Tensor | None = None  # soft DPO targets (B,)
    mask: torch.Tensor | None = None  # pairs that enter the loss (B,); grpo: samples with a reward (B, k)
    weights: torch.Tensor | None = None  # per-pair weight of the DPO term (B,); None: all 1
    rewards: torch.Tensor | None = None  # grpo: each sample's groupwise reward (B, k)
    advantages: torch.Tensor | None = None  # grpo: group-relative advantages (B, k)
    stats: dict[str, float] = field(default_factory=dict)  # what the update measured


@dataclass
class Learner:
    """What step 4 updates and how: the prepared policy, the frozen reference, optimizer, schedule, loss."""

    accelerator: Accelerator
    model: Any
    ref: Any | None
    optimizer: Any
    scheduler: Any
    loss: LossConfig
    max_grad_norm: float
    pad_id: int
    chunk_size: int | None = None  # articles per forward/backward pass (None: the whole batch at once)
    share_prompt_pass: bool = False  # the update reuses the rollout's prompt pass (optim.share_prompt_pass)

    def reuses_prompt_pass(self, num_articles: int) -> bool:
        """Whether this step's rollout keeps its prompt pass for the update: one chunk covers the batch."""
        return self.share_prompt_pass and (self.chunk_size is None or self.chunk_size >= num_articles)


def rollout_step(model: Any, tokenizer: Any, build_prompt: PromptBuilder, batch: PairBatch, cfg: FeedbackLoopConfig,
                 process_index: int, keep_prefix: bool = False) -> Rollout:  # fmt: skip
    """Step 1: the policy samples two summaries per article, or ``generation.num_samples_per_article``
    under grpo (``keep_prefix``: and keeps its prompt pass, with gradients, for the update)."""
    batch.rollout = rollout(
        model,
        tokenizer,
        build_prompt,
        [e.article for e in batch.examples],
        cfg.generation,
        seed=derive_seed(cfg.seed, "rollout", batch.step, process_index),
        keep_prefix=keep_prefix,
        num_samples=cfg.generation.num_samples_per_article if cfg.loss.type == "grpo" else 2,
    )
    return batch.rollout


def judge_step(judge: Judge, batch: PairBatch) -> Any:
    """Step 2: raw preference logits for each (a, b) pair (both orders when the judge debiases position)."""
    roll = batch.rollout
    assert roll is not None, "judge_step needs the rollout"
    batch.judged = judge(roll.articles, roll.a_text, roll.b_text, references_for(judge, batch.examples))
    return batch.judged


def calibrate_step(calibrator: Calibrator, batch: PairBatch) -> np.ndarray:
    """Step 3: the arm's calibrator maps each raw logit to p = P(a better than b)."""
    roll = batch.rollout
    assert roll is not None and batch.judged is not None, "calibrate_step needs the judged rollout"
    batch.p = calibrate(calibrator, batch.judged.scores, roll.articles, roll.a_text, roll.b_text)
    return batch.p


def judge_groups_step(judge: Judge, calibrator: Calibrator, cfg: FeedbackLoopConfig, batch: PairBatch) -> Any:
    """Steps 2-3 under grpo: the judge compares the samples inside each article's group
    (``loss.reward_scheme``), the arm's calibrator maps each comparison to p, and the p of each sample's
    comparisons become its reward (``loss.reward_aggregate``), in one batched judge call."""
    roll = batch.rollout
    assert roll is not None, "judge_groups_step needs the rollout"
    batch.judged = judge_groups(judge, calibrator, cfg.judge, roll, batch.examples, cfg.loss)
    batch.rewards, valid = reward_matrix(batch.judged)
    batch.mask = valid.float()
    return batch.judged


def make_advantages(batch: PairBatch, loss_cfg: LossConfig, judge_weight: float = 1.0) -> None:
    """Step 4 under grpo: group-relative advantages ``r - mean(group)`` (divided by the group's std under
    ``loss.scale_rewards: group``); samples without a reward, and groups with fewer than two, get 0.

    ``judge_weight`` < 1 (a divergence alarm down-weighted the judge) scales the advantages: the judge's
    weight in the policy gradient against the KL term.
    """
    assert batch.rewards is not None and batch.mask is not None, "make_advantages needs the rewards"
    batch.advantages = judge_weight * group_advantages(
        batch.rewards, batch.mask.bool(), loss_cfg.scale_rewards
    )


def make_pairs(batch: PairBatch, loss_cfg: LossConfig, judge_weight: float = 1.0) -> None:
    """Step 3b: p becomes the DPO target of each pair, and the mask of the pairs that enter the loss.

    ``judge_weight`` < 1 (a divergence alarm down-weighted the judge) shrinks p toward 0.5 first. A
    panel's pairs whose members disagree beyond ``loss.max_spread`` are skipped, and with
    ``loss.spread_weighting`` each pair counts ``1 - 2 * spread``.
    """
    assert batch.p is not None and batch.judged is not None, "make_pairs needs calibrated p"
    p = batch.p if judge_weight == 1.0 else 0.5 + judge_weight * (batch.p - 0.5)
    batch.targets, batch.mask = targets_from_probs(
        torch.tensor(p, dtype=torch.float32), loss_cfg.target, loss_cfg.margin
    )
    spread = batch.judged.spread
    if np.isfinite(spread).any():  # a panel
        batch.stats["spread_mean"] = float(np.nanmean(spread))
        batch.mask = (
            batch.mask * torch.as_tensor(np.nan_to_num(spread, nan=0.0) <= loss_cfg.max_spread).float()
        )
        if loss_cfg.spread_weighting:
            batch.weights = torch.as_tensor(1.0 - 2.0 * np.nan_to_num(spread, nan=0.5), dtype=torch.float32)


def policy_update(learner: Learner, batch: PairBatch, kl_coef: float) -> dict[str, float]:
    """Step 4: one optimizer step of soft-target DPO + kl_coef * KL(pi || pi_ref) on this process's pairs.

    The DPO term is summed over pairs and divided by the per-process batch size (skipped pairs count
    as zero), and the KL term is a mean over samples, so the DDP gradient average equals the
    full-batch gradient when every process has the same batch size. With ``optim.update_chunk_size``
    the articles go through the forward and backward passes that many at a time, their gradients
    adding up to the same update (up to float summation order) at a fraction of the activation memory.
    """
    if learner.loss.type == "grpo":
        return grpo_update(learner, batch, kl_coef)
    roll, targets, mask = batch.rollout, batch.targets, batch.mask
    assert roll is not None and targets is not None and mask is not None, "policy_update needs the pairs"
    acc = learner.accelerator
    B = len(roll.prompts)
    chunk = learner.chunk_size or B
    parts = [
        _chunk_loss(learner, roll, targets, mask, lo, min(lo + chunk, B), B, kl_coef, batch.weights)
        for lo in range(0, B, chunk)
    ]
    grad_norm = optimizer_step(learner)
    # each chunk's terms are already weighted by its share of the batch: their sums are the batch's
    totals = [torch.stack([p[i] for p in parts]).sum() if len(parts) > 1 else parts[0][i] for i in range(5)]
    stats = torch.stack([*totals, mask.float().mean().to(acc.device)])
    agree_n = mask.sum().clamp(min=1).to(acc.device)
    stats[4] = stats[4] / agree_n
    stats = acc.reduce(stats, reduction="mean")
    names = ["loss", "dpo_loss", "kl", "kl_k1", "margin_agreement", "kept_fraction"]
    batch.stats.update({n: float(v) for n, v in zip(names, stats.tolist())})
    batch.stats["grad_norm"] = grad_norm
    return batch.stats


def optimizer_step(learner: Learner) -> float:
    """Clip the gradients (when ``max_grad_norm`` > 0), step the optimizer and the schedule; the norm."""
    acc, model = learner.accelerator, learner.model
    grad_norm = float("nan")
    if learner.max_grad_norm > 0:
        # every parameter, not only the trainable ones: frozen ones have no gradient and add nothing, and
        # accelerate's FSDP clipping (the global norm over all shards) applies only to model.parameters()
        norm = acc.clip_grad_norm_(list(model.parameters()), learner.max_grad_norm)
        grad_norm = float("nan") if norm is None else float(norm)  # DeepSpeed clips inside its step
    learner.optimizer.step()
    learner.scheduler.step()
    learner.optimizer.zero_grad(set_to_none=True)
    return grad_norm


def grpo_update(learner: Learner, batch: PairBatch, kl_coef: float) -> dict[str, float]:
    """Step 5 under grpo: one optimizer step of the clipped GRPO surrogate on the advantages
    (:func:`judgeloop.loop.losses.grpo_loss`, token-averaged over the global batch as TRL's default
    ``loss_type="dapo"``) + kl_coef * KL(pi || pi_ref) (a mean over samples), chunked as the DPO update."""
    roll, adv, mask = batch.rollout, batch.advantages, batch.mask
    assert roll is not None and adv is not None and mask is not None, "grpo_update needs the advantages"
    acc = learner.accelerator
    B = len(roll.prompts)
    tokens = torch.tensor(float(num_completion_tokens(roll)), device=acc.device)
    normalizer = (acc.reduce(tokens, reduction="sum") / acc.num_processes).clamp(min=1.0)
    chunk = learner.chunk_size or B
    parts = [
        grpo_chunk_terms(learner, roll, adv, lo, min(lo + chunk, B), B, kl_coef, normalizer)
        for lo in range(0, B, chunk)
    ]
    grad_norm = optimizer_step(learner)
    totals = [torch.stack([p[i] for p in parts]).sum() for i in range(4)]
    rewards = batch.rewards
    assert rewards is not None
    n = mask.sum().clamp(min=1)
    r_mean = (rewards * mask).sum() / n
    extra = [r_mean, mask.mean(), (adv.abs() * mask).sum() / n]
    stats = acc.reduce(torch.stack([*totals, *[x.to(acc.device) for x in extra]]), reduction="mean")
    names = ["loss", "grpo_loss", "kl", "kl_k1", "reward_mean", "kept_fraction", "advantage_abs_mean"]
    batch.stats.update({n: float(v) for n, v in zip(names, stats.tolist())})
    batch.stats["grad_norm"] = grad_norm
    return batch.stats


def _chunk_loss(
    learner: Learner, roll: Rollout, targets: torch.Tensor, mask: torch.Tensor, lo: int, hi: int, B: int,
    kl_coef: float, weights: torch.Tensor | None = None,
) -> list[torch.Tensor]:  # fmt: skip
    """Forward and backward of articles ``lo:hi`` of the batch; returns their (detached) share of the
    loss, DPO term, KL, k1 KL and the number of kept pairs whose margin agrees with the target."""
    acc, model, loss_cfg = learner.accelerator, learner.model, learner.loss
    prompts = roll.prompts[lo:hi]
    comps = roll.a_ids[lo:hi] + roll.b_ids[lo:hi]  # a-samples then b-samples; each prompt run once for both
    n, device = hi - lo, acc.device
    with generation_context(model):
        ref_tok, _ = reference_logprobs(
            acc.unwrap_model(model), learner.ref, prompts, comps, learner.pad_id, 2
        )
    prefix = roll.prefix if n == B else None  # the rollout's prompt pass, when it was kept (one chunk)
    roll.prefix = None
    pol_tok, tok_mask = token_logprobs(model, prompts, comps, learner.pad_id, 2, prefix)  # (2n, T)
    seq_pol, seq_ref = pol_tok.sum(-1), ref_tok.sum(-1)  # (2n,)
    h = dpo_margin(seq_pol[:n], seq_pol[n:], seq_ref[:n], seq_ref[n:])  # (n,)
    t, m = targets[lo:hi].to(device), mask[lo:hi].to(device)
    w = m if weights is None else m * weights[lo:hi].to(device)
    dpo = soft_dpo_loss(h, t, loss_cfg.beta, w).sum() / B
    share = (lambda x: x.mean()) if n == B else (lambda x: x.sum() / (2 * B))  # noqa: E731 - one chunk: as ever
    kl = share(kl_per_sequence(pol_tok, ref_tok, tok_mask, loss_cfg.kl_estimator))
    loss = dpo + kl_coef * kl
    last = hi == B
    with contextlib.nullcontext() if last else acc.no_sync(model):  # DDP: one gradient all-reduce per step
        acc.backward(loss)
    with torch.no_grad():
        k1 = share(kl_per_sequence(pol_tok.detach(), ref_tok, tok_mask, "k1"))
        agree = (((h.detach() > 0).float() == (t >= 0.5).float()).float() * m).sum()
    return [loss.detach(), dpo.detach(), kl.detach(), k1, agree]


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
        picked = [calibration[i] for i in sorted(pick)]
        rows = _calibration_rows(
            accelerator,
            model,
            tokenizer,
            build_prompt,
            judge,
            (shard(picked, accelerator), len(real_part(picked, len(picked), accelerator))),
            cfg,
            derive_seed(cfg.seed, "calib", *tag),
        )
        all_rows = gather_object(rows)
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
            out.references.append(r["refs"])
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
    share: tuple[Sequence[SummExample], int],
    cfg: FeedbackLoopConfig,
    seed: int,
) -> list[dict[str, Any]]:
    """This process's labeled pairs for its share of the calibration articles, plus one counts row.
    ``share``: the padded shard and how many of its articles are real (the rest only keep the ranks'
    generate calls in step)."""
    mine, num_real = share
    if not mine:
        return []
    with generation_context(model):
        roll = rollout(
            accelerator.unwrap_model(model),
            tokenizer,
            build_prompt,
            [e.article for e in mine],
            cfg.generation,
            seed=seed,
            num_pairs=cfg.calibration.pairs_per_article,
        )
    k = cfg.calibration.pairs_per_article
    exs = [e for e in mine[:num_real] for _ in range(k)]  # article-major, as rollout returns them
    pairs = label_pairs(exs, roll.a_text[: len(exs)], roll.b_text[: len(exs)], judge)
    rows: list[dict[str, Any]] = [
        {"id": i, "article": a, "a": x, "b": y, "s": s, "y": lab, "refs": r}
        for i, a, x, y, s, lab, r in zip(
            pairs.article_ids, pairs.articles, pairs.a, pairs.b, pairs.scores, pairs.labels, pairs.references
        )
    ]
    rows.append({"ties": pairs.ties_dropped, "failures": pairs.judge_failures})
    return rows


def maybe_recalibrate(
    step: int, state: LoopState, calibrator: Calibrator, collect: Any, cfg: FeedbackLoopConfig,
    judge: Judge | None = None, reason: str | None = None,
) -> Calibrator:  # fmt: skip
    """Step 5: monitor ECE on fresh samples when due; refit on schedule or when ECE exceeds the threshold
    (or for ``reason``, a divergence alarm's). ``judge``: the training judge (a panel refits with it)."""
    pairs = None
    if monitor_due(step, cfg.calibration):
        pairs = collect(step)
        monitored = pair_ece(calibrator, pairs, cfg.calibration.num_bins)
        state.last_monitored_ece = monitored if math.isfinite(monitored) else None
    reason = reason or recalibration_reason(step, cfg.calibration, state.last_monitored_ece)
    if reason is None:
        return calibrator
    pairs = pairs if pairs is not None else collect(step)
    calibrator, record = refit(calibrator, pairs, cfg.calibration, step, reason, cfg.seed, judge=judge)
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
    rows = real_part(rows, len(ids), accelerator)
    pairs = merge_pairs(gather_object([shard_pairs(rows, {e.id: e for e in exs}, train_judge).as_dict()]))
    rows = gather_object(rows)
    state.per_article.extend(finite_or_none({"step": step, **r}) for r in rows)
    metrics = aggregate(rows, pairs, calibrator, cfg.calibration.num_bins)
    if splits.validation:
        vexs = shard(splits.validation, accelerator)
        if val_greedy is None:
            with eval_mode(unwrapped):
                val_greedy = greedy_summaries(unwrapped, tokenizer, build_prompt, vexs, gen, bs)
        n_val = len(splits.validation)
        val = gather_object(real_part(validation_metrics(vexs, val_greedy), n_val, accelerator))
        for key in ("rouge_l_neutral", "rouge_l_extractive", "copy_rate", "length"):
            vals = np.array([v[key] for v in val], dtype=float)
            metrics[f"val_{key}"] = float(np.nanmean(vals)) if np.isfinite(vals).any() else float("nan")
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


# --- set-up -------------------------------------------------------------------------------------


def make_optimizer(model: Any, cfg: FeedbackLoopConfig) -> tuple[Any, Any]:
    """AdamW over the trainable parameters, and transformers' warm-up + linear-decay (or constant) schedule.

    transformers' warm-up starts at factor 0 on step 0 (``step / warmup_steps``); with no warm-up both
    schedules are the ones the loop always used.
    """
    from transformers import get_constant_schedule_with_warmup, get_linear_schedule_with_warmup

    from judgeloop.optim import adamw

    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = adamw(params, lr=cfg.optim.learning_rate, weight_decay=cfg.optim.weight_decay)
    if cfg.optim.scheduler == "linear":
        return optimizer, get_linear_schedule_with_warmup(optimizer, cfg.optim.warmup_steps, cfg.max_steps)
    return optimizer, get_constant_schedule_with_warmup(optimizer, cfg.optim.warmup_steps)


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
    pairs = gather_object(pairs)
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
    if ccfg.method == "panel":  # judged by the panel, not by the judge the other arms share
        key["panel"] = dataclasses.asdict(ccfg.panel)
    return CalibrationPairs.from_dict(start.get("calibration_pairs", key, lambda: collect().as_dict()))


def check_models(cfg: FeedbackLoopConfig) -> None:
    """Every model the config names resolves, every device and tracker it asks for is there (before
    data or weights load); a ConfigError names the key."""
    from judgeloop.judges.tokens import resolve_device
    from judgeloop.models import check_model

    try:
        check_device(cfg.device, "device")
        resolve_device(cfg.judge.device)
        check_trackers(cfg.log_with)
        check_model(cfg.policy.model, "policy.model")
        panel = (
            members_models(cfg.calibration.panel, "calibration.panel")
            if cfg.calibration.method == "panel"
            else []
        )
        for key, name, device in models_of(cfg.judge) + panel:
            resolve_device(device)
            check_model(name, key)
    except ValueError as err:
        raise ConfigError(str(err)) from None


def train(cfg: FeedbackLoopConfig) -> dict[str, Any]:
    """Run the feedback loop described by ``cfg``; returns (and writes) the run report.

    Writes under ``cfg.output_dir``: ``config.yaml``, ``metrics.jsonl``, ``checkpoints/step_N``,
    ``report.json`` (final metrics of the kept policy, curves, refits, early-stopping decision) and
    ``policy/`` (the kept policy, its tokenizer and the final calibrator, when ``save_final_policy``).
    ``recipes/feedback_loop.py`` spells out these same lines.
    """
    with open_run(cfg) as run:  # checks, accelerator, data, models; then resume, or step 0
        with stepping(run) as steps:  # until max_steps, early stopping or stop_after_n_steps
            for step in steps:
                after_step(run, training_step(run, step))  # checkpoint and progress after each step
        return close_run(run)  # the kept policy, its final metrics, the report


@contextlib.contextmanager
def open_run(cfg: FeedbackLoopConfig) -> Iterator[LoopRun]:
    """A run ready for its first step: checked before any work (the output folder can be written, the
    models, devices and trackers the config names are there), then set up and resumed or started.
    The run's autocast spans the ``with`` block: bf16 (when mixed_precision=bf16) covers the reference
    pass, the judge and evaluation too, not only the prepared model's forward; master weights and
    optimizer state stay fp32."""
    out_dir = Path(cfg.output_dir)
    check_output_places(cfg)
    check_models(cfg)
    # the stop signals are caught from here on: one during set-up stops the run after step 0 or the resume
    with stop_signals(cfg.stop_signals) as stop, intra_op_threads(cfg.threads), _opened(cfg, out_dir) as run:
        run.stop = stop
        yield run


def resolve_resume(cfg: FeedbackLoopConfig, accelerator: Accelerator, out_dir: Path) -> FeedbackLoopConfig:
    """``resume_from: auto`` made concrete: the newest complete checkpoint under ``output_dir`` (after the
    main process has cleaned up a killed write, which may restore one), or null for a fresh start; the
    log says which. Any other value is returned as it is."""
    if cfg.resume_from != "auto":
        return cfg
    if accelerator.is_main_process:
        for orphan, what in remove_orphans(out_dir):
            logger.info("%s %s, left by a killed checkpoint write", what, orphan)
    accelerator.wait_for_everyone()
    found = latest_checkpoint(out_dir)
    if found is None:
        logger.info("resume_from=auto: no checkpoint under %s; starting fresh", out_dir / "checkpoints")
    else:
        logger.info("resume_from=auto: resuming from %s, the newest checkpoint", found)
    return dataclasses.replace(cfg, resume_from=None if found is None else str(found))


@contextlib.contextmanager
def _opened(cfg: FeedbackLoopConfig, out_dir: Path) -> Iterator[LoopRun]:
    accelerator = make_accelerator(cfg, out_dir)
    auto = cfg.resume_from == "auto"
    cfg = resolve_resume(cfg, accelerator, out_dir)
    # the data next: a split too small for the batch on these processes stops here, before any output
    splits = load_splits(cfg, accelerator.num_processes)
    check_calibration_budget(cfg.calibration, [e.id for e in splits.calibration], cfg.seed)
    with accelerator.autocast():
        prepare_output(cfg, accelerator, out_dir)
        run_name = cfg.run_name or f"{cfg.calibration.method}-seed{cfg.seed}"
        init_trackers(accelerator, cfg.project_name, run_name, cfg.run_group, to_dict(cfg))
        run = setup_run(cfg, accelerator, out_dir, splits)
        run.auto_resume = auto
        if cfg.resume_from:
            resume_run(run)
        else:
            start_run(run)
        yield run


def make_accelerator(cfg: FeedbackLoopConfig, out_dir: Path) -> Accelerator:
    """The run's ``Accelerator``.

    ``step_scheduler_with_optimizer=False``: accelerate's default steps a prepared scheduler once per
    *process* at every ``scheduler.step()``, for data loaders whose batches grow with the number of
    processes. The loop's schedule counts optimizer steps (``max_steps``), so under DDP / FSDP the
    default would run it ``num_processes`` times too fast (on 8 GPUs a warm-up of 20 would end at step 3).
    """
    device = accelerator_kwargs(on_cpu(cfg.device))  # DeepSpeed on a CPU: gloo (judgeloop.distributed)
    precision = mixed_precision_kwargs("bf16" if cfg.policy.dtype == "bfloat16" else cfg.mixed_precision)
    return Accelerator(
        cpu=device["cpu"],
        log_with=make_trackers(cfg.log_with, out_dir),
        project_dir=str(out_dir),
        step_scheduler_with_optimizer=False,
        **{**precision, "kwargs_handlers": precision["kwargs_handlers"] + device["kwargs_handlers"]},
    )


def mixed_precision_kwargs(mixed_precision: str) -> dict[str, Any]:
    """``Accelerator`` arguments for ``mixed_precision`` ("no" or "bf16").

    mixed_precision is passed only when asked for: accelerate refuses to re-set it once its
    process-wide state exists (e.g. a second run in the same process, as in the ablation); a launch
    file's ``mixed_precision`` applies otherwise.

    Under bf16 the autocast weight-cast cache is off. The loop runs in one autocast context, across
    optimizer steps, and autocast keeps its bf16 copy of a trainable weight until the outermost context
    exits: with the cache on, every forward after the first step would use the step-0 weights (the LoRA
    adapters or the full model, as first cast) while the optimizer updated the fp32 ones. Without it the
    trainable weights are cast at each use, as frozen weights always are.
    """
    from accelerate.utils import AutocastKwargs

    # the cache is off whatever turns bf16 on: this setting, or a launch file's mixed_precision: bf16
    handlers = {"kwargs_handlers": [AutocastKwargs(cache_enabled=False)]}
    return handlers if mixed_precision == "no" else {"mixed_precision": mixed_precision, **handlers}


# --- the run: set up, start or resume, the step loop, the report --------------------------------------


@dataclass
class LoopRun:
    """Everything one run holds, built by :func:`setup_run`; the step functions read from it."""

    cfg: FeedbackLoopConfig
    accelerator: Accelerator
    out_dir: Path
    splits: Splits
    tokenizer: Any
    build_prompt: PromptBuilder
    learner: Learner
    judge: Judge  # the configured judge (evaluation reports it)
    train_judge: Judge  # the judge whose preferences train the policy (the oracle in the oracle arm)
    kl_ctl: AdaptiveKLController
    start: StartWork
    state: LoopState
    calibrator: Calibrator
    prefetch: JudgePrefetch | None = None
    bar: Any = None  # the progress bar while stepping
    steps_this_run: int = 0
    interrupted: bool = False  # stopped at stop_after_n_steps (or by a stop signal) before max_steps
    stop: StopRequest | None = None  # set by a stop signal (cfg.stop_signals)
    stopped_by: int | None = None  # the signal the run stopped on
    saved_step: int | None = None  # the step of the last checkpoint this run wrote
    auto_resume: bool = False  # the config says resume_from: auto
    collected: tuple[int, CalibrationPairs] | None = None  # the last step's fresh calibration pairs

    @property
    def model(self) -> Any:
        return self.learner.model

    def collect(self, step: int) -> CalibrationPairs:
        """Fresh calibration pairs from the current policy (step 0: the starting policy); drawn once per
        step, so the ECE monitor, a refit and the divergence check of one step share them."""
        if self.collected is None or self.collected[0] != step:
            pairs = collect_calibration_pairs(
                self.accelerator, self.model, self.tokenizer, self.build_prompt, self.train_judge,
                self.splits.calibration, self.cfg, step,
            )  # fmt: skip
            self.collected = (step, pairs)
        return self.collected[1]

    def evaluate(self, step: int) -> dict[str, float]:
        """Test and validation metrics of the current policy at ``step``."""
        with generation_context(self.model):
            return run_evaluation(
                self.accelerator, self.model, self.learner.ref, self.tokenizer, self.build_prompt,
                self.splits, self.state, self.judge, self.train_judge, self.calibrator, self.cfg, step,
                self.start if step == 0 else None,
            )  # fmt: skip


def prepare_output(cfg: FeedbackLoopConfig, accelerator: Accelerator, out_dir: Path) -> None:
    """Before any work: check a resume against its checkpoint, clean up after a killed run (orphan
    checkpoint folders, log rows past the checkpoint), record the config that runs."""
    ckpt_step = (
        checked_resume(to_yaml(cfg), cfg.resume_from, RESUME_FREE_KEYS, default_dict(type(cfg)), type(cfg))
        if cfg.resume_from
        else None
    )
    if accelerator.is_main_process:
        for orphan, what in remove_orphans(out_dir):
            logger.info("%s %s, left by a killed checkpoint write", what, orphan)
        if ckpt_step is not None:
            dropped = truncate_jsonl_log(out_dir / "metrics.jsonl", ckpt_step)
            if dropped:
                logger.info(
                    "metrics.jsonl: dropped %d rows logged after the checkpoint's step %d", dropped, ckpt_step
                )
        atomic_write_text(out_dir / "config.yaml", to_yaml(cfg))


def setup_run(cfg: FeedbackLoopConfig, accelerator: Accelerator, out_dir: Path, splits: Splits) -> LoopRun:
    """Policy (after its SFT warm start), reference, judges, optimizer over ``splits``: a run at step 0."""
    torch.manual_seed(cfg.seed)
    np.random.seed(cfg.seed)
    tokenizer = load_tokenizer(cfg.policy.model)
    build_prompt = PromptBuilder(tokenizer, cfg.policy)
    sft = (
        [build_prompt(e.article) for e in splits.train],
        [e.neutral[0] if e.neutral else "" for e in splits.train],
    )
    fsdp = accelerator.distributed_type == DistributedType.FSDP
    # several processes: the main one warms the policy up, the others read its result (the same weights)
    many = accelerator.num_processes > 1 and cfg.policy.sft_steps > 0
    # whole under ZeRO-3 too: the warm-up trains it and the reference copies it before prepare partitions it
    with accelerator.main_process_first(), whole_models(accelerator):
        model, tokenizer, ref = load_policy(
            cfg.policy, cfg.seed, sft if cfg.policy.sft_steps else None, fsdp,
            out_dir / "sft_warm_start.pt" if many else None, accelerator.device.type == "cpu",
        )  # fmt: skip
    if ref is not None:
        ref = prepare_for_inference(ref.to(accelerator.device), accelerator)  # ZeRO-3: an inference engine
    # auto / cuda: this process's own GPU (one judge per process), the CPU in a CPU run
    judge = build_judge(dataclasses.replace(cfg.judge, device=process_device(cfg.judge.device, accelerator)))
    scorer = getattr(judge, "base", judge)  # a styled judge scores with its base judge's model
    if hasattr(scorer, "model"):
        scorer.model = prepare_for_inference(scorer.model, accelerator)
    train_judge = build_training_judge(
        cfg.calibration, judge, cfg.judge.name or cfg.judge.type, process_device("auto", accelerator)
    )
    optimizer, scheduler = make_optimizer(model, cfg)
    configure_deepspeed(accelerator, cfg.batch_size, cfg.optim.max_grad_norm, "optim.max_grad_norm")
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    save_only_trainable(accelerator, trainable_state, load_trainable_state)  # LoRA: adapters, not the base
    learner = Learner(
        accelerator,
        model,
        ref,
        optimizer,
        scheduler,
        cfg.loss,
        cfg.optim.max_grad_norm,
        tokenizer.pad_token_id,
        cfg.optim.update_chunk_size,
        shares_prompt_pass(cfg, accelerator, model),
    )
    kl_ctl = AdaptiveKLController(
        cfg.loss.kl_coef, cfg.loss.kl_adaptive, cfg.loss.kl_target, cfg.loss.kl_horizon
    )
    start = StartWork(cfg, accelerator, model, ref, tokenizer, build_prompt, splits.test[0].article)
    return LoopRun(
        cfg, accelerator, out_dir, splits, tokenizer, build_prompt, learner, judge, train_judge, kl_ctl, start,
        LoopState(kl_coef=kl_ctl.coef), build_calibrator(cfg.calibration),
    )  # fmt: skip


def shares_prompt_pass(cfg: FeedbackLoopConfig, accelerator: Accelerator, model: Any) -> bool:
    """``optim.share_prompt_pass`` where the rollout's prompt pass computes what the update's would: no
    active dropout, one precision for both (generation leaves the run's bf16 autocast, which
    ``mixed_precision: bf16`` or a bf16 frozen base turns on, unless ``generation.autocast``), and
    parameters not sharded (ZeRO-3 / FSDP gather them for the rollout only)."""
    if not cfg.optim.share_prompt_pass:
        return False
    sharded = accelerator.distributed_type in (DistributedType.DEEPSPEED, DistributedType.FSDP)
    same_precision = str(accelerator.mixed_precision) == "no" or cfg.generation.autocast
    ok = not sharded and same_precision and prefix_reusable(accelerator.unwrap_model(model))
    if not ok:
        logger.info(
            "optim.share_prompt_pass: the update runs the prompts itself (dropout, precision or sharding)"
        )
    return ok


def resume_run(run: LoopRun) -> None:
    """Restore policy, optimizer, schedule, RNG, calibrator, loop state and the run-long counters."""
    cfg = run.cfg
    assert cfg.resume_from is not None
    cal_state, saved = load_checkpoint(run.accelerator, cfg.resume_from)
    run.state = LoopState(**saved)
    run.calibrator = calibrator_from_state(cal_state)
    if run.state.judge_state is not None:
        run.train_judge.load_state_dict(run.state.judge_state)
    run.kl_ctl.coef = run.state.kl_coef
    run.train_judge.stats.status.update(run.state.judge_status)
    run.train_judge.stats.cache_hits += run.state.judge_cache_hits
    run.build_prompt.truncated.update(run.state.truncated_articles)
    logger.info("resumed from %s at step %d", cfg.resume_from, run.state.step)
    now = run_numerics(run)
    changed = numerics_differences(run.state.numerics[-1] if run.state.numerics else None, now)
    if changed:
        logger.warning(
            "resumed with other numerics than the checkpoint was made with (%s): results will differ from "
            "an uninterrupted run by float rounding",
            "; ".join(changed),
        )
    run.state.numerics.append({"from_step": run.state.step, **now})


def run_numerics(run: LoopRun) -> dict[str, Any]:
    """This run's thread count, kernels and precision path (:func:`judgeloop.devices.numerics`)."""
    acc = run.accelerator
    return numerics(acc.device.type, "bf16" if acc.mixed_precision == "bf16" else "fp32")


def start_run(run: LoopRun) -> None:
    """Step 0: reference summaries, the judge's coupling and the first calibrator fit on samples of the
    starting policy, and the step-0 evaluation."""
    cfg, state = run.cfg, run.state
    state.numerics = [{"from_step": 0, **run_numerics(run)}]
    with generation_context(run.model):
        state.ref_summaries = reference_summaries(
            run.accelerator, run.model, run.learner.ref, run.tokenizer, run.build_prompt, run.splits.test,
            cfg, run.start,
        )  # fmt: skip
    if (
        cfg.calibration.method != "oracle"
    ):  # samples of the initial policy: the judge's coupling, the first fit
        pairs = initial_calibration_pairs(run.start, cfg, run.splits, lambda: run.collect(0))
        state.coupling.append(finite_or_none({"step": 0, **judge_coupling(pairs)}))
        line = coupling_line(state.coupling[-1])
        (logger.warning if line.startswith("WARNING") else logger.info)("step 0: %s", line)
    if needs_fit(cfg.calibration):  # the first fit
        run.calibrator, record = refit(
            run.calibrator,
            pairs,
            cfg.calibration,
            0,
            "initial",
            cfg.seed,
            first_fit=True,
            judge=run.train_judge,
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
        metrics = run.evaluate(0)
        state.history.append(metrics)
        early_stopping(metrics, state, cfg, run.accelerator, run.model)
        run.accelerator.log({f"eval/{k}": v for k, v in metrics.items()}, step=0)


def training_step(run: LoopRun, step: int) -> PairBatch:
    """One step of the loop: rollout -> judge -> calibrate -> make_pairs -> update -> maybe_recalibrate,
    then the scheduled evaluation and the early-stopping check."""
    cfg, state, acc = run.cfg, run.state, run.accelerator
    assert run.prefetch is not None
    batch = PairBatch(step, next_batch(state, run.splits.train, cfg, acc))
    with generation_context(run.model):
        rollout_step(
            acc.unwrap_model(run.model), run.tokenizer, run.build_prompt, batch, cfg, acc.process_index,
            run.learner.reuses_prompt_pass(len(batch.examples)),
        )  # fmt: skip
    run.prefetch.wait()
    grpo = cfg.loss.type == "grpo"
    if grpo:  # the judge and the calibrator inside each group, in one call
        judge_groups_step(run.train_judge, run.calibrator, cfg, batch)
    else:
        judge_step(run.train_judge, batch)
    if step < cfg.max_steps:  # the next batch's article-side judge work runs during this update
        run.prefetch.start(peek_batch(state, run.splits.train, cfg, acc))
    if grpo:
        make_advantages(batch, cfg.loss, state.judge_weight)
    else:
        calibrate_step(run.calibrator, batch)
        make_pairs(batch, cfg.loss, state.judge_weight)
    stats = policy_update(run.learner, batch, run.kl_ctl.coef)
    stats.update(
        kl_coef=run.kl_ctl.coef, **judged_stats(batch), lr=float(run.learner.scheduler.get_last_lr()[0])
    )
    run.kl_ctl.update(stats["kl"])
    state.kl_coef = run.kl_ctl.coef
    state.step = step
    state.train_log.append(finite_or_none({"step": step, **stats}))
    acc.log({f"train/{k}": v for k, v in stats.items()}, step=step)
    run.calibrator = maybe_recalibrate(step, state, run.calibrator, run.collect, cfg, run.train_judge)
    watch_divergence(run, step)
    if cfg.eval_every_n_steps and step % cfg.eval_every_n_steps == 0:
        metrics = run.evaluate(step)
        state.history.append(metrics)
        acc.log({f"eval/{k}": v for k, v in metrics.items()}, step=step)
        if early_stopping(metrics, state, cfg, acc, run.model):
            state.stopped_early = True
            logger.info(
                "early stopping at step %d: validation ROUGE-L has not improved for %d evaluations "
                "(best %.4f at step %d)",
                step, cfg.early_stopping_patience, state.best_val, state.best_step,
            )  # fmt: skip
    return batch


def judged_stats(batch: PairBatch) -> dict[str, float]:
    """The step's mean calibrated p and its failed judgements (pairs, or a group's comparisons)."""
    if batch.advantages is not None:  # grpo: the GroupScores
        return {"p_mean": batch.judged.mean_p, "judge_failures": float(sum(batch.judged.failed))}
    p = batch.p
    assert p is not None
    return {
        "p_mean": float(np.nanmean(p)) if np.isfinite(p).any() else float("nan"),
        "judge_failures": float((~batch.judged.valid).sum()),
    }


def watch_divergence(run: LoopRun, step: int) -> None:
    """Step 6: when due, the divergence check (:mod:`judgeloop.loop.alarms`) on this step's fresh
    calibration pairs; an alarm is logged and acted on as ``alarms.action`` says."""
    cfg, state = run.cfg, run.state
    if not (cfg.alarms.enabled and step % cfg.alarms.every_n_steps == 0):
        return
    pairs = run.collect(step)
    metrics, fired = check_divergence(
        step, state.alarm_checks, run.train_judge, run.calibrator, pairs, cfg.alarms
    )
    run.accelerator.log({f"alarm/{k}": v for k, v in metrics.items()}, step=step)
    if not fired:
        return
    state.alarms.extend(finite_or_none(a) for a in fired)
    for a in fired:
        logger.warning(
            "step %d: divergence alarm: %s agreement %.3f (95%% CI [%.3f, %.3f], %d pairs) < %.3f; action: %s",
            step, a["channel"], a["agreement"], a["ci95"][0], a["ci95"][1], a["n"], a["threshold"], a["action"],
        )  # fmt: skip
    action = cfg.alarms.action
    if action == "refit" and needs_fit(cfg.calibration):
        run.calibrator = maybe_recalibrate(
            step, state, run.calibrator, run.collect, cfg, run.train_judge, reason="alarm"
        )
    elif action == "downweight":
        state.judge_weight *= cfg.alarms.downweight_factor
    elif action == "stop":
        state.stopped_early, state.stop_reason = True, f"divergence alarm at step {step}"


def save_run(run: LoopRun, step: int) -> None:
    """A checkpoint of everything the run needs to continue exactly (every process takes part)."""
    state = run.state
    state.judge_status = dict(run.train_judge.stats.status)
    state.judge_cache_hits = run.train_judge.stats.cache_hits
    state.truncated_articles = sorted(run.build_prompt.truncated)
    state.judge_state = run.train_judge.state_dict() if run.train_judge.learns_from_labels else None
    save_checkpoint(
        run.accelerator,
        run.out_dir / "checkpoints" / f"step_{step}",
        run.calibrator.state_dict(),
        state.as_dict(),
        to_yaml(run.cfg),
    )
    if run.accelerator.is_main_process:
        prune_checkpoints(run.out_dir / "checkpoints", run.cfg.keep_checkpoints)
    run.saved_step = step


@contextlib.contextmanager
def stepping(run: LoopRun) -> Iterator[Iterator[int]]:
    """The step numbers still to run, while the judge's prefetch thread and the progress bar live (both
    closed on leaving, also on an error or an interruption: no prefetch thread outlives the run)."""
    cfg, state = run.cfg, run.state
    run.bar = None
    if cfg.progress_bar and run.accelerator.is_local_main_process:
        from tqdm.auto import tqdm

        run.bar = tqdm(
            total=cfg.max_steps, initial=state.step, desc=f"feedback loop [{cfg.calibration.method}]"
        )
    run.steps_this_run, run.interrupted = 0, False
    run.prefetch = JudgePrefetch(run.train_judge, cfg.judge_prefetch, cfg.judge_prefetch_threads)

    def numbers() -> Iterator[int]:
        while state.step < cfg.max_steps and not state.stopped_early and not run.interrupted:
            if stop_requested(run):
                return
            yield state.step + 1

    try:
        if state.step < cfg.max_steps:  # overlaps the first rollout
            run.prefetch.start(peek_batch(state, run.splits.train, cfg, run.accelerator))
        yield numbers()
    finally:
        run.prefetch.close()
        if run.bar is not None:
            run.bar.close()


def stop_requested(run: LoopRun) -> bool:
    """Between two steps: when a stop signal came (on any process), write the checkpoint of the state
    after the step that finished (unless it was just written) and mark the run interrupted."""
    signum = None if run.stop is None else run.stop.agreed(run.accelerator)
    if signum is None:
        return False
    if run.saved_step != run.state.step:
        save_run(run, run.state.step)
    run.stopped_by, run.interrupted = signum, True
    return True


def after_step(run: LoopRun, batch: PairBatch) -> None:
    """The scheduled checkpoint (and one at ``stop_after_n_steps``, which interrupts the run: it
    continues from that checkpoint), the progress bar."""
    cfg = run.cfg
    run.steps_this_run += 1
    stop = cfg.stop_after_n_steps is not None and run.steps_this_run >= cfg.stop_after_n_steps
    if (cfg.save_every_n_steps and batch.step % cfg.save_every_n_steps == 0) or stop:
        save_run(run, batch.step)
    if run.bar is not None:
        run.bar.update(1)
        run.bar.set_postfix(loss=f"{batch.stats['loss']:.3f}", kl=f"{batch.stats['kl']:.3f}")
    run.interrupted = stop and run.state.step < cfg.max_steps


def close_run(run: LoopRun) -> dict[str, Any]:
    """The end of a run: the report (:func:`finish_run`), or, when it was interrupted, where its
    checkpoint is; the trackers are closed either way."""
    if run.interrupted:
        run.accelerator.end_training()
        step = run.state.step
        ckpt = run.out_dir / "checkpoints" / f"step_{step}"
        if run.stopped_by is not None:
            how = (
                "run the same command again to continue from it (resume_from=auto)"
                if run.auto_resume
                else f"continue with resume_from={ckpt}"
            )
            raise Stopped(run.stopped_by, step, str(ckpt), how)
        return {
            "interrupted": True,
            "step": step,
            "checkpoint": str(ckpt),
        }
    report = finish_run(run)
    run.accelerator.end_training()
    return report


def finish_run(run: LoopRun) -> dict[str, Any]:
    """The kept policy (best validation checkpoint under early stopping, else the last), its final
    metrics, the report; the main process writes ``report.json``, ``per_article.jsonl``, ``policy/``."""
    cfg, state, acc, out_dir = run.cfg, run.state, run.accelerator, run.out_dir
    kept_step, why = state.step, "last step (early stopping off)"
    if cfg.early_stopping_patience or state.stop_reason:
        kept_step = state.best_step
        why = f"best validation ROUGE-L {state.best_val:.4f}; " + (
            (state.stop_reason or "stopped early") if state.stopped_early else "ran all steps"
        )
        if kept_step != state.step:
            acc.wait_for_everyone()
            load_policy_weights(out_dir / "best_policy", acc, run.model)
    final = next((h for h in state.history if h["step"] == kept_step), None)
    if final is None:
        final = run.evaluate(state.step)
        final["step"] = kept_step
        state.history.append(final)
    judge_stats = run.train_judge.stats
    report = {
        "arm": cfg.calibration.method,
        "seed": cfg.seed,
        "steps_run": state.step,
        "kept_step": kept_step,
        "kept_reason": why,
        "stopped_early": state.stopped_early,
        "stop_reason": state.stop_reason,
        "alarms": state.alarms,
        "alarm_checks": state.alarm_checks,
        "judge_weight": state.judge_weight,
        "panel": run.train_judge.state_dict() if run.train_judge.learns_from_labels else None,
        "final": final,
        "history": state.history,
        "train_log": state.train_log,
        "refits": state.refits,
        "judge_coupling": state.coupling,
        "num_refits": sum(1 for r in state.refits if r["refit"] and r["reason"] != "initial"),
        "judge_stats": {"status": dict(judge_stats.status), "cache_hits": judge_stats.cache_hits},
        "prompts_truncated": run.build_prompt.num_truncated,
        "per_article": "per_article.jsonl",
        "numerics": state.numerics,
        "start_cache": None
        if run.start.cache is None
        else {"hits": run.start.cache.hits, "misses": run.start.cache.misses},
    }
    if cfg.save_final_policy:  # every process: under FSDP / ZeRO-3 the weights are gathered
        export_policy(out_dir / "policy", acc, run.model, run.tokenizer, run.calibrator.state_dict())
    if acc.is_main_process:
        save_calibrated_judge(run)
        atomic_write_jsonl(out_dir / "per_article.jsonl", state.per_article)
        atomic_write_json(out_dir / "report.json", report)
    return report


def save_calibrated_judge(run: LoopRun) -> None:
    """The run's final calibrator with the configured judge, as a folder
    ``CalibratedJudge.from_pretrained`` loads (``OUTPUT_DIR/calibrated_judge``): what the last fit was fit
    on and its held-out ECE. Not for the oracle arm (it trains against ROUGE, not the judge) nor a panel
    (its members' calibrators live in the report)."""
    from judgeloop.judges.calibrated import CalibratedJudge

    cfg, state = run.cfg, run.state
    if cfg.calibration.method in ("oracle", "panel") or cfg.judge.type == "panel":
        return
    taken = [r for r in state.refits if r.get("refit")]
    last = taken[-1] if taken else None
    card = {
        "fit": {
            "split": "calibration",
            "pairs": last["n_fit"] if last else 0,
            "step": last["step"] if last else None,
            "label_type": cfg.calibration.labels,
            "data_format": cfg.data.format,
            "data_path": cfg.data.path,
            "seed": cfg.seed,
            "source": "feedback loop",
        },
        "held_out": {"split": "calibration (held out)", "ece": last["ece_after"]} if last else {},
    }
    CalibratedJudge(cfg.judge, run.calibrator, card, judge=run.judge).save_pretrained(
        run.out_dir / "calibrated_judge"
    )
