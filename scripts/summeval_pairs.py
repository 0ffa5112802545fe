"""Write SummEval summary pairs as a preference dataset (TRL's fields), the human label as its order.

    .venv/bin/python scripts/summeval_pairs.py --out runs/summeval_pairs.jsonl [--split test]

The pairs are those ``judgeloop calibrate`` builds (every pair of an article's rated summaries whose
expert relevance differs), from one split of the split fractions of
``configs/calibrate/summeval_embedding.yaml``, so a judge calibrated with that config is labeled on the
articles it was not fit on. ``chosen`` is the summary the experts rated higher.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from judgeloop.calibration.labels import build_labeled_pairs
from judgeloop.config import load_config
from judgeloop.data import load_examples, split_examples
from judgeloop.io import atomic_write_jsonl
from judgeloop.studies.calibration_lab import CalibrateConfig

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--split", default="test", choices=["calibration", "test"])
    parser.add_argument(
        "--data", default=str(ROOT.parent / "shared" / "data" / "summeval" / "summeval_dev.jsonl")
    )
    args = parser.parse_args()
    cfg = load_config(
        CalibrateConfig,
        ROOT / "configs" / "calibrate" / "summeval_embedding.yaml",
        [f"data.path={args.data}"],
    )
    examples = split_examples(load_examples(cfg.data), cfg.data.split)[args.split]
    pairs, stats = build_labeled_pairs(examples, cfg.labels, cfg.seed)
    rows = [
        {
            "prompt": p.article,
            "article": p.article,
            "chosen": p.a if p.label == 1 else p.b,
            "rejected": p.b if p.label == 1 else p.a,
            "references": list(p.references),
            "article_id": p.article_id,
        }
        for p in pairs
    ]
    atomic_write_jsonl(args.out, rows)
    print(f"{len(rows)} pairs from {len(examples)} {args.split} articles -> {args.out} ({stats.as_dict()})")


if __name__ == "__main__":
    main()
