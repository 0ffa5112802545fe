"""What bounds the judge server's batching: the judge called in process, by call size, with its time split.

    .venv/bin/python scripts/profile_judge_server.py --judge runs/cal/calibrated_judge/platt \
        [--judge OTHER_DIR ...] [--sizes 1 8 32 80] [--comparisons 160] [--threads 1 2] \
        [--http [--server server.num_threads=1]] [--out runs/profile.json]

The server merges concurrent requests into one ``CalibratedJudge.compare`` call, so it can only be as
much faster as one call of N comparisons is per comparison than N calls of one. This script measures
that directly, without HTTP, for each judge folder (comparisons with distinct texts, as
``scripts/bench_judge_server.py`` sends them, so no cache answers them):

1. **compare by call size**: comparisons/s of ``compare`` calls of 1, 8, 32, 80 comparisons, the judge as
   saved and with ``batch_size`` raised to the largest size (the judge's own forward-pass batch caps
   what a merged call can batch);
2. **time split** per comparison at each call size: tokenizing, the model's forward passes, the
   calibrator, and the rest of the judge's Python (rendering, caches, pooling, padding), measured by
   timing the real tokenizer, model and calibrator the judge calls;
3. **the model alone**: forward passes/s at batch 1, 8, 32, 64 on texts of the bench's length;
4. **threads**: 1 and 2 run at each torch intra-op thread count of ``--threads`` (default: torch's
   own, which the server uses), and the count a worker thread sees
   (:class:`~judgeloop.serving.batcher.ComparisonBatcher` runs the judge on one);
5. with ``--http``: the real server on loopback with ``max_batch_size=1`` and ``max_wait_ms=0``, one
   client posting sequential requests of 8 comparisons: the time per comparison outside the judge
   (HTTP, JSON, validation, the event loop) is the wall time less the server's own ``judge_seconds``.

Prints Markdown tables; ``--out`` writes the figures as JSON. Run it on a quiet machine: it measures
CPU time-sharing as much as the judge on a busy one.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_judge_server import load, make_items, start  # noqa: E402  (a sibling script, not a package)

from judgeloop.judges.calibrated import CalibratedJudge  # noqa: E402

TIMERS: dict[str, float] = defaultdict(float)


class Timed:
    """A real component (tokenizer, model, calibrator) whose calls add their seconds to ``TIMERS[name]``;
    every other attribute is the component's own."""

    def __init__(self, inner: Any, name: str, methods: tuple[str, ...] = ()):
        self._inner, self._name, self._methods = inner, name, methods

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return self._inner(*args, **kwargs)
        finally:
            TIMERS[self._name] += time.perf_counter() - t0

    def __getattr__(self, attr: str) -> Any:
        value = getattr(self._inner, attr)
        if attr not in self._methods:
            return value

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return value(*args, **kwargs)
            finally:
                TIMERS[self._name] += time.perf_counter() - t0

        return timed


def instrument(judge: CalibratedJudge) -> None:
    """Time the judge's tokenizer, model and calibrator where the judge calls them."""
    inner = judge.judge
    assert inner is not None
    tok_methods = ("encode", "decode", "apply_chat_template", "convert_ids_to_tokens")
    if hasattr(inner, "tokenizer"):
        inner.tokenizer = Timed(inner.tokenizer, "tokenize", tok_methods)  # type: ignore[attr-defined]
    if hasattr(inner, "model"):
        inner.model = Timed(inner.model, "forward")  # type: ignore[attr-defined]
    judge.calibrator = Timed(judge.calibrator, "calibrate", ("predict_proba",))  # type: ignore[assignment]


def fresh(rng: np.random.Generator, n: int) -> tuple[list[str], list[str], list[str]]:
    items = make_items(rng, n)
    return [x["prompt"] for x in items], [x["a"] for x in items], [x["b"] for x in items]


def compare_by_size(
    judge: CalibratedJudge, sizes: list[int], comparisons: int, seed: int
) -> list[dict[str, float]]:
    """comparisons/s and the time split per comparison of ``compare`` calls of each size (distinct texts)."""
    rng = np.random.default_rng(seed)
    judge.compare(*fresh(rng, 2))  # warm-up: first-call allocations
    rows = []
    for size in sizes:
        calls = max(1, comparisons // size)
        TIMERS.clear()
        total = 0.0
        for _ in range(calls):
            prompts, a, b = fresh(rng, size)
            t0 = time.perf_counter()
            out = judge.compare(prompts, a, b)
            total += time.perf_counter() - t0
            assert len(out.p) == size
        n = calls * size
        split = {k: TIMERS[k] / n * 1000 for k in ("tokenize", "forward", "calibrate")}
        split["other"] = total / n * 1000 - sum(split.values())
        rows.append(
            {
                "size": size,
                "calls": calls,
                "comparisons_per_s": n / total,
                **{f"{k}_ms": v for k, v in split.items()},
            }
        )
        print(
            f"  {torch.get_num_threads()} threads, batch_size {judge.judge.batch_size}: {rows[-1]}",  # type: ignore[union-attr]
            file=sys.stderr,
            flush=True,
        )
    return rows


def model_alone(judge: CalibratedJudge, batches: list[int], seed: int) -> list[dict[str, float]]:
    """Forward passes/s of the judge's model on texts of the bench's length, at each batch size."""
    inner = judge.judge
    model = getattr(getattr(inner, "model", None), "_inner", None)
    tok = getattr(getattr(inner, "tokenizer", None), "_inner", None)
    if model is None or tok is None:
        return []
    rng = np.random.default_rng(seed)
    causal = hasattr(model, "generation_config")
    rows = []
    for batch in batches:
        texts = [x["prompt"] + " " + x["a"] for x in make_items(rng, batch)]
        if tok.pad_token is None:
            tok.pad_token = tok.eos_token
        enc = tok(texts, padding=True, return_tensors="pt")
        reps = max(2, 32 // batch)
        with torch.inference_mode():
            kwargs = {"logits_to_keep": 1} if causal else {}
            model(**enc, **kwargs)  # warm-up
            t0 = time.perf_counter()
            for _ in range(reps):
                model(**enc, **kwargs)
            wall = time.perf_counter() - t0
        rows.append(
            {"batch": batch, "tokens": int(enc["input_ids"].shape[1]), "texts_per_s": batch * reps / wall}
        )
    return rows


def judge_thread_threads() -> int:
    """torch's intra-op threads seen from a worker thread like the server's judge thread."""
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(torch.get_num_threads).result()


def http_overhead(path: str, items: int, requests: int, extra: list[str]) -> dict[str, float]:
    """Per comparison: wall time of sequential requests from one client, the server's judge time, and
    what is left (HTTP, JSON, validation, the event loop); the unbatched server, so no batching wait."""
    proc, url = start(path, [*extra, "server.max_batch_size=1", "server.max_wait_ms=0"])
    try:
        asyncio.run(load(url, 1, 2, items, seed=5))  # warm-up
        before = httpx.get(url + "/v1/info").json()["stats"]
        fig = asyncio.run(load(url, 1, requests, items, seed=6))
        after = httpx.get(url + "/v1/info").json()["stats"]
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    n = after["comparisons"] - before["comparisons"]
    judge_ms = (after["judge_seconds"] - before["judge_seconds"]) / n * 1000
    wall_ms = fig["wall_s"] / n * 1000
    return {
        "items": items,
        "requests": requests,
        "wall_ms": wall_ms,
        "judge_ms": judge_ms,
        "outside_judge_ms": wall_ms - judge_ms,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--judge", action="append", required=True, help="a calibrated judge folder (repeatable)")
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 8, 32, 80], help="comparisons per call")
    ap.add_argument(
        "--comparisons",
        type=int,
        nargs="+",
        default=[160],
        help="comparisons per measured size, one per judge or one for all",
    )
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64], help="model forward batches")
    ap.add_argument(
        "--threads",
        type=int,
        nargs="+",
        default=[torch.get_num_threads()],
        help="torch intra-op thread counts to measure at (default: torch's own)",
    )
    ap.add_argument("--http", action="store_true", help="also measure the time outside the judge over HTTP")
    ap.add_argument("--server", nargs="*", default=[], help="overrides for the --http server")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    counts = args.comparisons * len(args.judge) if len(args.comparisons) == 1 else args.comparisons
    if len(counts) != len(args.judge):
        raise SystemExit(f"--comparisons has {len(args.comparisons)} values for {len(args.judge)} judges")
    load_avg = os.getloadavg()
    print(
        f"{time.strftime('%Y-%m-%d %H:%M')}, {platform.machine()}, {os.cpu_count()} CPUs, load average "
        f"{load_avg[0]:.1f} at the start, torch {torch.__version__}\n"
    )
    report: list[dict[str, Any]] = []
    default_threads = torch.get_num_threads()
    for path, count in zip(args.judge, counts):
        judge = CalibratedJudge.from_pretrained(path)
        saved = judge.config.batch_size
        instrument(judge)
        entry: dict[str, Any] = {
            "judge": path,
            "name": f"{judge.config.type} {judge.config.model}",
            "batch_size": saved,
            "judge_thread_threads": judge_thread_threads(),
            "runs": [],
        }
        big = max(args.sizes) * 3  # texts of the largest call: a prompt and two summaries per comparison
        seed = 0
        for threads in args.threads:
            torch.set_num_threads(threads)
            for batch_size in [saved] + ([big] if big > saved else []):
                judge.judge.batch_size = batch_size  # type: ignore[union-attr]  (no meaning key)
                seed += 1
                rows = compare_by_size(judge, args.sizes, count, seed)
                entry["runs"].append({"threads": threads, "batch_size": batch_size, "rows": rows})
            judge.judge.batch_size = saved  # type: ignore[union-attr]
            seed += 1
            entry["runs"][-1]["model"] = model_alone(judge, args.batches, seed)
        torch.set_num_threads(default_threads)
        if args.http:
            entry["http"] = http_overhead(path, 8, 10, args.server)
        report.append(entry)
        print_entry(entry)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))


def print_entry(e: dict[str, Any]) -> None:
    print(f"## {e['name']} (`{e['judge']}`, saved with batch_size {e['batch_size']})\n")
    print(
        "| threads | judge batch_size | comparisons per call | comparisons/s | x vs 1 per call | tokenize | "
        "forward | calibrate | other |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for run in e["runs"]:
        base = run["rows"][0]["comparisons_per_s"]
        for r in run["rows"]:
            print(
                f"| {run['threads']} | {run['batch_size']} | {r['size']} | {r['comparisons_per_s']:.1f} | "
                f"{r['comparisons_per_s'] / base:.2f} | {r['tokenize_ms']:.2f} | {r['forward_ms']:.2f} | "
                f"{r['calibrate_ms']:.3f} | {r['other_ms']:.2f} |"
            )
    print("\n(tokenize (with chat-template rendering), forward, calibrate, other: ms per comparison)\n")
    print("| threads | model forward batch | tokens | texts/s | x vs batch 1 |")
    print("|---|---|---|---|---|")
    for run in e["runs"]:
        rows = run.get("model", [])
        for r in rows:
            print(
                f"| {run['threads']} | {r['batch']} | {r['tokens']} | {r['texts_per_s']:.1f} | "
                f"{r['texts_per_s'] / rows[0]['texts_per_s']:.2f} |"
            )
    print(f"\ntorch intra-op threads seen by a judge thread like the server's: {e['judge_thread_threads']}\n")
    if "http" in e:
        h = e["http"]
        print(
            f"HTTP, one client, {h['requests']} requests of {h['items']}, unbatched server: {h['wall_ms']:.1f} "
            f"ms per comparison, {h['judge_ms']:.1f} in the judge, {h['outside_judge_ms']:.1f} outside it\n"
        )


if __name__ == "__main__":
    main()
