"""Round 0 of a `mode: rounds` ablation before its report exists: the starting policy's greedy summaries of the
test articles (the shared start work, OUTPUT_DIR/_shared/greedy-*.json) through the evaluation's text
metrics, means with 95% bootstrap intervals over the articles.

    python scripts/rounds_start_figures.py OUTPUT_DIR OUTPUT_DIR/_shared/greedy-HASH.json
"""

import json
import sys

from judgeloop.config import load_config
from judgeloop.intervals import bootstrap_mean_interval
from judgeloop.loop.config import FeedbackLoopConfig
from judgeloop.loop.evaluation import text_metrics
from judgeloop.loop.state import load_splits

run = sys.argv[1]
cfg = load_config(FeedbackLoopConfig, f"{run}/raw/seed0/config.yaml")
with open(sys.argv[2]) as fh:
    d = json.load(fh)
test = load_splits(cfg).test
ids = d["key"].get("ids")
assert ids is None or ids == [e.id for e in test], "the cached summaries are not the test split's"
rows = [text_metrics(e, s) for e, s in zip(test, d["value"])]
for m in ("rouge_1_neutral", "rouge_1_extractive", "copy_rate"):
    x = [r[m] for r in rows]
    lo, hi = bootstrap_mean_interval(x, seed=0)
    print(f"{m}: {sum(x) / len(x):.3f} [{lo:.3f}, {hi:.3f}] (n={len(x)})")
