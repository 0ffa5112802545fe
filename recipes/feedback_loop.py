"""Recipe: the calibrated feedback loop (online DPO, or GRPO, against a judge), top to bottom.

    judgeloop train --config configs/feedback_loop/quickstart.yaml loss.beta=0.2     # runs this file
    accelerate launch --config_file configs/accelerate/single_gpu.yaml recipes/feedback_loop.py \
        --config configs/feedback_loop/quickstart.yaml loss.beta=0.2
    python recipes/feedback_loop.py --config configs/feedback_loop/tiny.yaml        # one CPU process

The ablation (every arm x seed, one job of the grid, the aggregate) is ``judgeloop ablate``; each of its
jobs runs ``train`` below. The steps are numbered once, in :mod:`judgeloop.loop.steps`, and called here
in that order; under ``accelerate launch`` each process runs them on its share of every batch.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from judgeloop.config import ConfigError, load_config
from judgeloop.logging import setup_logging
from judgeloop.loop.alarms import watch_divergence
from judgeloop.loop.config import FeedbackLoopConfig
from judgeloop.loop.recalibration import maybe_recalibrate
from judgeloop.loop.run import after_step, close_run, record_update, stepping
from judgeloop.loop.setup import curve_when_due, evaluate_when_due, open_run
from judgeloop.loop.state import next_batch, peek_batch
from judgeloop.loop.steps import (
    PairBatch,
    calibrate_step,
    judge_groups_step,
    judge_step,
    make_advantages,
    make_pairs,
    policy_update,
    rollout_step,
)
from judgeloop.signals import Stopped

Phase = Callable[[str], AbstractContextManager[Any]]


def untimed(name: str) -> AbstractContextManager[Any]:
    return contextlib.nullcontext()


def train(cfg: FeedbackLoopConfig, phase: Phase = untimed) -> dict[str, Any]:
    """One run of the loop; returns (and writes) its report. ``phase(name)`` wraps the rollout, the
    judging, the update and the evaluation of every step (``scripts/bench_loop.py`` times them)."""
    # Phase A. Set-up: the config checked before any work (output folder, models, devices, trackers), the
    #    accelerator, the data splits, the policy (after its SFT warm start) and its reference, the judges,
    #    the optimizer, the generation backend (run.policy.backend, from generation.backend: hf, the policy
    #    generates in this process; vllm, an engine serves it); then a resume from a checkpoint, or
    #    step 0 (reference summaries, the first calibrator fit on samples of the starting policy, the
    #    step-0 evaluation).
    with open_run(cfg) as run:
        acc, grpo = run.accelerator, cfg.loss.type == "grpo"
        # Phase B. The loop's steps 1-7 (numbered as in loop/steps.py's docstring), until max_steps,
        #    early stopping, stop_after_n_steps or a stop signal.
        with stepping(run) as steps:
            for step in steps:
                batch = PairBatch(step, next_batch(run.state, run.splits.train, cfg, acc))
                with phase("rollout"), run.policy.generating():  # step 1. samples per article
                    # where run.policy.backend says (the run's evaluations and refits sample there too)
                    rollout_step(run.policy, batch, cfg, run.learner.reuses_prompt_pass(len(batch.examples)))
                with phase("judge"):
                    run.prefetch.wait()  # the article-side judge work, done during the last update
                    if grpo:  # steps 2-3. each group's comparisons, judged and calibrated in one call
                        judge_groups_step(run.train_judge, run.calibrator, cfg, batch)
                    else:
                        judge_step(run.train_judge, batch)  # step 2. raw preference logits
                    if step < cfg.max_steps:  # the next batch's article-side work, during this update
                        run.prefetch.start(peek_batch(run.state, run.splits.train, cfg, acc))
                    if grpo:
                        make_advantages(batch, cfg.loss, run.state.judge_weight)  # step 4. group-relative
                    else:
                        calibrate_step(run.calibrator, batch)  # step 3. p = P(a better than b)
                        make_pairs(batch, cfg.loss, run.state.judge_weight)  # step 4. soft DPO targets
                with phase("update"):
                    policy_update(run.learner, batch, run.kl_ctl.coef)  # step 5. one optimizer step
                record_update(run, batch)
                run.calibrator = maybe_recalibrate(  # step 6. ECE monitor and refit on fresh samples
                    step, run.state, run.calibrator, run.collect, cfg, run.train_judge, batch=batch
                )
                watch_divergence(run, step)  # step 7. the judge against objective signals
                # Phase C. Evaluation on the test split (reported) and early stopping on validation; the validation curve.
                with phase("evaluate"):
                    evaluate_when_due(run, step)
                    curve_when_due(run, step)  # the validation curve: is the task learned?
                # Phase D. The scheduled checkpoint (resume_from continues exactly), the progress bar.
                after_step(run, batch)
        # Phase E. The kept policy (best validation under early stopping, else the last), its final
        #    metrics, report.json, per_article.jsonl, policy/ and calibrated_judge/.
        return close_run(run)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="YAML config (configs/feedback_loop/*.yaml)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. calibration.method=isotonic")
    args = parser.parse_args(argv)
    setup_logging()
    try:
        report = train(load_config(FeedbackLoopConfig, args.config, args.overrides))
    except Stopped as err:  # a stop signal: its checkpoint is written; how to continue
        sys.stderr.write(f"feedback_loop: {err}\n")
        return err.exit_status
    except ConfigError as err:  # a setting (the config's or the launch's) refused: one line, from one rank
        if os.environ.get("RANK", "0") == "0":
            sys.stderr.write(f"feedback_loop: error: {err}\n")
        return 2
    keys = ("arm", "seed", "kept_step", "kept_reason", "num_refits", "final", "interrupted", "checkpoint")
    print(json.dumps({k: report[k] for k in keys if k in report}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
