"""Run the ``choice`` judge (both orders) on a sample of SummEval pairs; print accuracy and position bias.

A pair is two system summaries of the same article whose mean expert rating on ``--dimension``
differs; the label says which one the experts rated higher. Pairs are drawn deterministically
(``--seed``), at most ``--per-article`` per article, and which summary is shown first is random,
so "always prefer A" scores 50%.

    python scripts/choice_judge_sample.py ../shared/data/summeval/summeval_dev.jsonl --pairs 60

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import time

import numpy as np

from judgeloop.io import read_jsonl
from judgeloop.judges import JudgeConfig, Pair, build_judge


def sample_pairs(rows: list[dict], n_pairs: int, per_article: int, dimension: str, seed: int) -> list[tuple]:
    rng = random.Random(seed)
    per: list[list[tuple]] = []
    for row in rows:
        cands = []
        for x, y in itertools.combinations(row["summaries"], 2):
            rx, ry = x["expert"][dimension], y["expert"][dimension]
            if rx != ry and x["text"].strip() != y["text"].strip():
                cands.append((x, y))
        rng.shuffle(cands)
        per.append([(row, x, y) for x, y in cands[:per_article]])
    flat = [t for group in per for t in group]
    rng.shuffle(flat)
    out = []
    for row, x, y in flat[:n_pairs]:
        if rng.random() < 0.5:
            x, y = y, x
        out.append((row, x, y, int(x["expert"][dimension] > y["expert"][dimension])))
    # pairs of one article side by side: the judge reuses the article prompt prefix between them
    order = {row["id"]: i for i, row in enumerate(rows)}
    return sorted(out, key=lambda t: order[t[0]["id"]])


def accuracy(scores: np.ndarray, labels: np.ndarray) -> float:
    ok = np.isfinite(scores)
    pred = np.where(scores[ok] > 0, 1.0, np.where(scores[ok] < 0, 0.0, 0.5))  # a tie counts half
    return float(np.mean(pred == labels[ok]) + 0.5 * np.mean(pred == 0.5)) if ok.any() else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("data", help="summeval_dev.jsonl")
    parser.add_argument("--pairs", type=int, default=60)
    parser.add_argument("--per-article", type=int, default=2)
    parser.add_argument("--dimension", default="relevance")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    parser.add_argument("--prompt", default="neutral")
    parser.add_argument("--max-length", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=4)
    args = parser.parse_args()

    rows = read_jsonl(args.data, required=["id", "article", "summaries"])
    sample = sample_pairs(rows, args.pairs, args.per_article, args.dimension, args.seed)
    labels = np.array([y for *_, y in sample], dtype=float)
    cfg = JudgeConfig(
        type="choice",
        model=args.model,
        prompt=args.prompt,
        position_debias=True,
        max_length=args.max_length,
        batch_size=args.batch_size,
    )
    t0 = time.time()
    judge = build_judge(cfg)
    load_s = time.time() - t0
    t0 = time.time()
    out = judge.score([Pair(row["article"], x["text"], y["text"]) for row, x, y, _ in sample])
    score_s = time.time() - t0
    valid = out.valid
    fwd, rev = out.forward, out.reverse
    assert rev is not None
    both = valid & np.isfinite(fwd) & np.isfinite(rev)
    result = {
        "data": args.data,
        "model": args.model,
        "prompt": args.prompt,
        "dimension": args.dimension,
        "n_pairs": len(sample),
        "n_articles": len({row["id"] for row, *_ in sample}),
        "label_balance_a_better": float(labels.mean()),
        "status": out.status_counts(),
        "accuracy_debiased": accuracy(out.scores, labels),
        "accuracy_forward_order_only": accuracy(np.where(both, fwd, np.nan), labels),
        "accuracy_reverse_order_only": accuracy(np.where(both, -rev, np.nan), labels),
        "position_bias_mean_s_ab_plus_s_ba": out.position_bias(),
        "frac_first_shown_preferred_forward": float(np.mean(fwd[both] > 0)),
        "frac_first_shown_preferred_reverse": float(np.mean(rev[both] > 0)),
        "frac_same_verdict_both_orders": float(np.mean(np.sign(fwd[both]) == -np.sign(rev[both]))),
        "mean_abs_debiased_score": float(np.mean(np.abs(out.scores[valid]))),
        "mean_abs_forward_score": float(np.mean(np.abs(fwd[both]))),
        "mean_verdict_mass_p_a_plus_p_b": judge.mean_verdict_mass,  # type: ignore[attr-defined]
        "load_seconds": round(load_s, 1),
        "score_seconds": round(score_s, 1),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
