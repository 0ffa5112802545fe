"""Write SummEval summary pairs as a preference dataset (TRL's fields), the human label as its order.

    .venv/bin/python scripts/summeval_pairs.py --out runs/summeval_pairs.jsonl [--split test] [--chat]

The pairs are those ``judgeloop calibrate`` builds (every pair of an article's rated summaries whose
expert relevance differs), from one split of the split fractions of
``configs/calibrate/summeval_embedding.yaml``, so a judge calibrated with that config is labeled on the
articles it was not fit on. ``chosen`` is the summary the experts rated higher.

``prompt`` is the instruction a policy trained on the pairs is given: the feedback loop's own prompt
(``policy.prompt_template`` of :class:`judgeloop.loop.config.PolicyConfig`, "Summarize the following
text in one short sentence." and the article; ``--prompt-template`` for another), so a DPO run on the
labeled dataset learns to answer that instruction. ``article`` keeps the bare article, the text the judge
reads (``data.fields.source: article`` in ``configs/label_pairs/summeval.yaml``). ``--chat`` writes TRL's
conversational format (the prompt a user message, each summary an assistant message); ``label-pairs``
keeps whichever format it reads.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from judgeloop.calibration.labels import build_labeled_pairs
from judgeloop.config import load_config
from judgeloop.data import load_examples, split_examples
from judgeloop.io import atomic_write_jsonl
from judgeloop.loop.config import PolicyConfig
from judgeloop.studies.calibration_lab import CalibrateConfig

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--split", default="test", choices=["calibration", "test"])
    parser.add_argument(
        "--data", default=str(ROOT.parent / "shared" / "data" / "summeval" / "summeval_dev.jsonl")
    )
    parser.add_argument(
        "--prompt-template",
        default=PolicyConfig.prompt_template,
        help="the instruction prompt, with an {article} placeholder (default: the feedback loop's)",
    )
    parser.add_argument("--chat", action="store_true", help="TRL's conversational format (messages)")
    args = parser.parse_args()
    template = PolicyConfig(prompt_template=args.prompt_template).prompt_template  # checks {article}
    cfg = load_config(
        CalibrateConfig,
        ROOT / "configs" / "calibrate" / "summeval_embedding.yaml",
        [f"data.path={args.data}"],
    )
    examples = split_examples(load_examples(cfg.data), cfg.data.split)[args.split]
    pairs, stats = build_labeled_pairs(examples, cfg.labels, cfg.seed)
    rows = []
    for p in pairs:
        prompt: object = template.format(article=p.article)
        chosen: object = p.a if p.label == 1 else p.b
        rejected: object = p.b if p.label == 1 else p.a
        if args.chat:
            prompt = [{"role": "user", "content": prompt}]
            chosen = [{"role": "assistant", "content": chosen}]
            rejected = [{"role": "assistant", "content": rejected}]
        rows.append(
            {
                "prompt": prompt,
                "article": p.article,
                "chosen": chosen,
                "rejected": rejected,
                "references": list(p.references),
                "article_id": p.article_id,
            }
        )
    atomic_write_jsonl(args.out, rows)
    print(f"{len(rows)} pairs from {len(examples)} {args.split} articles -> {args.out} ({stats.as_dict()})")


if __name__ == "__main__":
    main()
