"""Parity of a served judge with the in-process ``choice`` judge on the same prompts (scripts/gpu_check.sh).

    python scripts/served_parity.py --base-url http://localhost:8011 --model MODEL_DIR --route vllm \
        [--device cuda] [--pairs 32] [--atol 0.05] [--out runs/gpu_check/served_parity.json]

Both judges read SmolLM2's verdict logit ``log P(A) - log P(B)`` (both orders, debiased) on the same pairs
(``bench_served_judge.summeval_pairs``: SummEval when the shared file is here, else the embedded corpus);
it prints the largest and mean difference of the scores, the decisions (signs) that agree, and the
statuses, and exits 1 when a score differs by more than ``--atol`` or a pair is not ``ok``/``truncated``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base-url", required=True)
    ap.add_argument(
        "--model", required=True, help="the id the server serves; also the tokenizer/weights here"
    )
    ap.add_argument("--route", default="vllm")
    ap.add_argument("--device", default="cpu", help="of the in-process choice judge")
    ap.add_argument("--pairs", type=int, default=32)
    ap.add_argument("--max-length", type=int, default=512)
    ap.add_argument("--atol", type=float, default=0.05, help="largest allowed score difference")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)

    from bench_served_judge import summeval_pairs

    from judgeloop.judges import JudgeConfig, ServerConfig, build_judge
    from judgeloop.judges.choice import ChoiceJudge

    pairs = summeval_pairs(args.pairs, 0)
    arts, a, b = (list(x) for x in zip(*pairs))
    server = ServerConfig(base_url=args.base_url, model=args.model, route=args.route, prompt_format="ids")  # type: ignore[arg-type]
    served = build_judge(
        JudgeConfig(type="served", model=args.model, max_length=args.max_length, server=server)
    )
    local = ChoiceJudge(args.model, device=args.device, max_length=args.max_length)
    got, ref = served(arts, a, b), local(arts, a, b)
    ok = got.valid & ref.valid
    diff = np.abs(got.scores[ok] - ref.scores[ok])
    report = {
        "server": served.client.info,
        "route": served.route,
        "pairs": len(pairs),
        "compared": int(ok.sum()),
        "max_abs_diff": float(diff.max()) if ok.any() else None,
        "mean_abs_diff": float(diff.mean()) if ok.any() else None,
        "decisions_agree": float(np.mean(np.sign(got.scores[ok]) == np.sign(ref.scores[ok])))
        if ok.any()
        else None,
        "statuses": {s: got.status.count(s) for s in sorted(set(got.status))},
        "atol": args.atol,
    }
    print(json.dumps(report, indent=2, default=str))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2, default=str) + "\n")
    if not ok.all() or report["max_abs_diff"] is None or report["max_abs_diff"] > args.atol:
        print(f"served_parity: FAILED (atol {args.atol}, {int((~got.valid).sum())} pairs not scored)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
