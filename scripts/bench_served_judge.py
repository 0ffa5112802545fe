"""Throughput and latency of the served judge against llama.cpp's server (``make llamacpp``) on loopback.

    .venv/bin/python scripts/bench_served_judge.py [--pairs 8] [--concurrency 1 4 16] \
        [--max-length 512] [--out runs/bench_served.json]
    .venv/bin/python scripts/bench_served_judge.py --base-url http://localhost:8000 --model MODEL \
        --route vllm --prompt-format ids    # a server already running (vLLM on a GPU: scripts/gpu_check.sh)

It starts ``python -m llama_cpp.server`` over SmolLM2-135M-Instruct's F32 GGUF (one thread,
``llamacpp.start_server``), then judges ``--pairs`` SummEval pairs (distinct prompts per run, so no run is
served by another's judgements) at 1, 4 and 16 pairs in flight, in four arms. Without the SummEval file
(``--summeval``, default ``../shared/data/summeval/summeval_dev.jsonl``) it stops in one line (exit status
2) unless ``--embedded-articles`` chooses the embedded corpus's short articles:

* ``logprobs/batched``: the served judge's ``top_logprobs`` route, both orders of a pair sent together;
* ``logprobs/sequential``: the same, the second order sent once the first has answered;
* ``text/batched`` and ``text/sequential``: a text-parsing judge of TRL's old kind, the same prompt with
  ``max_tokens=1`` and no log-probabilities, the sampled token read as the verdict.

A comparison is both orders of one pair; its latency runs from its first request to its last answer.
The table gives comparisons/s over the wall time and p50 / p99 latency; the arms alternate order between
concurrency levels so a change of the machine's load falls on all. ``--out`` writes the figures as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import time
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
SUMMEVAL = ROOT.parent / "shared" / "data" / "summeval" / "summeval_dev.jsonl"


def summeval_pairs(n: int, offset: int, path: Path | None) -> list[tuple[str, str, str]]:
    """``n`` distinct (article, a, b) pairs from the SummEval file at ``path``: 12 systems per article make
    66 pairs of each, shortest articles first. ``path=None`` (``--embedded-articles``): the embedded
    corpus's short articles, each with its first and last sentence as the two summaries (figures not
    comparable with the SummEval ones in docs/served.md)."""
    if path is None:
        from judgeloop.data.summarization import DataConfig, load_examples

        out = []
        for e in load_examples(DataConfig(format="embedded", embedded_size=max(40, n + offset))):
            sents = [x.strip().rstrip(".") + "." for x in e.article.split(". ") if x.strip()]
            if len(sents) >= 2:
                out.append((e.article, sents[0], sents[-1]))
        return out[offset : offset + n]
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    rows.sort(key=lambda r: len(r["article"]))
    out = []
    for row in rows:
        s = row["summaries"]
        out += [
            (row["article"], s[i]["text"], s[j]["text"]) for i in range(len(s)) for j in range(i + 1, len(s))
        ]
    return out[offset : offset + n]


async def run_arm(judge, pairs, route: str, concurrency: int, batched: bool, form: str = "text") -> dict:
    """Judge ``pairs`` on ``route`` with ``concurrency`` pairs in flight; latencies of each comparison."""
    from judgeloop.judges.base import Pair
    from judgeloop.judges.served import verdict_score

    client = judge.client
    prompts = []
    for article, a, b in pairs:
        p = Pair(article, a, b)
        prompts.append((judge.prompt_ids(p)[0], judge.prompt_ids(p.swapped())[0]))
    gate = asyncio.Semaphore(concurrency)
    from judgeloop.judges.served_client import _RateLimiter

    limiter = _RateLimiter(0, 0)
    wide = asyncio.Semaphore(2 * concurrency)  # the client's own gate: never the bottleneck here
    latencies, statuses = [], []
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=2 * concurrency)) as http:

        async def one(fwd, bwd):
            async with gate:
                t0 = time.perf_counter()
                post = lambda ids: client._post(http, wide, limiter, route, ids, judge._token_ids, form)  # noqa: E731
                if batched:
                    replies = await asyncio.gather(post(fwd), post(bwd))
                else:
                    replies = [await post(fwd), await post(bwd)]
                latencies.append(time.perf_counter() - t0)
                statuses.extend(verdict_score(r, judge.verdict_ids, judge.labels)[1] for r in replies)

        t0 = time.perf_counter()
        await asyncio.gather(*(one(f, b) for f, b in prompts))
        wall = time.perf_counter() - t0
    lat = np.array(latencies)
    return {
        "comparisons": len(pairs),
        "wall_s": round(wall, 3),
        "comparisons_per_s": round(len(pairs) / wall, 3),
        "p50_s": round(float(np.quantile(lat, 0.5)), 3),
        "p99_s": round(float(np.quantile(lat, 0.99)), 3),
        "statuses": {s: statuses.count(s) for s in sorted(set(statuses))},
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=8, help="comparisons per run")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument(
        "--max-length", type=int, default=512, help="judge.max_length (the article is cut to fit)"
    )
    ap.add_argument("--threads", type=int, default=1, help="llama.cpp's threads")
    ap.add_argument("--base-url", default="", help="a server already running (none is started)")
    ap.add_argument("--model", default="", help="with --base-url: the id it serves (and the tokenizer)")
    ap.add_argument("--route", default="top_logprobs", help="the logprob arm's route (vllm, sglang, ...)")
    ap.add_argument("--prompt-format", default="", help="ids or text (llama.cpp: text; else ids)")
    ap.add_argument("--out", default="")
    ap.add_argument("--summeval", type=Path, default=SUMMEVAL, help="the SummEval JSONL the pairs come from")
    ap.add_argument(
        "--embedded-articles",
        action="store_true",
        help="judge the embedded corpus's short articles instead of SummEval (not comparable with the docs)",
    )
    args = ap.parse_args(argv)
    if not args.embedded_articles and not args.summeval.is_file():
        sys.stderr.write(
            f"bench_served_judge: error: --summeval {args.summeval} is not a file; put SummEval there (the "
            "docs' figures are on it), pass --summeval PATH, or --embedded-articles for the short embedded "
            "articles (figures not comparable)\n"
        )
        raise SystemExit(2)
    articles = None if args.embedded_articles else args.summeval

    from judgeloop.judges import JudgeConfig, ServerConfig, build_judge
    from judgeloop.testing import llamacpp

    proc = None
    if args.base_url:
        if not args.model:
            sys.exit("--base-url needs --model: the model id the server serves")
        url, model, form = args.base_url, args.model, args.prompt_format or "ids"
    else:
        if not llamacpp.available():
            sys.exit("llama-cpp-python[server] is not installed: run `make llamacpp`")
        log = Path(args.out or "runs/bench_served.json").with_suffix(".server.log")
        log.parent.mkdir(parents=True, exist_ok=True)
        proc, url = llamacpp.start_server(log=log, threads=args.threads)
        model, form = llamacpp.SMOLLM2, args.prompt_format or "text"
    load = [os.getloadavg()[0]]
    results: dict[str, dict] = {}
    try:
        server = ServerConfig(
            base_url=url,
            model=model,
            route=args.route,
            prompt_format=form,  # type: ignore[arg-type]
            timeout_s=600,
            max_retries=0,
        )
        judge = build_judge(
            JudgeConfig(type="served", model=model, max_length=args.max_length, server=server)
        )
        arms = [(args.route, True), (args.route, False), ("text", True), ("text", False)]
        offset = 0
        for k, c in enumerate(args.concurrency):
            for route, batched in arms if k % 2 == 0 else arms[::-1]:
                pairs = summeval_pairs(args.pairs, offset, articles)
                offset += args.pairs
                name = f"{'text' if route == 'text' else 'logprobs'}/{'batched' if batched else 'sequential'}"
                results[f"{name}@{c}"] = r = asyncio.run(run_arm(judge, pairs, route, c, batched, form))
                print(
                    f"{name:22s} c={c:2d}  {r['comparisons_per_s']:6.3f} cmp/s  p50 {r['p50_s']:6.2f} s  "
                    f"p99 {r['p99_s']:6.2f} s  {r['statuses']}",
                    flush=True,
                )
    finally:
        if proc is not None:
            llamacpp.stop_server(proc)
    load.append(os.getloadavg()[0])
    report = {
        "server": (
            f"{args.base_url} ({judge.client.info.get('version')}), {model}, route {args.route}"
            if args.base_url
            else "llama-cpp-python[server] (llama.cpp), SmolLM2-135M-Instruct F32 GGUF (the wheel's Q4_1 "
            "dequantized), f32 KV cache"
        ),
        "threads": args.threads,
        "pairs": args.pairs,
        "articles": "embedded" if articles is None else str(articles),
        "max_length": args.max_length,
        "cpus": os.cpu_count(),
        "machine": platform.processor() or platform.machine(),
        "load_average_start_end": load,
        "results": results,
    }
    print(f"load average {load[0]:.2f} -> {load[1]:.2f}")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
