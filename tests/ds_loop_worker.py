"""Worker of tests/test_deepspeed.py: the loop's own set-up (``make_accelerator``, ``setup_run``: policy,
reference and judge as a run builds them, ``configure_deepspeed``, ``prepare``), then rollouts, four
updates with a checkpoint after the second, the resume from it, and the export. Run with plain python
(1 process, batch 4) or under ``accelerate launch`` with DeepSpeed (2 processes, batch 2 each).

argv: ROOT JOB...; a job is OUT,MODE(full|lora)[,OVERRIDE...]; each writes OUT/result.pt on the main process.
"""

import os
import sys
from pathlib import Path

import torch
from accelerate.utils import gather_object

from judgeloop.config import load_config
from judgeloop.distributed import full_state_dict, is_zero3, trainable_names
from judgeloop.loop.config import FeedbackLoopConfig
from judgeloop.loop.rollout import Rollout
from judgeloop.loop.run_state_files import export_policy, load_checkpoint, save_checkpoint
from judgeloop.loop.setup import make_accelerator, setup_run
from judgeloop.loop.state import load_splits
from judgeloop.loop.steps import PairBatch, policy_update


def job(out, mode, extra):
    base = [
        "judge.model=judgeloop-tiny/encoder",
        "judge.cache_size=0",
        "data.embedded_size=120",
        "log_with=[]",
        "progress_bar=false",
        "generation.max_new_tokens=6",
        "policy.sft_steps=4",
        "optim.scheduler=linear",
        "optim.warmup_steps=1",
        "max_steps=4",
        "optim.learning_rate=5e-3",
        "device=cpu",
        "loss.kl_coef=0.1",
        "judge_prefetch=false",
        f"output_dir={out}",
        f"policy.lora={str(mode == 'lora').lower()}",
        "policy.lora_r=4",
    ]
    cfg = load_config(FeedbackLoopConfig, root / "configs/feedback_loop/tiny.yaml", [*base, *extra])
    acc = make_accelerator(cfg, out)
    world, rank = acc.num_processes, acc.process_index
    per = 4 // world
    cfg.batch_size = per
    run = setup_run(cfg, acc, out, load_splits(cfg, world))
    model, tok = run.model, run.policy.tokenizer
    policy = acc.unwrap_model(model)
    articles = [e.article for e in run.splits.train[:4]]
    # 1. rollouts: each 2-article chunk sampled with its own seed (on one process: both chunks in turn)
    chunks = [rank] if world > 1 else [0, 1]
    rolls = []
    with run.policy.generating():
        for c in chunks:
            rolls.append(run.policy.sample(articles[2 * c : 2 * c + 2], cfg.generation, 100 + c))
    roll = Rollout(
        *[
            sum((getattr(r, f) for r in rolls), [])
            for f in ("articles", "prompts", "a_ids", "b_ids", "a_text", "b_text")
        ]
    )
    p_all = torch.tensor([0.9, 0.2, 0.7, 0.4])
    p = p_all[rank * per : (rank + 1) * per]
    # 2. updates (AdamW, warm-up then linear decay, clipping at optim.max_grad_norm); a checkpoint after step 2
    init = full_state_dict(model, trainable_names(policy))
    log = []

    def step(i):
        batch = PairBatch(i, [], rollout=roll, targets=p, mask=torch.ones(per))
        stats = policy_update(run.learner, batch, cfg.loss.kl_coef)
        log.append(
            {
                "step": i,
                **{k: stats[k] for k in ("loss", "dpo_loss", "kl", "grad_norm")},
                "lr": float(run.learner.scheduler.get_last_lr()[0]),
            }
        )

    for i in (1, 2):
        step(i)
    save_checkpoint(acc, out / "ckpt", {"method": "raw"}, {"step": 2})
    for i in (3, 4):
        step(i)
    after = full_state_dict(model, trainable_names(policy))
    # 3. the checkpoint resumes: steps 3-4 again from it give the same weights and metrics
    load_checkpoint(acc, out / "ckpt")
    uninterrupted, log = log, log[:2]
    for i in (3, 4):
        step(i)
    resumed = full_state_dict(model, trainable_names(policy))
    # 4. the export, in the transformers / peft layout
    export_policy(out / "policy", acc, model, tok, {"method": "raw"})
    sharded = [is_zero3(policy), sum(q.numel() for q in policy.parameters())]
    ref = run.policy.ref
    # the frozen reference (full fine-tuning) and the judge under ZeRO-3: inference engines' partitions
    info = {"ref_zero3": ref is not None and is_zero3(ref), "judge_zero3": is_zero3(run.judge.model)}
    rolls_all = gather_object([[roll.a_ids, roll.b_ids]])
    if acc.is_main_process:
        torch.save(
            {
                "world": world,
                "roll": [sum((r[0] for r in rolls_all), []), sum((r[1] for r in rolls_all), [])],
                "log": uninterrupted,
                "resumed_log": log,
                "init": init,
                "after": after,
                "resumed": resumed,
                "sharded": sharded,
                "info": info,
                "ds": getattr(acc.state.deepspeed_plugin, "deepspeed_config", None),
            },
            out / "result.pt",
        )
    acc.wait_for_everyone()


root = Path(sys.argv[1])
for spec in sys.argv[2:]:  # OUT,MODE[,OVERRIDE...] per job, run in turn in this process
    out, mode, *extra = spec.split(",")
    job(Path(out), mode, extra)
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
