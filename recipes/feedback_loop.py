"""Recipe: the calibrated feedback loop (online DPO against a judge), launched with accelerate.

    accelerate launch --config_file configs/accelerate/single_gpu.yaml recipes/feedback_loop.py \
        --config configs/feedback_loop/quickstart.yaml loss.beta=0.2
    python recipes/feedback_loop.py --config configs/feedback_loop/tiny.yaml        # one CPU process
    python recipes/feedback_loop.py --config configs/feedback_loop/tiny.yaml --ablate
    accelerate launch recipes/feedback_loop.py --config C --job platt:1   # one ablation job (a cluster task)
    python recipes/feedback_loop.py --config C --aggregate                 # results.* from the job folders

The run is ``train`` below, the library's own lines (src/judgeloop/loop/runner.py): set up, step,
close. Each step is ``training_step``, one named function per step over one ``PairBatch``
(articles -> samples -> logits -> p -> targets -> stats):

    batch = PairBatch(step, next_batch(state, splits.train, cfg, accelerator))  # this process's articles
    rollout_step(policy, tokenizer, build_prompt, batch, cfg, rank, keep)  # 1. two samples per article
                                                                       #    (keep: its prompt pass, for 5)
    judge_step(train_judge, batch)                                     # 2. raw preference logits
    calibrate_step(calibrator, batch)                                  # 3. p = P(a better than b)
    make_pairs(batch, cfg.loss, state.judge_weight)                    # 4. soft DPO targets + mask
    policy_update(learner, batch, kl_ctl.coef)                         # 5. soft-target DPO + KL
    calibrator = maybe_recalibrate(step, state, calibrator, ...)       # 6. refit on fresh samples
    watch_divergence(run, step)                                        # 7. judge vs objective signals

with evaluation on the test split every ``eval_every_n_steps``, early stopping on the validation split,
and atomic checkpoints every ``save_every_n_steps`` (``resume_from=DIR`` continues exactly).
"""

from __future__ import annotations

import argparse
import json
import sys

from judgeloop.config import load_config
from judgeloop.logging import setup_logging
from judgeloop.loop.ablation import aggregate, run_ablation
from judgeloop.loop.config import FeedbackLoopConfig
from judgeloop.loop.runner import after_step, close_run, open_run, stepping, training_step
from judgeloop.signals import Stopped


def train(cfg: FeedbackLoopConfig) -> dict:
    """One run of the loop (what ``judgeloop train`` runs)."""
    with open_run(cfg) as run:  # checks, accelerator, data, policy, judge; resume, or step 0 (first fit)
        with stepping(run) as steps:  # until max_steps, early stopping or stop_after_n_steps
            for step in steps:
                batch = training_step(run, step)  # rollout -> judge -> calibrate -> pairs -> update -> refit
                after_step(run, batch)  # the scheduled checkpoint, the progress bar
        return close_run(run)  # the kept policy, its final metrics, report.json


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except Stopped as err:  # a stop signal (stop_signals): its checkpoint is written; how to continue
        sys.stderr.write(f"feedback_loop: {err}\n")
        return err.exit_status


def _main(argv: list[str] | None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="YAML config (configs/feedback_loop/*.yaml)")
    parser.add_argument("--ablate", action="store_true", help="run every arm x seed and write results.md")
    parser.add_argument(
        "--job", metavar="ARM:SEED", help="run one job of the ablation grid (skipped when done)"
    )
    parser.add_argument(
        "--aggregate", action="store_true", help="write results.* from the ablation's job folders"
    )
    parser.add_argument(
        "--allow-missing", action="store_true", help="with --aggregate: summarize the finished jobs only"
    )
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. calibration.method=isotonic")
    args = parser.parse_args(argv)
    setup_logging()
    cfg = load_config(FeedbackLoopConfig, args.config, args.overrides)
    if args.job:
        print(json.dumps(run_ablation(cfg, job=args.job)))
        return 0
    if args.aggregate:
        aggregate(cfg, allow_missing=args.allow_missing)
        return 0
    if args.ablate:
        run_ablation(cfg)
        return 0
    report = train(cfg)
    print(
        json.dumps(
            {
                k: report[k]
                for k in ("arm", "seed", "kept_step", "kept_reason", "num_refits", "final")
                if k in report
            },
            indent=2,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
