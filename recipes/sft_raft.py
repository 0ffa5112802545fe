"""LoRA SFT of a causal LM on a RAFT set with TRL's SFTTrainer.

    accelerate launch recipes/sft_raft.py --config configs/raft/sft_pubmedqa.yaml [key=value ...]
    judgeloop sft --config configs/raft/sft_pubmedqa.yaml          # the same, launched for you

Steps: config -> data (RAFT train split as conversational prompt/completion) -> model + tokenizer
-> LoRA -> SFTTrainer.train -> save the adapter and a train report (loss curve, time, sizes).

The output folder is opened through :func:`judgeloop.rundir.run_dir` (lock and ``run.json``), unless
``judgeloop sft`` launched this script and holds it already. A config, data or folder error is one line
from the main process and exit status 2.
"""

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from peft import LoraConfig
from trl import SFTConfig, SFTTrainer

from judgeloop.config import ConfigError, load_config, to_dict
from judgeloop.devices import check_device, on_cpu
from judgeloop.distributed import release_process_group_at_exit
from judgeloop.io import DataError, atomic_write_json, replace_dir
from judgeloop.logging import get_logger, setup_logging
from judgeloop.models import load_causal_lm, load_tokenizer
from judgeloop.raft.sft import SftConfig, jsonl_callback, load_sft_dataset, report_to
from judgeloop.rundir import run_dir
from judgeloop.tracking import check_trackers

logger = get_logger("recipes.sft_raft")


def train(cfg: SftConfig) -> dict[str, Any] | None:
    """Steps 2-6 into ``cfg.output_dir``; the train report (``None`` on the other processes)."""
    out = Path(cfg.output_dir)

    # --- 2. data: the RAFT train split; loss on the assistant turn only when completion_only
    train_ds = load_sft_dataset(cfg)
    logger.info("training rows: %d (columns %s)", len(train_ds), train_ds.column_names)

    # --- 3. model and tokenizer (offline; SmolLM2 comes from the packaged GGUF, dequantized to fp32)
    tokenizer = load_tokenizer(cfg.model)
    model = load_causal_lm(cfg.model)

    # --- 4. LoRA on the attention and MLP projections
    peft_config = LoraConfig(
        r=cfg.lora.r,
        lora_alpha=cfg.lora.alpha,
        lora_dropout=cfg.lora.dropout,
        target_modules=list(cfg.lora.target_modules),
        task_type="CAUSAL_LM",
    )

    # --- 5. trainer
    t = cfg.train
    sft_args = SFTConfig(
        output_dir=str(out / "trainer"),
        num_train_epochs=t.num_epochs,
        max_steps=-1 if t.max_steps is None else t.max_steps,  # TRL / transformers: -1 = no cap
        per_device_train_batch_size=t.batch_size,
        gradient_accumulation_steps=t.grad_accum_steps,
        learning_rate=t.learning_rate,
        lr_scheduler_type=t.lr_scheduler,
        warmup_steps=t.warmup_steps,
        weight_decay=t.weight_decay,
        logging_steps=t.log_every_n_steps,
        logging_first_step=True,
        save_strategy="no",
        eval_strategy="no",
        report_to=report_to(cfg),
        run_name=cfg.run_name or "sft",
        project=cfg.project_name,
        max_length=cfg.max_length,
        completion_only_loss=cfg.completion_only,
        bf16=t.bf16,
        gradient_checkpointing=t.gradient_checkpointing,
        seed=cfg.seed,
        data_seed=cfg.seed,
        dataloader_num_workers=0,
        disable_tqdm=True,
        use_cpu=on_cpu(cfg.device),  # auto: the GPU when there is one
    )
    callbacks = [jsonl_callback(out / "metrics.jsonl")] if "jsonl" in cfg.log_with else []
    trainer = SFTTrainer(
        model=model,
        args=sft_args,
        train_dataset=train_ds,
        processing_class=tokenizer,
        peft_config=peft_config,
        callbacks=callbacks,
    )
    release_process_group_at_exit()  # under accelerate launch: the trainer's group, released at exit
    if len(trainer.train_dataset) == 0:
        raise ConfigError(
            f"max_length={cfg.max_length} leaves no training example with a completion token (prompts are longer); "
            "raise max_length or rebuild the RAFT set with smaller chunk.chunk_tokens / distractors.num_distractors"
        )
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in trainer.model.parameters())
    logger.info("trainable parameters: %d of %d (%.2f%%)", trainable, total, 100 * trainable / total)

    start = time.time()
    result = trainer.train()
    elapsed = time.time() - start

    # --- 6. save the adapter (atomically): every process, since Trainer.save_model gathers FSDP / DeepSpeed
    # shards before its main process writes; then the report, on the main process
    main = trainer.accelerator.is_main_process
    tmp = out / ".adapter.tmp"
    if main:
        shutil.rmtree(tmp, ignore_errors=True)
    trainer.accelerator.wait_for_everyone()
    trainer.save_model(str(tmp))
    if main:
        tokenizer.save_pretrained(str(tmp))
        replace_dir(tmp, out / "adapter")
    if main:
        losses = [{"step": h["step"], "loss": h["loss"]} for h in trainer.state.log_history if "loss" in h]
        report = {
            "model": cfg.model,
            "adapter_dir": str(out / "adapter"),
            "num_train_examples": len(train_ds),
            "num_steps": trainer.state.global_step,
            "train_loss": result.training_loss,
            "first_logged_loss": losses[0]["loss"] if losses else None,
            "last_logged_loss": losses[-1]["loss"] if losses else None,
            "loss_curve": losses,
            "train_seconds": elapsed,
            "trainable_parameters": trainable,
            "total_parameters": total,
            "config": to_dict(cfg),
        }
        atomic_write_json(out / "train_report.json", report)
        logger.info(
            "done: %d steps in %.0fs, train loss %.4f -> %s",
            report["num_steps"],
            elapsed,
            result.training_loss,
            out / "adapter",
        )
        print(json.dumps({k: v for k, v in report.items() if k not in ("loss_curve", "config")}, indent=2))
        return report
    return None


def main(argv: list[str] | None = None) -> int:
    # --- 1. config, checked before data or weights load
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    setup_logging()
    try:
        cfg = load_config(SftConfig, args.config, args.overrides)
        try:
            check_device(cfg.device)
            check_trackers([t for t in cfg.log_with if t != "jsonl"])
        except ValueError as err:
            raise ConfigError(str(err)) from None
        with run_dir(cfg.output_dir, "sft", cfg):  # lock + run.json; None where judgeloop sft holds it
            train(cfg)
    except (ConfigError, DataError) as err:  # a setting, the data or the folder refused: one line, one rank
        if os.environ.get("RANK", "0") == "0":
            sys.stderr.write(f"sft_raft: error: {err}\n")
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
