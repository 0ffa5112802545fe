"""Recipe: train a bi-encoder retriever with mined hard negatives, launched with accelerate.

    accelerate launch recipes/train_retriever.py --config configs/retriever/scifact.yaml [key=value ...]
    accelerate launch --config_file configs/accelerate/<topology>.yaml recipes/train_retriever.py ...
    python recipes/train_retriever.py --config configs/retriever/scifact.yaml        # one process

Same as ``judgeloop train-retriever``. The steps (src/judgeloop/retrieval/trainer.py, ``train_retriever``):

    train_data, eval_data = load_retrieval_data(cfg.data)          # BEIR files or pair JSONL
    before, corpus = evaluate_retriever(encoder, eval_data, ...)    # zero-shot nDCG / recall / MRR
    negatives = mine_negatives(encoder, train_data, cfg.negatives)  # the retriever mines its own
    for batch in make_batches(examples, ...):                       # each process takes its share
        loss = train_step(model, encoder, batch, ...)               # InfoNCE: in-batch + hard negatives
        ...                                                         # (gathered across processes)
    negatives = mine_negatives(...)                                 # re-mined every N epochs (ANCE)
    after, _ = evaluate_retriever(encoder, eval_data, ...)          # then the model is saved in the
                                                                    # sentence-transformers layout

with atomic checkpoints every ``train.save_every_n_steps`` and exact resume from the latest one. A config,
data or output-folder error is one line from the main process and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from judgeloop.commands.train_retriever import TrainRetrieverConfig, run
from judgeloop.config import ConfigError, load_config
from judgeloop.io import DataError
from judgeloop.logging import setup_logging


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="YAML config (configs/retriever/*.yaml)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.batch_size=64")
    args = parser.parse_args(argv)
    setup_logging()
    try:
        report = run(load_config(TrainRetrieverConfig, args.config, args.overrides))
    except (ConfigError, DataError) as err:  # a setting, the data or the folder refused (RunDirError is a
        if os.environ.get("RANK", "0") == "0":  # ConfigError): one line, from one rank
            sys.stderr.write(f"train_retriever: error: {err}\n")
        return 2
    if report:
        print(json.dumps({k: report[k] for k in ("before", "after", "delta") if k in report}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
