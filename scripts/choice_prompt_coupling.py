"""The `choice` judge's coupling under two prompts on the same labeled pairs of a loop run.

Reads the step-0 calibration pairs a run shared (``OUTPUT_DIR/_shared/calibration_pairs-*.json`` of an
ablation: two samples of the starting policy per calibration article, labeled by neutral ROUGE-L, with the
run's judge's logits), scores them again with the run's judge under ``--prompt`` (every other judge setting
from the run's ``config.yaml``), and prints one JSON object per prompt: the judge's coupling
(:func:`judgeloop.calibration.coupling.judge_coupling`: AUC for the neutral label, the logit's correlation with
each style feature, copy_rate_diff among them) and its agreement with the label (the share of pairs where
the logit's sign picks the ROUGE-preferred summary, with its Wilson interval).

    python scripts/choice_prompt_coupling.py RUN_DIR/_shared/calibration_pairs-*.json \
        RUN_DIR/raw/seed0/config.yaml --prompt neutral
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import numpy as np

from judgeloop.calibration.coupling import judge_coupling
from judgeloop.config import load_config
from judgeloop.intervals import wilson_interval
from judgeloop.judges import build_judge
from judgeloop.loop.config import FeedbackLoopConfig


def agreement(scores: np.ndarray, labels: np.ndarray) -> dict:
    ok = np.isfinite(scores) & (scores != 0)
    k, n = int(((scores[ok] > 0) == (labels[ok] == 1)).sum()), int(ok.sum())
    lo, hi = wilson_interval(k, n) if n else (float("nan"), float("nan"))
    return {"k": k, "n": n, "rate": k / n if n else None, "wilson95": [lo, hi]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pairs", help="a calibration_pairs-*.json of a run's shared start work")
    parser.add_argument("config", help="the run's config.yaml (its judge)")
    parser.add_argument("--prompt", default="neutral")
    args = parser.parse_args()
    with open(args.pairs) as fh:
        pairs = json.load(fh)["value"]
    cfg = load_config(FeedbackLoopConfig, args.config)
    out = {}
    stored = np.asarray(pairs["scores"], dtype=float)
    labels = np.asarray(pairs["labels"])
    out[cfg.judge.prompt + " (the run's logits)"] = stored
    judge = build_judge(dataclasses.replace(cfg.judge, prompt=args.prompt, device="cpu"))
    res = judge(pairs["articles"], pairs["a"], pairs["b"], None)
    out[args.prompt] = np.where(res.valid, res.scores, np.nan)
    for name, scores in out.items():
        c = judge_coupling(scores.tolist(), labels.tolist(), pairs["articles"], pairs["a"], pairs["b"])
        print(json.dumps({"prompt": name, "coupling": c, "agreement_with_label": agreement(scores, labels)}))


if __name__ == "__main__":
    main()
