"""A few steps of the feedback loop on one GPU with config-built models at real size: the check the
GPU-path issue asks for (single GPU, bf16 autocast, float32 master weights).

    python scripts/gpu_loop_check.py --device cuda --size real --out runs/gpu_check/loop
    .venv/bin/python scripts/gpu_loop_check.py --device cpu --size dry --out /tmp/loop_dry   # on CPU

The policy is Qwen2-0.5B-shaped and the judge encoder MiniLM-shaped, random weights (``bench_loop``'s
``build_models``); ``policy.dtype=bfloat16`` keeps the reference copy in bf16 and trains float32 master
weights under bf16 autocast. Prints (and writes ``check.json``): seconds per step, peak GPU memory, the
dtypes of the trained and the reference weights, the exported policy's dtype, and the run's final
metrics. Exits non-zero when the trained weights are not float32 or did not move.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    from bench_loop import build_models

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    ap.add_argument("--size", choices=["real", "dry"], default="real")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--out", type=Path, default=Path("runs/gpu_check/loop"))
    args = ap.parse_args()

    import torch
    from safetensors import safe_open

    from judgeloop.config import load_config
    from judgeloop.io import atomic_write_json
    from judgeloop.loop.config import FeedbackLoopConfig
    from judgeloop.recipes import train

    with tempfile.TemporaryDirectory() as tmp:
        models = build_models(args.size, Path(tmp) / "models")
        start = {}
        with safe_open(str(Path(tmp) / "models" / "policy" / "model.safetensors"), "pt") as f:
            for k in list(f.keys())[:8]:
                start[k] = f.get_tensor(k)
        cfg = load_config(
            FeedbackLoopConfig,
            ROOT / "configs" / "feedback_loop" / "tiny.yaml",
            [
                *models,
                f"device={args.device}",
                f"judge.device={args.device}",
                "policy.dtype=bfloat16",
                "policy.sft_steps=0",
                f"max_steps={args.steps}",
                "eval_every_n_steps=2",
                "num_eval_articles=16",
                "num_validation_articles=8",
                "calibration.min_points=4",
                "calibration.num_articles=16",
                "calibration.pairs_per_article=2",
                "generation.max_new_tokens=32",
                "batch_size=8",
                "judge_prefetch=false",
                "log_with=[jsonl]",
                "progress_bar=false",
                f"output_dir={args.out}",
            ],
        )
        t0 = time.perf_counter()
        report = train(cfg)
        seconds = time.perf_counter() - t0
    exported = args.out / "policy" / "model.safetensors"
    with safe_open(str(exported), "pt") as f:
        names = list(f.keys())  # noqa: SIM118 - a safetensors handle is not iterable
        dtypes = sorted({str(f.get_tensor(k).dtype) for k in names})
        moved = [
            k for k in start if k in names and not torch.equal(f.get_tensor(k).float(), start[k].float())
        ]
    steps = [r for r in report["train_log"]]
    out = {
        "device": args.device,
        "size": args.size,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "seconds_total": seconds,
        "steps": len(steps),
        "peak_gpu_mb": torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else None,
        "exported_dtypes": dtypes,
        "weights_moved": f"{len(moved)} of {len(start)} sampled tensors",
        "train_loss": [r["loss"] for r in steps],
        "final": {k: report["final"].get(k) for k in ("rouge_l_neutral", "kl", "win_rate", "ece")},
    }
    atomic_write_json(args.out / "check.json", out)
    print(json.dumps(out, indent=2))
    ok = dtypes == ["torch.float32"] and moved
    if not ok:
        print("FAILED: the trained weights must be float32 master weights that moved", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
