"""Set-up of one run of the loop: checks before any work, the accelerator, the output folder (opened,
cleaned and resumed by :mod:`judgeloop.loop.run_state_files`), the data, the policy
(:mod:`judgeloop.loop.policy`) and the judges, the generation backend, then step 0 (:func:`start_run`:
reference summaries, the judge's coupling, the first calibrator fit, the step-0 evaluation) or a resume
(:func:`resume_run`); the scheduled evaluation and curve point (:func:`evaluate_when_due`,
:func:`curve_when_due`), which step 0 and every step run.

:func:`open_run` is the ``with`` block that holds a run; :class:`LoopRun` is what it holds. Only the run's
own rooms (this module, :mod:`judgeloop.loop.run`, :mod:`judgeloop.loop.alarms`) take a ``LoopRun``; they
hand the steps and the evaluation its parts.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType

from judgeloop.calibration import Calibrator, calibrator_from_state
from judgeloop.calibration.coupling import coupling_line
from judgeloop.checkpointing import save_only_trainable
from judgeloop.config import ConfigError, check_output_places, to_dict
from judgeloop.devices import (
    check_device,
    intra_op_threads,
    numerics,
    numerics_differences,
    on_cpu,
    process_device,
    resolve_device,
)
from judgeloop.distributed import (
    accelerator_kwargs,
    check_launch,
    configure_deepspeed,
    is_zero3,
    load_trainable_state,
    new_accelerator,
    prepare_for_inference,
    trainable_state,
    whole_models,
)
from judgeloop.io import finite_or_none
from judgeloop.judges import Judge, build_judge, members_models, models_of
from judgeloop.logging import get_logger
from judgeloop.loop.arms import arm
from judgeloop.loop.config import FeedbackLoopConfig
from judgeloop.loop.curve import curve_articles, curve_due, curve_log, curve_rows, record_curve_point
from judgeloop.loop.evaluation import (
    early_stopping,
    reference_summaries,
    run_evaluation,
)
from judgeloop.loop.losses import (
    AdaptiveKLController,
)
from judgeloop.loop.pairs import (
    CalibrationPairs,
    collect_calibration_pairs,
    initial_calibration_pairs,
    judge_coupling,
)
from judgeloop.loop.policy import Policy, generation_backend, load_policy
from judgeloop.loop.prefetch import JudgePrefetch
from judgeloop.loop.recalibration import (
    build_calibrator,
    build_training_judge,
    check_calibration_budget,
    needs_fit,
    refit,
)
from judgeloop.loop.rollout import PromptBuilder, prefix_reusable
from judgeloop.loop.run_state_files import (
    checked_resume_step,
    load_checkpoint,
    open_output,
    prepare_output,
    resolve_resume,
)
from judgeloop.loop.start_cache import StartWork
from judgeloop.loop.state import LoopState, Splits, load_splits
from judgeloop.loop.steps import Learner
from judgeloop.loop.vllm_backend import check_backend
from judgeloop.models import load_tokenizer
from judgeloop.signals import StopRequest, stop_signals
from judgeloop.tracking import check_trackers, init_trackers, make_trackers

logger = get_logger(__name__)


def check_models(cfg: FeedbackLoopConfig) -> None:
    """Every model the config names resolves, every device and tracker it asks for is there (before
    data or weights load); a ConfigError names the key."""
    from judgeloop.models import check_model

    try:
        check_device(cfg.device, "device")
        resolve_device(cfg.judge.device, "judge.device")
        check_trackers(cfg.log_with)
        check_model(cfg.policy.model, "policy.model")
        check_backend(cfg)  # generation.backend=vllm: its python found, or its server answers
        panel = (
            members_models(cfg.calibration.panel, "calibration.panel")
            if arm(cfg.calibration.method).judge == "panel"
            else []
        )
        for key, name, device in models_of(cfg.judge) + panel:
            resolve_device(device, "judge.device")
            check_model(name, key)
    except ValueError as err:
        raise ConfigError(str(err)) from None


def make_accelerator(cfg: FeedbackLoopConfig, out_dir: Path) -> Accelerator:
    """The run's ``Accelerator``.

    ``step_scheduler_with_optimizer=False``: accelerate's default steps a prepared scheduler once per
    *process* at every ``scheduler.step()``, for data loaders whose batches grow with the number of
    processes. The loop's schedule counts optimizer steps (``max_steps``), so under DDP / FSDP the
    default would run it ``num_processes`` times too fast (on 8 GPUs a warm-up of 20 would end at step 3).
    """
    device = accelerator_kwargs(on_cpu(cfg.device))  # DeepSpeed on a CPU: gloo (judgeloop.distributed)
    precision = mixed_precision_kwargs("bf16" if cfg.policy.dtype == "bfloat16" else cfg.mixed_precision)
    return new_accelerator(
        cpu=device["cpu"],
        log_with=make_trackers(cfg.log_with, out_dir),
        project_dir=str(out_dir),
        step_scheduler_with_optimizer=False,
        **{**precision, "kwargs_handlers": precision["kwargs_handlers"] + device["kwargs_handlers"]},
    )


def mixed_precision_kwargs(mixed_precision: str) -> dict[str, Any]:
    """``Accelerator`` arguments for ``mixed_precision`` ("no" or "bf16").

    mixed_precision is passed only when asked for, so a launch file's ``mixed_precision`` applies
    otherwise (``new_accelerator`` resets what an earlier run in the process set).

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


def make_optimizer(model: Any, cfg: FeedbackLoopConfig) -> tuple[Any, Any]:
    """AdamW over the trainable parameters, and transformers' warm-up + linear-decay (or constant) schedule.

    transformers' warm-up starts at factor 0 on step 0 (``step / warmup_steps``); with no warm-up both
    schedules are the ones the loop always used.
    """
    from transformers import get_constant_schedule_with_warmup, get_linear_schedule_with_warmup

    from judgeloop.optim import adamw

    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = adamw(params, lr=cfg.optim.learning_rate, weight_decay=cfg.optim.weight_decay)
    if cfg.optim.scheduler == "linear":  # over the optimizer steps (under mode=rounds, several per round)
        return optimizer, get_linear_schedule_with_warmup(
            optimizer, cfg.optim.warmup_steps, cfg.optimizer_steps
        )
    return optimizer, get_constant_schedule_with_warmup(optimizer, cfg.optim.warmup_steps)


@contextlib.contextmanager
def open_run(cfg: FeedbackLoopConfig) -> Iterator[LoopRun]:
    """A run ready for its first step: checked before any work (the output folder can be written, the
    models, devices and trackers the config names are there), then set up and resumed or started.
    The run's autocast spans the ``with`` block: bf16 (when mixed_precision=bf16) covers the reference
    pass, the judge and evaluation too, not only the prepared model's forward; master weights and
    optimizer state stay fp32."""
    out_dir = Path(cfg.output_dir)
    check_output_places(cfg)
    # accelerate launch's settings
    check_launch(cfg.batch_size, "batch_size", cfg.optim.max_grad_norm, "optim.max_grad_norm")
    check_models(cfg)
    warn_hard_monotone(cfg)
    # a checkpoint that resume_from names is checked before the folder: the error names the keys that differ
    ckpt_step = checked_resume_step(cfg)
    # the stop signals are caught from here on: one during set-up stops the run after step 0 or the resume
    with (
        open_output(cfg, out_dir),
        stop_signals(cfg.stop_signals) as stop,
        intra_op_threads(cfg.threads),
        _opened(cfg, out_dir, ckpt_step) as run,
    ):
        run.stop = stop
        yield run


def warn_hard_monotone(cfg: FeedbackLoopConfig) -> None:
    """Say so when hard targets meet a monotone calibrator: an antisymmetric map that keeps the judge's
    order gives p >= 0.5 exactly where the raw logit is >= 0, so the run trains raw's labels."""
    spec = arm(cfg.calibration.method)
    if cfg.loss.type == "dpo" and cfg.loss.target == "hard" and spec.fits and not spec.reorders:
        logger.warning(
            "loss.target=hard with calibration.method=%s trains raw's labels: a monotone calibrator keeps the "
            "judge's order, so p >= 0.5 exactly where the raw logit is >= 0; use soft targets, or an arm that "
            "reorders (feature_platt, feature_platt_cw, style_residual, bias_curve)",
            spec.name,
        )


@contextlib.contextmanager
def _opened(cfg: FeedbackLoopConfig, out_dir: Path, ckpt_step: int | None) -> Iterator[LoopRun]:
    accelerator = make_accelerator(cfg, out_dir)
    auto = cfg.resume_from == "auto"
    cfg = resolve_resume(cfg, accelerator, out_dir)  # after a killed checkpoint write, cleaned up once
    if auto:  # the checkpoint it found, checked once as one named by resume_from is
        ckpt_step = checked_resume_step(cfg)
    # the data next: a split too small for the batch on these processes stops here, before any output
    splits = load_splits(cfg, accelerator.num_processes)
    check_calibration_budget(cfg.calibration, [e.id for e in splits.calibration], cfg.seed)
    with accelerator.autocast():
        prepare_output(cfg, accelerator, out_dir, ckpt_step)
        run_name = cfg.run_name or f"{cfg.calibration.method}-seed{cfg.seed}"
        init_trackers(accelerator, cfg.project_name, run_name, cfg.run_group, to_dict(cfg))
        run = setup_run(cfg, accelerator, out_dir, splits)
        run.auto_resume = auto
        # where the policy generates; under vllm its engine is started here and ended with the run
        with generation_backend(cfg, run.policy, out_dir, run.learner.optimizer) as backend:
            run.policy.backend = backend
            if cfg.resume_from:
                resume_run(run)
            else:
                start_run(run)
            yield run


@dataclass
class LoopRun:
    """Everything one run holds, built by :func:`setup_run`; the recipe hands its parts to the steps."""

    cfg: FeedbackLoopConfig
    accelerator: Accelerator
    out_dir: Path
    splits: Splits
    # the policy: its model, reference, tokenizer, prompts and where it generates (policy.backend: hf, or
    # the vLLM engine of generation.backend, set by open_run)
    policy: Policy
    learner: Learner
    judge: Judge  # the configured judge (evaluation reports it)
    train_judge: Judge  # the judge whose preferences train the policy (the oracle in the oracle arm)
    kl_ctl: AdaptiveKLController
    start: StartWork
    state: LoopState
    calibrator: Calibrator
    prefetch: JudgePrefetch | None = None
    prefetch_judge: bool = True  # judge_prefetch may run: no collective in the judge's forward (ZeRO-3)
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
        """The prepared policy model (the one the optimizer steps)."""
        return self.policy.model

    def collect(self, step: int) -> CalibrationPairs:
        """Fresh calibration pairs from the current policy (step 0: the starting policy); drawn once per
        step, so the ECE monitor, a refit and the divergence check of one step share them."""
        if self.collected is None or self.collected[0] != step:
            pairs = collect_calibration_pairs(
                self.policy, self.train_judge, self.splits.calibration, self.cfg, step
            )
            self.collected = (step, pairs)
        return self.collected[1]

    def curve(self, step: int) -> dict[str, Any]:
        """The validation curve's point at ``step`` (:mod:`judgeloop.loop.curve`), into the state and
        the trackers."""
        with self.policy.generating():
            rows = curve_rows(self.policy, curve_articles(self.splits.validation, self.cfg), self.cfg, step)
        point = record_curve_point(self.state, rows, step, self.cfg.seed)
        self.accelerator.log({f"curve/{k}": v for k, v in curve_log(point).items()}, step=step)
        return point

    def evaluate(self, step: int) -> dict[str, float]:
        """Test and validation metrics of the current policy at ``step``."""
        with self.policy.generating():
            return run_evaluation(
                self.policy,
                self.splits,
                self.state,
                self.judge,
                self.train_judge,
                self.calibrator,
                self.cfg,
                step,
                self.start if step == 0 else None,
            )


def evaluate_when_due(run: LoopRun, step: int) -> None:
    """Every ``eval_every_n_steps``: the test and validation metrics of the current policy (into the
    history and the trackers), and the early-stopping check on validation ROUGE-L."""
    cfg, state, acc = run.cfg, run.state, run.accelerator
    if not (cfg.eval_every_n_steps and step % cfg.eval_every_n_steps == 0):
        return
    metrics = run.evaluate(step)
    state.history.append(metrics)
    acc.log({f"eval/{k}": v for k, v in metrics.items()}, step=step)
    if early_stopping(metrics, state, cfg, acc, run.model):
        state.stopped_early = True
        logger.info(
            "early stopping at step %d: validation ROUGE-L has not improved for %d evaluations "
            "(best %.4f at step %d)",
            step,
            cfg.early_stopping_patience,
            state.best_val,
            state.best_step,
        )


def curve_when_due(run: LoopRun, step: int) -> None:
    """Every ``curve.every_n_steps`` (and at the last step): the validation curve's point."""
    if curve_due(run.cfg, step):
        run.curve(step)


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
            cfg.policy,
            cfg.seed,
            sft if cfg.policy.sft_steps else None,
            fsdp,
            out_dir / "sft_warm_start.pt" if many else None,
            accelerator.device.type == "cpu",
        )
    if ref is not None:
        ref = prepare_for_inference(ref.to(accelerator.device), accelerator)  # ZeRO-3: an inference engine
    # auto / cuda: this process's own GPU (one judge per process), the CPU in a CPU run
    judge = build_judge(dataclasses.replace(cfg.judge, device=process_device(cfg.judge.device, accelerator)))
    scorer = getattr(judge, "base", judge)  # a styled judge scores with its base judge's model
    if hasattr(scorer, "model"):
        scorer.model = prepare_for_inference(scorer.model, accelerator)
    # a judge partitioned by ZeRO-3 gathers its weights at every forward, a collective: on the prefetch
    # thread it would interleave with the policy's (generate syncs the ranks) in another order on each rank
    sharded_judge = hasattr(scorer, "model") and is_zero3(scorer.model)
    if sharded_judge and cfg.judge_prefetch:
        logger.info("judge_prefetch is off: the judge is partitioned by ZeRO-3 (its forward is a collective)")
    train_judge = build_training_judge(
        cfg.calibration, judge, cfg.judge.name or cfg.judge.type, process_device("auto", accelerator)
    )
    optimizer, scheduler = make_optimizer(model, cfg)
    configure_deepspeed(accelerator, cfg.batch_size, cfg.optim.max_grad_norm, "optim.max_grad_norm")
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    save_only_trainable(accelerator, trainable_state, load_trainable_state)  # LoRA: adapters, not the base
    policy = Policy(accelerator, model, ref, tokenizer, build_prompt)
    learner = Learner(
        policy,
        optimizer,
        scheduler,
        cfg.loss,
        cfg.optim.max_grad_norm,
        cfg.optim.update_chunk_size,
        shares_prompt_pass(cfg, accelerator, model),
        # mode=rounds: the round's pairs in minibatches of batch_size, dpo_epochs passes
        cfg.batch_size if cfg.mode == "rounds" else None,
        cfg.rounds.dpo_epochs,
        cfg.seed,
    )
    kl_ctl = AdaptiveKLController(
        cfg.loss.kl_coef, cfg.loss.kl_adaptive, cfg.loss.kl_target, cfg.loss.kl_horizon
    )
    start = StartWork(cfg, policy, splits.test[0].article)
    return LoopRun(
        cfg,
        accelerator,
        out_dir,
        splits,
        policy,
        learner,
        judge,
        train_judge,
        kl_ctl,
        start,
        LoopState(kl_coef=kl_ctl.coef),
        build_calibrator(cfg.calibration),
        prefetch_judge=not sharded_judge,
    )


def shares_prompt_pass(cfg: FeedbackLoopConfig, accelerator: Accelerator, model: Any) -> bool:
    """``optim.share_prompt_pass`` where the rollout's prompt pass computes what the update's would: no
    active dropout, one precision for both (generation leaves the run's bf16 autocast, which
    ``mixed_precision: bf16`` or a bf16 frozen base turns on, unless ``generation.autocast``), and
    parameters not sharded (ZeRO-3 / FSDP gather them for the rollout only)."""
    if not cfg.optim.share_prompt_pass:
        return False
    if cfg.mode == "rounds":  # the round's update runs on minibatches of its pairs, long after the rollout
        return False
    if cfg.generation.backend == "vllm":
        logger.info(
            "optim.share_prompt_pass is off: generation.backend=vllm samples outside the training model"
        )
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
    run.policy.build_prompt.truncated.update(run.state.truncated_articles)
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
    with run.policy.generating():
        state.ref_summaries = reference_summaries(run.policy, run.splits.test, cfg, run.start)
    if (
        arm(cfg.calibration.method).judge != "oracle"
    ):  # samples of the initial policy: coupling, the first fit
        pairs = initial_calibration_pairs(run.start, cfg, run.splits.calibration, lambda: run.collect(0))
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
    curve_when_due(run, 0)
    evaluate_when_due(run, 0)
