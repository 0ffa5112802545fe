"""Benchmark: our feedback loop vs TRL's online DPO on the tiny config, same steps, prompts and tokens.

    .venv/bin/python scripts/bench_loop.py --steps 8 --repeats 2 --json runs/bench_loop.json

Both sides train the tiny policy (random weights, so every sample runs to ``max_new_tokens``) on the same
prompts with two samples per prompt, the same batch size, max new tokens, temperature, beta and
optimizer, against the same judge: MiniLM similarity of the summary to the article. TRL's
``OnlineDPOTrainer`` takes it as a reward function (the judge's pointwise value), so our side runs
hard targets from the raw judge (the ``raw`` arm with ``loss.target=hard``, no evaluation, no
recalibration) to do the same work; it runs the judge prefetch as the config sets it (the tiny config:
on, with the cores split; ``--prefetch on|off`` overrides). Each measurement runs in a fresh
subprocess (peak RSS is per process), alternating ours and TRL's; the first step of each run is
warm-up and not timed. Prints median step time, prompts/s and peak RSS for each and the ratios
ours / peer, our time per phase, and TRL's time in the judge and in ``generate()``: the work both
loops share, which bounds what a faster loop around it can gain.

``--config configs/feedback_loop/quickstart.yaml`` runs the same comparison at the quickstart's scale:
SmolLM2-135M-Instruct with LoRA on both sides (TRL gets the same ``peft_config`` and, like our loop,
uses the base with adapters disabled as its reference); samples then stop at EOS on both sides.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "feedback_loop" / "tiny.yaml"


def _cfg(args: argparse.Namespace):
    from judgeloop.config import load_config
    from judgeloop.loop.config import FeedbackLoopConfig

    return load_config(
        FeedbackLoopConfig,
        args.config,
        [
            "policy.sft_steps=0",
            f"batch_size={args.batch_size}",
            f"generation.max_new_tokens={args.max_new_tokens}",
            "calibration.method=raw",
            # the judge both sides run: MiniLM similarity to the article, unstyled (TRL takes its pointwise
            # value as a reward; the quickstart's extractive target and style dial are pair-level features)
            "judge.embedding_target=article",
            "judge.style_weight=0",
            "loss.target=hard",
            "loss.kl_coef=0.0",
            "log_with=[jsonl]",
            "progress_bar=false",
            *args.set,
        ],
    )


def _prompts(cfg, n: int):
    from judgeloop.loop.rollout import PromptBuilder
    from judgeloop.loop.runner import load_splits
    from judgeloop.models import load_tokenizer

    splits = load_splits(cfg)
    tok = load_tokenizer(cfg.policy.model)
    builder = PromptBuilder(tok, cfg.policy)
    exs = [splits.train[i % len(splits.train)] for i in range(n)]
    return exs, builder, tok


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def worker_ours(args: argparse.Namespace) -> dict:
    import torch
    from accelerate import Accelerator

    from judgeloop.judges import build_judge
    from judgeloop.loop.losses import targets_from_probs
    from judgeloop.loop.policy import load_policy
    from judgeloop.loop.recalibration import build_calibrator, calibrate
    from judgeloop.loop.rollout import rollout
    from judgeloop.loop.runner import (
        JudgePrefetch,
        judge_step,
        make_optimizer,
        mixed_precision_kwargs,
        policy_update,
    )

    cfg = _cfg(args)
    exs, builder, _ = _prompts(cfg, args.batch_size * (args.steps + 1))
    acc = Accelerator(cpu=True, **mixed_precision_kwargs("bf16" if args.precision == "bf16" else "no"))
    model, tok, ref = load_policy(cfg.policy, 0)
    judge = build_judge(cfg.judge)
    cal = build_calibrator(cfg.calibration)
    opt, sched = make_optimizer(model, cfg)
    model, opt, sched = acc.prepare(model, opt, sched)
    times, phases = [], {"rollout": 0.0, "judge": 0.0, "update": 0.0}
    # as in the loop (runner.train): with judge_prefetch (the tiny config sets it) the next batch's
    # article embeddings are computed on a background thread while this batch generates and updates
    with acc.autocast():  # as runner.train: both passes and the judge (bf16 when asked); not generation
        enabled = cfg.judge_prefetch if args.prefetch == "config" else args.prefetch == "on"
        prefetch = JudgePrefetch(judge, enabled, cfg.judge_prefetch_threads)
        try:
            prefetch.start(exs[: args.batch_size])
            for step in range(args.steps + 1):
                batch = exs[step * args.batch_size : (step + 1) * args.batch_size]
                t0 = time.perf_counter()
                roll = rollout(model, tok, builder, [e.article for e in batch], cfg.generation, seed=step)
                t1 = time.perf_counter()
                prefetch.wait()
                judged = judge_step(judge, batch, roll)
                if step < args.steps:
                    prefetch.start(exs[(step + 1) * args.batch_size : (step + 2) * args.batch_size])
                p = calibrate(cal, judged.scores, roll.articles, roll.a_text, roll.b_text)
                t2 = time.perf_counter()
                targets, mask = targets_from_probs(torch.tensor(p, dtype=torch.float32), "hard")
                policy_update(
                    acc,
                    model,
                    ref,
                    opt,
                    sched,
                    roll,
                    targets,
                    mask,
                    0.0,
                    cfg.loss,
                    cfg.optim.max_grad_norm,
                    tok.pad_token_id,
                )
                t3 = time.perf_counter()
                if step:
                    times.append(t3 - t0)
                    phases["rollout"] += t1 - t0
                    phases["judge"] += t2 - t1
                    phases["update"] += t3 - t2
        finally:  # as the loop: no prefetch thread, and the caller's thread count back, on any error
            prefetch.close()
    return {"step_times": times, "phases_s": phases, "peak_rss_mb": _peak_rss_mb()}


def worker_peer(args: argparse.Namespace) -> dict:
    import copy

    from datasets import Dataset
    from transformers import TrainerCallback
    from trl.experimental.online_dpo import OnlineDPOConfig, OnlineDPOTrainer

    from judgeloop.judges import build_judge
    from judgeloop.loop.policy import load_policy

    cfg = _cfg(args)
    exs, builder, tok = _prompts(cfg, args.batch_size * (args.steps + 1))
    peft_config = None
    if cfg.policy.lora:  # TRL gets the same LoRA set-up; its reference is then the base with adapters off
        from peft import LoraConfig

        from judgeloop.models import load_causal_lm

        model, ref = load_causal_lm(cfg.policy.model, dtype=cfg.policy.dtype), None
        peft_config = LoraConfig(
            r=cfg.policy.lora_r,
            lora_alpha=cfg.policy.lora_alpha,
            lora_dropout=cfg.policy.lora_dropout,
            target_modules=list(cfg.policy.lora_target_modules),
            task_type="CAUSAL_LM",
        )
    else:
        model, tok, _ = load_policy(cfg.policy, 0)
        ref = copy.deepcopy(model).eval()
    judge = build_judge(cfg.judge)
    # where TRL's step goes: the judge and generate() are the same code our loop runs; the rest is the loop
    spent = {"judge": 0.0, "generate": 0.0}

    def judge_reward(prompts, completions, article, **kwargs):
        # the judge's pointwise value v(summary) = scale * cos(summary, article); s(a, b) = v(a) - v(b)
        t = time.perf_counter()
        vals = judge._values_for([(a, c, ()) for a, c in zip(article, completions)])
        spent["judge"] += time.perf_counter() - t
        return [v if st in ("ok", "truncated") else -1e3 for v, st in vals]

    inner_generate = model.generate  # TRL calls it on this model (through peft's wrapper under LoRA)

    def timed_generate(*a, **k):
        t = time.perf_counter()
        out = inner_generate(*a, **k)
        spent["generate"] += time.perf_counter() - t
        return out

    model.generate = timed_generate

    prompts = [tok.decode(builder(e.article)) for e in exs]
    ds = Dataset.from_list([{"prompt": p, "article": e.article} for p, e in zip(prompts, exs)])
    times: list[float] = []
    phases = {"judge": 0.0, "generate": 0.0}

    class Timer(TrainerCallback):
        def on_step_begin(self, a, state, control, **kw):
            self.t0, self.before = time.perf_counter(), dict(spent)

        def on_step_end(self, a, state, control, **kw):
            times.append(time.perf_counter() - self.t0)
            if len(times) > 1:  # the first step is warm-up, as for the step times
                for k in phases:
                    phases[k] += spent[k] - self.before[k]

    with tempfile.TemporaryDirectory() as out:
        targs = OnlineDPOConfig(
            output_dir=out,
            per_device_train_batch_size=args.batch_size,
            max_new_tokens=args.max_new_tokens,
            temperature=cfg.generation.temperature,
            beta=cfg.loss.beta,
            learning_rate=cfg.optim.learning_rate,
            max_steps=args.steps + 1,
            report_to=[],
            use_cpu=True,
            logging_steps=10_000,
            save_strategy="no",
            gradient_checkpointing=False,
            dataloader_drop_last=True,
            seed=0,
            lr_scheduler_type="constant",
            max_grad_norm=cfg.optim.max_grad_norm,
            bf16=args.precision == "bf16",
        )
        trainer = OnlineDPOTrainer(
            model=model,
            ref_model=ref,
            reward_funcs=judge_reward,
            args=targs,
            train_dataset=ds,
            processing_class=tok,
            peft_config=peft_config,
            callbacks=[Timer()],
        )
        trainer.train()
    return {"step_times": times[1:], "phases_s": phases, "peak_rss_mb": _peak_rss_mb()}


def summarize(runs: list[dict], batch_size: int) -> dict:
    med = statistics.median([t for r in runs for t in r["step_times"]])
    out = {
        "median_step_s": med,
        "prompts_per_s": batch_size / med,
        "peak_rss_mb": max(r["peak_rss_mb"] for r in runs),
        "runs": len(runs),
    }
    if "phases_s" in runs[0]:
        out["phases_s"] = {k: sum(r["phases_s"][k] for r in runs) for k in runs[0]["phases_s"]}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(CONFIG), help="feedback-loop config (default: the tiny one)")
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="config override applied to both sides, e.g. --set policy.dtype=bfloat16 (repeatable)",
    )
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--json", default=None, help="write {ours, peer, ratio} here")
    ap.add_argument(
        "--prefetch",
        choices=["config", "on", "off"],
        default="config",
        help="ours: the judge prefetch thread as the config says (tiny: on, with the cores split), or forced",
    )
    ap.add_argument(
        "--precision",
        choices=["no", "bf16"],
        default="no",
        help="both sides: bf16 autocast (ours: mixed_precision=bf16; TRL: bf16=True)",
    )
    ap.add_argument("--worker", choices=["ours", "peer"], help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        res = worker_ours(args) if args.worker == "ours" else worker_peer(args)
        Path(args.out).write_text(json.dumps(res))
        return 0
    env = dict(
        os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"), TOKENIZERS_PARALLELISM="false"
    )
    results: dict[str, list[dict]] = {"ours": [], "peer": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            for impl in ("ours", "peer"):  # alternate, so load changes on a shared machine hit both
                out = Path(tmp) / f"{impl}{r}.json"
                cmd = [
                    sys.executable,
                    __file__,
                    "--worker",
                    impl,
                    "--out",
                    str(out),
                    "--steps",
                    str(args.steps),
                    "--batch-size",
                    str(args.batch_size),
                    "--max-new-tokens",
                    str(args.max_new_tokens),
                    "--config",
                    args.config,
                    "--precision",
                    args.precision,
                    *[f"--set={kv}" for kv in args.set],
                    "--prefetch",
                    args.prefetch,
                ]
                subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
                results[impl].append(json.loads(out.read_text()))
                print(
                    f"{impl} run {r}: median step {statistics.median(results[impl][-1]['step_times']):.3f}s, "
                    f"peak RSS {results[impl][-1]['peak_rss_mb']:.0f} MB",
                    flush=True,
                )
    ours, peer = summarize(results["ours"], args.batch_size), summarize(results["peer"], args.batch_size)
    ratio = {
        "throughput": ours["prompts_per_s"] / peer["prompts_per_s"],
        "peak_rss": ours["peak_rss_mb"] / peer["peak_rss_mb"],
    }
    print(f"{'':6} {'median step s':>14} {'prompts/s':>10} {'peak RSS MB':>12}")
    for name, s in (("ours", ours), ("trl", peer)):
        print(f"{name:6} {s['median_step_s']:14.3f} {s['prompts_per_s']:10.2f} {s['peak_rss_mb']:12.0f}")
    print(f"ratio ours/trl: throughput {ratio['throughput']:.2f}x, peak RSS {ratio['peak_rss']:.2f}x")
    print("ours, time per phase (s, all timed steps):", {k: round(v, 2) for k, v in ours["phases_s"].items()})
    total = sum(sum(r["step_times"]) for r in results["peer"])
    shared = peer["phases_s"]["judge"] + peer["phases_s"]["generate"]
    print(
        "trl, time per phase (s, all timed steps):",
        {k: round(v, 2) for k, v in peer["phases_s"].items()},
        f"of {total:.2f}: the judge and generate(), which both loops run alike, are {shared / total:.0%} of "
        f"TRL's step, so a loop that only did the rest faster, without running them on spare cores, gains at "
        f"most {total / shared:.2f}x",
    )
    peer["shared_share"] = shared / total
    if args.json:
        from judgeloop.io import atomic_write_json

        atomic_write_json(
            args.json,
            {
                "ours": ours,
                "peer": peer,
                "ratio": ratio,
                "settings": {
                    "steps": args.steps,
                    "repeats": args.repeats,
                    "batch_size": args.batch_size,
                    "max_new_tokens": args.max_new_tokens,
                    "prefetch": args.prefetch,
                    "config": args.config,
                    "precision": args.precision,
                    "overrides": args.set,
                },
            },
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
