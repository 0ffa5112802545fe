"""GRPO in TRL, rewarded by a calibrated judge saved by ``judgeloop calibrate``.

    judgeloop calibrate --config configs/calibrate/embedded_embedding.yaml output_dir=runs/cal
    accelerate launch recipes/grpo_trl.py --config configs/grpo_trl/quickstart.yaml \\
        judge_path=runs/cal/calibrated_judge/platt

Each prompt's ``grpo.num_generations`` completions are compared with each other by the calibrated,
position-debiased judge (``rewards.scheme``, one batched judge call per TRL batch) and the comparisons
become one reward per completion (``rewards.aggregate``); TRL's GRPOTrainer does the rest. Writes TRL's
output under ``output_dir`` and ``grpo_report.json`` (s/step, the judge's share, the logged rewards).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from judgeloop.config import ConfigError, load_config
from judgeloop.distributed import release_process_group_at_exit
from judgeloop.integrations.grpo import GrpoTrlConfig, prompt_rows
from judgeloop.io import atomic_write_json
from judgeloop.rundir import run_dir


def main(argv: list[str] | None = None) -> dict[str, Any]:
    # 1. The config: a YAML file and dotted overrides, checked before any work.
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    cfg = load_config(GrpoTrlConfig, args.config, args.overrides)

    # the output folder is this run's alone while it runs (judgeloop.rundir: run.lock, run.json)
    with run_dir(cfg.output_dir, "grpo-trl", cfg):
        # 2. The calibrated judge and the reward function TRL calls (one judge call per batch).
        from judgeloop.integrations.trl import JudgeReward
        from judgeloop.judges.calibrated import CalibratedJudge

        judge = CalibratedJudge.from_pretrained(cfg.judge_path, cfg.judge_overrides)
        reward = JudgeReward(
            judge,
            cfg.rewards,
            num_generations=cfg.grpo.num_generations,
            source_column="article",
            anchor_column="reference" if cfg.rewards.scheme == "anchor" else None,
            reference_column="reference"
            if judge.reads_references
            else None,  # what judge.needs says it reads
            keep_history=cfg.grpo.max_steps,
        )

        # 3. The policy and the prompts (the training split: the calibration and test articles stay out).
        from datasets import Dataset

        from judgeloop.data import load_examples, split_examples
        from judgeloop.models import load_causal_lm, load_tokenizer

        tokenizer = load_tokenizer(cfg.policy.model)
        model = load_causal_lm(cfg.policy.model, dtype="float32")
        train = split_examples(load_examples(cfg.data), cfg.data.split)["train"][: cfg.max_train_articles]
        dataset = Dataset.from_list(prompt_rows(train, tokenizer, cfg.policy))
        peft_config = None
        if cfg.policy.lora:
            from peft import LoraConfig

            peft_config = LoraConfig(
                r=cfg.policy.lora_r,
                lora_alpha=cfg.policy.lora_alpha,
                target_modules=list(cfg.policy.lora_target_modules),
                task_type="CAUSAL_LM",
            )

        # 4. TRL's GRPOTrainer, rewarded by the judge.
        from trl import GRPOConfig, GRPOTrainer

        from judgeloop.devices import on_cpu

        g = cfg.grpo
        targs = GRPOConfig(
            output_dir=cfg.output_dir,
            num_generations=g.num_generations,
            per_device_train_batch_size=g.per_device_train_batch_size,
            max_completion_length=g.max_completion_length,
            temperature=g.temperature,
            learning_rate=g.learning_rate,
            beta=g.beta,
            max_steps=g.max_steps,
            logging_steps=g.logging_steps,
            seed=g.seed,
            use_cpu=on_cpu(cfg.device),
            report_to=[],
            save_strategy="no",
        )
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=[reward],
            args=targs,
            train_dataset=dataset,
            processing_class=tokenizer,
            peft_config=peft_config,
        )

        release_process_group_at_exit()  # under accelerate launch: the trainer's group, released at exit
        # 5. Train, then the report: seconds per step, the judge's share, the rewards TRL logged.
        t0 = time.perf_counter()
        trainer.train()
        seconds = time.perf_counter() - t0
        logged = [row for row in trainer.state.log_history if f"rewards/{reward.__name__}/mean" in row]
        report = {
            "steps": trainer.state.global_step,
            "seconds": seconds,
            "s_per_step": seconds / max(trainer.state.global_step, 1),
            "judge_seconds": reward.seconds,
            "judge_share": reward.seconds / seconds if seconds > 0 else None,
            "judge_calls": reward.judge_calls,
            "reward_calls": reward.calls,
            "logged": logged,
        }
        if trainer.accelerator.is_main_process:
            atomic_write_json(Path(cfg.output_dir) / "grpo_report.json", report)
    return {"report": report, "reward": reward, "trainer": trainer, "config": cfg}


if __name__ == "__main__":
    try:
        out = main()
    except ConfigError as err:
        sys.stderr.write(f"grpo_trl: config error: {err}\n")
        raise SystemExit(2) from None
    print(json.dumps({k: v for k, v in out["report"].items() if k != "logged"}, indent=2))
