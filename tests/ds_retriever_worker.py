"""Worker of tests/test_deepspeed.py: ``train_retriever`` end to end (zero-shot evaluation, mining, four
steps with a checkpoint after each, evaluation), then the same run resumed from its step-2 checkpoint in
another folder. Plain python: 1 process, batch 6; under ``accelerate launch``: 2 processes, batch 3 each.

argv: OUT BEIR_DIR MODEL_DIR OVERRIDE...; writes OUT/result.pt on the main process.
"""

import json
import os
import shutil
import sys
from pathlib import Path

import torch

from judgeloop.config import load_config
from judgeloop.distributed import full_state_dict, is_zero3
from judgeloop.retrieval.trainer import train_retriever
from judgeloop.retrieval.trainer_config import TrainRetrieverConfig

out, beir, model_dir = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]


def config(folder: Path, world: int) -> TrainRetrieverConfig:
    return load_config(
        TrainRetrieverConfig,
        None,
        [
            f"output_dir={folder}",
            f"model.name={model_dir}",
            "model.max_length=32",
            "device=cpu",
            f"data.train.corpus_path={beir / 'corpus.jsonl'}",
            f"data.train.queries_path={beir / 'queries.jsonl'}",
            f"data.train.qrels_path={beir / 'qrels.tsv'}",
            "data.eval_fraction=0.25",
            f"train.batch_size={6 // world}",
            "train.log_every_n_steps=1",
            "train.num_epochs=1",
            "train.max_steps=3",
            "train.learning_rate=1e-3",
            "train.weight_decay=0.0",
            "train.warmup_ratio=0.25",
            "train.save_every_n_steps=1",
            "train.keep_checkpoints=10",
            "train.mixed_precision='no'",
            "eval.precision='no'",
            "eval.batch_size=8",
            "negatives.mining.num_negatives=2",
            "negatives.mining.range_max=6",
            "negatives.mining.relative_margin=null",
            "log_with=[jsonl]",
            *sys.argv[4:],
        ],
    )


def one_run(folder: Path, world: int) -> dict:
    report, encoder, acc = train_retriever(config(folder, world))
    weights = full_state_dict(encoder.model)  # every process: gathered under ZeRO-3
    lrs = [
        json.loads(r)["train/lr"]
        for r in (folder / "metrics.jsonl").read_text().splitlines()
        if "train/lr" in r
    ]
    ds = getattr(acc.state.deepspeed_plugin, "deepspeed_config", None)
    return {
        "report": report,
        "weights": weights,
        "lrs": lrs,
        "zero3": is_zero3(encoder.model),
        "ds": ds,
        "acc": acc,
    }


world = int(os.environ.get("WORLD_SIZE", "1"))
full = one_run(out / "full", world)
acc = full.pop("acc")
losses = (
    json.loads((out / "full/checkpoints/step_3/trainer_state.json").read_text())["losses"]
    if acc.is_main_process
    else None
)
# a run stopped after its step-2 checkpoint: only that checkpoint (and its negatives) in a new folder
part = out / "part"
if acc.is_main_process:
    (part / "checkpoints").mkdir(parents=True)
    shutil.copytree(out / "full/checkpoints/step_2", part / "checkpoints/step_2")
    state_file = part / "checkpoints/step_2/trainer_state.json"
    state = json.loads(state_file.read_text())
    if state.get("negatives_path"):
        (part / "negatives").mkdir()
        name = Path(state["negatives_path"]).name
        shutil.copy(state["negatives_path"], part / "negatives" / name)
        state["negatives_path"] = str(part / "negatives" / name)
        state_file.write_text(json.dumps(state))
acc.wait_for_everyone()
resumed = one_run(part, world)
resumed.pop("acc")
if acc.is_main_process:
    torch.save(
        {"world": acc.num_processes, "full": full, "resumed": resumed, "losses": losses}, out / "result.pt"
    )
acc.wait_for_everyone()
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
