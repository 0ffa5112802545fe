"""Train a bi-encoder retriever with mined hard negatives, top to bottom.

    accelerate launch recipes/train_retriever.py --config configs/retriever/scifact.yaml [key=value ...]
    accelerate launch --config_file configs/accelerate/<topology>.yaml recipes/train_retriever.py ...

Same steps and outputs as ``judgeloop train-retriever`` (which runs ``judgeloop.commands.train_retriever.run``);
this script spells the loop out so it can be read and changed in one place: evaluate zero-shot ->
mine hard negatives -> train (InfoNCE, in-batch + hard negatives, re-mined every
``negatives.remine_every_n_epochs``) -> evaluate -> save. Under several processes the loss uses the
documents of every process as negatives (``loss.gather_across_processes``). Checkpointing and exact
resume are in the library's ``run``; this recipe trains straight through.
"""

import argparse
import math
import random
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from tqdm.auto import tqdm
from transformers import get_linear_schedule_with_warmup

from judgeloop.commands.train_retriever import (
    TrainRetrieverConfig,
    evaluate_retriever,
    load_retrieval_data,
    make_batches,
    make_examples,
    mine_negatives,
    render_markdown,
    train_step,
)
from judgeloop.config import load_config, to_dict
from judgeloop.io import atomic_write_json, atomic_write_text
from judgeloop.logging import setup_logging
from judgeloop.retrieval import BiEncoder, save_negatives

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--config", required=True)
parser.add_argument("overrides", nargs="*")
args = parser.parse_args()
setup_logging()
cfg = load_config(TrainRetrieverConfig, args.config, args.overrides)
out = Path(cfg.output_dir)

accelerator = Accelerator()
set_seed(cfg.train.seed)

# 1. data: BEIR files or pair JSONL; evaluation queries split off deterministically when data.eval is unset
train_data, eval_data = load_retrieval_data(cfg.data)

# 2. model: any HF encoder, pooled and normalized
encoder = BiEncoder.from_pretrained(
    cfg.model.name, cfg.model.pooling, cfg.model.normalize, cfg.model.max_length, cfg.model.query_max_length
).to(accelerator.device)

# 3. zero-shot evaluation; its corpus embeddings are reused for the first mining round
before, corpus = evaluate_retriever(encoder, eval_data, cfg.eval, accelerator, use_cache=True)
accelerator.print("zero-shot:", before)

# 4. hard negatives mined by the retriever itself
negatives = None
if cfg.negatives.hard:
    same_corpus = train_data.corpus is eval_data.corpus
    negatives = mine_negatives(
        encoder,
        train_data,
        cfg.negatives,
        cfg.eval.batch_size,
        accelerator,
        corpus if same_corpus else None,
        cfg.eval.embedding_cache_dir,
    )
    if accelerator.is_main_process:
        save_negatives(out / "negatives" / "epoch_0.jsonl", negatives)

# 5. optimizer and schedule
examples = make_examples(train_data)
per_step = cfg.train.batch_size * accelerator.num_processes
steps_per_epoch = len(make_batches(examples, per_step, cfg.train.seed, 0, accelerator.num_processes > 1))
total_steps = steps_per_epoch * cfg.train.num_epochs
if cfg.train.max_steps is not None:
    total_steps = min(total_steps, cfg.train.max_steps)
optimizer = torch.optim.AdamW(
    encoder.parameters(), lr=cfg.train.learning_rate, weight_decay=cfg.train.weight_decay
)
scheduler = get_linear_schedule_with_warmup(
    optimizer, math.ceil(cfg.train.warmup_ratio * total_steps), total_steps
)
model, optimizer, scheduler = accelerator.prepare(encoder, optimizer, scheduler)

# 6. training: InfoNCE over in-batch + hard negatives; re-mine with the encoder being trained (ANCE)
step = 0
bar = tqdm(total=total_steps, desc="train retriever", disable=not accelerator.is_main_process)
for epoch in range(cfg.train.num_epochs):
    model.train()
    for global_batch in make_batches(
        examples, per_step, cfg.train.seed, epoch, accelerator.num_processes > 1
    ):
        if step >= total_steps:
            break
        lo = accelerator.process_index * cfg.train.batch_size
        batch = global_batch[lo : lo + cfg.train.batch_size]
        rng = random.Random(cfg.train.seed * 1_000_003 + step)
        loss = train_step(model, encoder, batch, train_data, negatives, cfg, accelerator, rng)
        if cfg.train.max_grad_norm > 0:
            accelerator.clip_grad_norm_(model.parameters(), cfg.train.max_grad_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.4f}", epoch=epoch)
    every = cfg.negatives.remine_every_n_epochs
    if negatives is not None and every and (epoch + 1) % every == 0 and epoch + 1 < cfg.train.num_epochs:
        negatives = mine_negatives(encoder, train_data, cfg.negatives, cfg.eval.batch_size, accelerator)
        if accelerator.is_main_process:
            save_negatives(out / "negatives" / f"epoch_{epoch + 1}.jsonl", negatives)
bar.close()

# 7. evaluation after training, model in sentence-transformers layout, report
encoder = accelerator.unwrap_model(model)
after, _ = evaluate_retriever(encoder, eval_data, cfg.eval, accelerator)
accelerator.print("after training:", after)
if accelerator.is_main_process:
    report = {
        "before": before,
        "after": after,
        "delta": {m: after[m] - before[m] for m in after},
        "model": cfg.model.name,
        "num_train_queries": len(train_data.queries),
        "num_eval_queries": len(eval_data.queries),
        "num_docs": len(eval_data.corpus),
        "num_train_pairs": len(examples),
        "hard_negatives": cfg.negatives.hard,
        "num_hard_negatives": cfg.negatives.mining.num_negatives if cfg.negatives.hard else 0,
        "steps": step,
        "config": to_dict(cfg),
    }
    encoder.save(out / "model")
    atomic_write_json(out / "report.json", report)
    atomic_write_text(out / "report.md", render_markdown(report))
accelerator.wait_for_everyone()
