"""The run around the steps: the step numbers still to run (:func:`stepping`, with the judge's prefetch
thread and the progress bar), the run's record of each step (:func:`record_update`), stop signals between
steps, the scheduled checkpoint (:func:`after_step`), and the end (:func:`close_run`: the kept policy, its
final metrics, ``report.json``). The scheduled evaluation and curve point
(:func:`~judgeloop.loop.setup.evaluate_when_due`, :func:`~judgeloop.loop.setup.curve_when_due`) sit beside
the run in :mod:`judgeloop.loop.setup`, whose step 0 runs them too.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np
from accelerate.utils import gather_object

from judgeloop.checkpointing import prune_checkpoints
from judgeloop.config import to_yaml
from judgeloop.io import atomic_write_json, atomic_write_jsonl, atomic_write_text, finite_or_none
from judgeloop.logging import get_logger
from judgeloop.loop.arms import arm
from judgeloop.loop.curve import curve_articles, curve_table, plot_curve
from judgeloop.loop.model_card import policy_card
from judgeloop.loop.prefetch import JudgePrefetch
from judgeloop.loop.rounds import round_rows, rounds_markdown
from judgeloop.loop.run_state_files import (
    export_policy,
    load_policy_weights,
    save_checkpoint,
)
from judgeloop.loop.setup import LoopRun
from judgeloop.loop.state import peek_batch
from judgeloop.loop.steps import PairBatch
from judgeloop.preference_labels import labeled_row
from judgeloop.signals import Stopped

logger = get_logger(__name__)


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
    enabled = cfg.judge_prefetch and run.prefetch_judge  # not under a ZeRO-3 judge (setup_run)
    run.prefetch = JudgePrefetch(run.train_judge, enabled, cfg.judge_prefetch_threads)

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


def record_update(run: LoopRun, batch: PairBatch) -> None:
    """After policy_update: the step's training row (its stats, the KL coefficient, the judge's mean p
    and failures, the learning rate) into the run state and the trackers; the KL controller adapts."""
    stats, state = batch.stats, run.state
    stats.update(
        kl_coef=run.kl_ctl.coef, **judged_stats(batch), lr=float(run.learner.scheduler.get_last_lr()[0])
    )
    run.kl_ctl.update(stats["kl"])
    state.kl_coef = run.kl_ctl.coef
    state.step = batch.step
    state.train_log.append(finite_or_none({"step": batch.step, **stats}))
    run.accelerator.log({f"train/{k}": v for k, v in stats.items()}, step=batch.step)
    if run.cfg.mode == "rounds":
        write_round_pairs(run, batch)


def write_round_pairs(run: LoopRun, batch: PairBatch) -> None:
    """Under ``mode: rounds``: the round's pairs, as ``label-pairs`` writes its rows
    (:func:`judgeloop.preference_labels.labeled_row`: ``prompt``, ``chosen``, ``rejected``, ``p_chosen``
    calibrated, ``logit`` raw, ``orders_agree``, ``status``), with each pair's ``article_id``, the soft
    ``target`` P(chosen better) the update used and whether the pair entered the loss (``in_loss``), into
    ``OUTPUT_DIR/rounds/round_N.jsonl`` (every process's pairs; rewritten when a killed round is rerun)."""
    roll, judged, p = batch.rollout, batch.judged, batch.p
    assert roll is not None and judged is not None and p is not None and batch.targets is not None
    assert batch.mask is not None
    tokenizer = run.policy.tokenizer
    rows = []
    for i, ex in enumerate(batch.examples):
        ok = bool(judged.valid[i])
        agree = None
        if judged.reverse is not None and ok:  # the two orders preferred the same summary
            agree = bool(np.sign(judged.forward[i]) == np.sign(-judged.reverse[i]))
        prompt = tokenizer.decode(roll.prompts[i], skip_special_tokens=False)
        pi = float(p[i]) if ok else float("nan")
        row = labeled_row(
            prompt, roll.a_text[i], roll.b_text[i], pi, float(judged.scores[i]), agree, judged.status[i]
        )
        target = float(batch.targets[i])  # P(a better than b): the chosen side is b where p < 0.5
        rows.append(
            {
                "round": batch.step,
                "article_id": ex.id,
                **row,
                "target": 1.0 - target if pi < 0.5 else target,
                "in_loss": bool(batch.mask[i] > 0),
            }
        )
    rows = gather_object(rows)
    if run.accelerator.is_main_process:
        path = run.out_dir / "rounds" / f"round_{batch.step}.jsonl"
        atomic_write_jsonl(path, [finite_or_none(r) for r in rows])


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


def save_run(run: LoopRun, step: int) -> None:
    """A checkpoint of everything the run needs to continue exactly (every process takes part)."""
    state = run.state
    state.judge_status = dict(run.train_judge.stats.status)
    state.judge_cache_hits = run.train_judge.stats.cache_hits
    state.truncated_articles = sorted(run.policy.build_prompt.truncated)
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
        "mode": cfg.mode,
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
        "curve": state.curve,
        "num_refits": sum(1 for r in state.refits if r["refit"] and r["reason"] != "initial"),
        "judge_stats": {
            "status": dict(judge_stats.status),
            "cache_hits": judge_stats.cache_hits,
            **({"label_mass": judge_stats.label_mass_summary()} if judge_stats.label_mass else {}),
        },
        "prompts_truncated": run.policy.build_prompt.num_truncated,
        "per_article": "per_article.jsonl",
        "numerics": state.numerics,
        "start_cache": None
        if run.start.cache is None
        else {"hits": run.start.cache.hits, "misses": run.start.cache.misses},
    }
    if cfg.mode == "rounds":  # each round's figures (loop/rounds.py), also as rounds.md
        report["rounds"] = round_rows(state, cfg.rounds.prompts_per_round * acc.num_processes, cfg.seed)
        report["rounds_files"] = "rounds/round_N.jsonl"
    if cfg.save_final_policy:  # every process: under FSDP / ZeRO-3 the weights are gathered
        export_policy(
            out_dir / "policy",
            acc,
            run.model,
            run.policy.tokenizer,
            run.calibrator.state_dict(),
            cfg.policy.model,
            policy_card(cfg, report, state.per_article),
            to_yaml(cfg),
        )
    if acc.is_main_process:
        save_calibrated_judge(run)
        atomic_write_jsonl(out_dir / "per_article.jsonl", state.per_article)
        if state.curve:
            write_curve(run)
        if cfg.mode == "rounds":
            title = f"{cfg.calibration.method}, seed {cfg.seed}, {cfg.max_steps} rounds"
            atomic_write_text(out_dir / "rounds.md", rounds_markdown(report["rounds"], title))
        atomic_write_json(out_dir / "report.json", report)
    return report


def write_curve(run: LoopRun) -> None:
    """``curve.md`` (the table) and ``curve.png`` (the plots) of the run's validation curve."""
    cfg, out = run.cfg, run.out_dir
    n = len(curve_articles(run.splits.validation, cfg))
    head = [
        f"# Validation curve: {cfg.calibration.method}, seed {cfg.seed}",
        "",
        f"The first {n} validation articles at every point (greedy and one sample each, the sample from the "
        "same seed each time); means with 95% bootstrap intervals over the articles; the gain from step 0 "
        "is paired on the article. Judge signal: the mean |soft target - 0.5| of the pairs in the DPO loss "
        "(or the mean |advantage| under GRPO) over the steps since the previous point.",
        "",
    ]
    atomic_write_text(out / "curve.md", "\n".join([*head, *curve_table(run.state.curve), ""]))
    plot_curve(run.state.curve, out / "curve.png", f"{cfg.calibration.method}, seed {cfg.seed}")


def save_calibrated_judge(run: LoopRun) -> None:
    """The run's final calibrator with the configured judge, as a folder
    ``CalibratedJudge.from_pretrained`` loads (``OUTPUT_DIR/calibrated_judge``): what the last fit was fit
    on and its held-out ECE. Not for the oracle arm (it trains against ROUGE, not the judge) nor a panel
    (its members' calibrators live in the report)."""
    from judgeloop.judges.calibrated import CalibratedJudge

    cfg, state = run.cfg, run.state
    if not arm(cfg.calibration.method).saves_judge or cfg.judge.type == "panel":
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
