"""Where a served comparison's time goes, and the served judge against a bare loop of the same requests.

    .venv/bin/python scripts/profile_served_judge.py [--pairs 16] [--concurrency 1 4 16] [--repeats 3] \
        [--out runs/profile_served.json]
    .venv/bin/python scripts/profile_served_judge.py --base-url http://HOST:8000 --model MODEL  # a vLLM running

Without ``--base-url`` it starts vLLM's OpenAI-compatible server (``make vllm``; ``judgeloop.testing.vllm``:
SmolLM2-135M-Instruct at float32 on a loopback port, one OpenMP thread unless ``OMP_NUM_THREADS`` says more)
with prefix caching off, so every run below asks the engine for the same work (``--prefix-caching`` keeps
it on and empties it before each run, ``POST /reset_prefix_cache`` of vLLM's dev mode, which the script
turns on: a pair's two orders then share their article's prefix). Each repeat judges the same ``--pairs``
SummEval pairs (both orders, ``max_length`` 512; ``--pairs-per-article``, default 1: a training loop's
shape) twice, in alternating order:

* ``judgeloop``: ``ServedJudge.score`` on the pairs (``route: vllm``, ``judge.server.concurrency`` requests
  in flight, no cache): rendering and tokenizing the prompts, the requests, reading the verdicts, masking;
* ``bare``: a loop with no judgeloop code in it, ``httpx.AsyncClient`` posting the same JSON bodies (built
  before the clock starts) with the same number in flight and reading the two verdict log-probabilities.

It reports comparisons/s (medians over the repeats) and their ratio (judgeloop / bare; the issue's goal is
>= 0.9), and the time of one request split by where it goes, from the server's own Prometheus counters
(``GET /metrics``, read before and after each run): the engine's queue, prefill and decode time
(``vllm:request_*_time_seconds``), its end-to-end time (``vllm:e2e_request_latency_seconds``: from the
request's arrival in the API server to its last token), the HTTP round trip and API server around it (the
bare loop's latency less the engine's end to end), and our client (judgeloop's latency less the bare
loop's). One more ``judgeloop`` run at the first concurrency runs under ``cProfile``: the client's CPU
seconds by where they are spent. Without the SummEval file it stops in one line (exit status 2).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import os
import platform
import pstats
import re
import signal
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_served_judge import SUMMEVAL  # noqa: E402

ENGINE = {
    "e2e_s": "vllm:e2e_request_latency_seconds",
    "queue_s": "vllm:request_queue_time_seconds",
    "prefill_s": "vllm:request_prefill_time_seconds",
    "decode_s": "vllm:request_decode_time_seconds",
    "inference_s": "vllm:request_inference_time_seconds",
}


def read_metrics(url: str) -> dict[str, float]:
    """The server's histogram sums and counts and its token counters (summed over label sets)."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    out: dict[str, float] = {}
    wanted = [*ENGINE.values(), "vllm:prompt_tokens", "vllm:prefix_cache_hits", "vllm:prefix_cache_queries"]
    for line in text.splitlines():
        m = re.match(r"^([a-z0-9_:]+?)(_sum|_count|_total)?(\{[^}]*\})? ([0-9.eE+-]+)$", line)
        if m and m.group(1) in wanted and m.group(2) in ("_sum", "_count", "_total"):
            key = m.group(1) + m.group(2)
            out[key] = out.get(key, 0.0) + float(m.group(4))
    return out


def engine_split(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Per request, the engine's mean seconds in each phase over a run (from two :func:`read_metrics`)."""
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    n = d.get(f"{ENGINE['e2e_s']}_count", 0.0)
    out = {"requests": n}
    for name, metric in ENGINE.items():
        out[name] = d.get(f"{metric}_sum", 0.0) / n if n else float("nan")
    out["prompt_tokens_per_request"] = d.get("vllm:prompt_tokens_total", 0.0) / n if n else float("nan")
    queries = d.get("vllm:prefix_cache_queries_total", 0.0)
    out["prefix_cache_hit_rate"] = d.get("vllm:prefix_cache_hits_total", 0.0) / queries if queries else 0.0
    return out


async def bare_loop(
    url: str, bodies: list[dict], concurrency: int, verdict_ids: tuple[int, int]
) -> list[float]:
    """Post ``bodies`` to ``/v1/completions``, ``concurrency`` in flight, and read each reply's two verdict
    log-probabilities: the work of a served comparison with no judgeloop code. The logits, in order."""
    gate = asyncio.Semaphore(concurrency)
    keys = [f"token_id:{t}" for t in verdict_ids]

    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=concurrency), timeout=600) as http:

        async def one(body: dict) -> float:
            async with gate:
                r = await http.post(f"{url}/v1/completions", json=body)
            top = r.json()["choices"][0]["logprobs"]["top_logprobs"][0]
            return top[keys[0]] - top[keys[1]]

        return await asyncio.gather(*(one(b) for b in bodies))


def article_pairs(n: int, per_article: int, path: Path) -> list[tuple[str, str, str]]:
    """``n`` (article, a, b) SummEval pairs, ``per_article`` of each article (its first system summaries
    against each other), shortest articles first: one per article is a training loop's shape, where only a
    pair's two orders share their article."""
    rows = sorted(
        (json.loads(x) for x in path.read_text().splitlines() if x.strip()), key=lambda r: len(r["article"])
    )
    out = []
    for row in rows:
        s = [x["text"] for x in row["summaries"]]
        both = [(row["article"], s[i], s[j]) for i in range(len(s)) for j in range(i + 1, len(s))]
        out += both[:per_article]
    return out[:n]


def reset_prefix_cache(url: str) -> bool:
    """Empty vLLM's prefix cache (``POST /reset_prefix_cache``, served when ``VLLM_SERVER_DEV_MODE=1``), so
    each run starts from none; whether the server did."""
    return httpx.post(f"{url}/reset_prefix_cache", timeout=60).status_code == 200


def timed(fn) -> tuple[object, float, float]:
    """``fn()``'s value, its wall seconds and this process's CPU seconds."""
    t0, c0 = time.perf_counter(), time.process_time()
    value = fn()
    return value, time.perf_counter() - t0, time.process_time() - c0


def client_profile(fn) -> dict:
    """``fn()`` under cProfile: the client's CPU seconds by where they go (own time of each function,
    grouped by package), and the ten largest functions outside the event loop's wait."""
    prof = cProfile.Profile()
    prof.runcall(fn)
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    groups: dict[str, float] = {}
    rows = []
    for (path, line, name), (_, _, tottime, _, _) in stats.items():
        if "select" in name and ("selectors" in path or path == "~"):
            group = "waiting for the server (select)"
        elif "/judgeloop/" in path:
            group = "judgeloop"
        elif re.search(r"/(tokenizers|transformers|jinja2)/", path) or "tokenizers" in name:
            group = "tokenizer and chat template"
        elif re.search(r"/(httpx|httpcore|h11|anyio|sniffio|certifi|idna)/", path):
            group = "httpx (HTTP client)"
        elif re.search(r"/(asyncio|selectors|ssl|socket)\.py|/asyncio/", path) or "socket" in name:
            group = "asyncio and sockets"
        elif "json" in path or "json" in name:
            group = "json"
        else:
            group = "other"
        groups[group] = groups.get(group, 0.0) + tottime
        if group != "waiting for the server (select)":
            rows.append((tottime, f"{Path(path).name}:{line} {name}"))
    rows.sort(reverse=True)
    return {
        "seconds_by_group": {k: round(v, 4) for k, v in sorted(groups.items(), key=lambda kv: -kv[1])},
        "top_functions": [[round(t, 4), where] for t, where in rows[:10]],
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=16, help="comparisons per run (both orders each)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16], help="requests in flight")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-length", type=int, default=512)
    ap.add_argument("--base-url", default="", help="a vLLM server already running (none is started)")
    ap.add_argument("--model", default="", help="with --base-url: the id it serves (and the tokenizer)")
    ap.add_argument("--pairs-per-article", type=int, default=1, help="pairs of each SummEval article")
    ap.add_argument(
        "--prefix-caching",
        action="store_true",
        help="leave vLLM's prefix caching on (emptied before each run, so a pair's two orders share their "
        "article and no run is served by another's)",
    )
    ap.add_argument("--summeval", type=Path, default=SUMMEVAL)
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    if not args.summeval.is_file():
        sys.stderr.write(
            f"profile_served_judge: error: --summeval {args.summeval} is not a file; put SummEval there or "
            "pass --summeval PATH\n"
        )
        raise SystemExit(2)
    for name in ("pairs", "repeats", "pairs_per_article", "max_length"):
        if getattr(args, name) < 1:
            sys.stderr.write(
                f"profile_served_judge: error: --{name.replace('_', '-')} {getattr(args, name)}; it must be at least 1\n"
            )
            raise SystemExit(2)
    if min(args.concurrency) < 1:
        sys.stderr.write(
            f"profile_served_judge: error: --concurrency {min(args.concurrency)}; every level must be at least 1\n"
        )
        raise SystemExit(2)
    if args.base_url and not args.model:
        sys.stderr.write("profile_served_judge: error: --base-url needs --model, the id the server serves\n")
        raise SystemExit(2)

    from judgeloop.judges import JudgeConfig, ServerConfig, build_judge
    from judgeloop.judges.base import Pair
    from judgeloop.testing import vllm

    proc = None
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a killed run stops the server it started
    if args.base_url:
        url, model = args.base_url.rstrip("/").removesuffix("/v1"), args.model
    else:
        if vllm.vllm_python() is None:
            sys.stderr.write("profile_served_judge: error: no vLLM environment; run `make vllm`\n")
            raise SystemExit(2)
        log = Path(args.out or "runs/profile_served.json").with_suffix(".server.log")
        log.parent.mkdir(parents=True, exist_ok=True)
        extra = () if args.prefix_caching else ("--no-enable-prefix-caching",)
        os.environ["VLLM_SERVER_DEV_MODE"] = "1"  # POST /reset_prefix_cache
        t0 = time.perf_counter()
        proc, url = vllm.start_server(log=log, extra=extra)
        print(f"vLLM ready in {time.perf_counter() - t0:.0f} s at {url}", flush=True)
        model = vllm.SMOLLM2
    pairs = [Pair(*p) for p in article_pairs(args.pairs, args.pairs_per_article, args.summeval)]
    load = [os.getloadavg()[0]]
    runs: dict[str, dict] = {}
    try:

        def judge_for(c: int):
            server = ServerConfig(
                base_url=url, model=model, route="vllm", concurrency=c, timeout_s=600, max_retries=0
            )
            return build_judge(
                JudgeConfig(
                    type="served",
                    model=model,
                    max_length=args.max_length,
                    batch_size=len(pairs),
                    cache_size=0,
                    server=server,
                )
            )

        warm = judge_for(1)
        warm.score(pairs[:2])  # the server's first requests (and the tokenizer's) out of the figures
        bodies = []
        for p in pairs:
            for order in (p, p.swapped()):
                ids, _ = warm.prompt_ids(order)
                bodies.append(
                    {
                        "model": model,
                        "prompt": ids,
                        "max_tokens": 1,
                        "temperature": 0.0,
                        "logprobs": 1,
                        "logprob_token_ids": list(warm.verdict_ids),
                        "return_tokens_as_token_ids": True,
                    }
                )
        for c in args.concurrency:
            judge = judge_for(c)
            arms = {"judgeloop": [], "bare": []}
            for r in range(args.repeats):
                order = ("judgeloop", "bare") if r % 2 == 0 else ("bare", "judgeloop")
                for arm in order:
                    if args.prefix_caching and not reset_prefix_cache(url):
                        sys.exit(
                            "profile_served_judge: the server does not reset its prefix cache (start it with "
                            "VLLM_SERVER_DEV_MODE=1, or leave out --prefix-caching)"
                        )
                    before = read_metrics(url)
                    if arm == "judgeloop":
                        out, wall, cpu = timed(lambda j=judge: j.score(pairs))
                        statuses = sorted(set(out.status))
                        ours = list(out.forward)
                    else:
                        out, wall, cpu = timed(
                            lambda c=c: asyncio.run(bare_loop(url, bodies, c, warm.verdict_ids))
                        )
                        statuses = ["ok"]
                        theirs = list(out[0::2])
                    eng = engine_split(before, read_metrics(url))
                    arms[arm].append(
                        {
                            "wall_s": wall,
                            "client_cpu_s": cpu,
                            "comparisons_per_s": len(pairs) / wall,
                            "statuses": statuses,
                            "engine": eng,
                        }
                    )
            med = {
                arm: {
                    "comparisons_per_s": statistics.median(x["comparisons_per_s"] for x in rs),
                    "seconds_per_request": statistics.median(x["wall_s"] for x in rs) / (2 * len(pairs)),
                    "client_cpu_ms_per_request": 1000
                    * statistics.median(x["client_cpu_s"] for x in rs)
                    / (2 * len(pairs)),
                    **{
                        f"engine_{k}": statistics.median(x["engine"][k] for x in rs)
                        for k in (*ENGINE, "prompt_tokens_per_request", "prefix_cache_hit_rate")
                    },
                }
                for arm, rs in arms.items()
            }
            ratio = med["judgeloop"]["comparisons_per_s"] / med["bare"]["comparisons_per_s"]
            # the same requests: the bare loop's forward logits are the judge's forward scores
            same = max(abs(a - b) for a, b in zip(ours, theirs))
            runs[str(c)] = {
                "median": med,
                "ratio_judgeloop_over_bare": ratio,
                "max_abs_diff_forward_logit": same,
                "repeats": arms,
            }
            j, b = med["judgeloop"], med["bare"]
            print(
                f"c={c:2d}  judgeloop {j['comparisons_per_s']:.3f} cmp/s  bare {b['comparisons_per_s']:.3f} cmp/s  "
                f"ratio {ratio:.3f}  | per request: judgeloop {1000 * j['seconds_per_request']:.1f} ms, bare "
                f"{1000 * b['seconds_per_request']:.1f} ms, engine e2e {1000 * b['engine_e2e_s']:.1f} ms "
                f"(queue {1000 * b['engine_queue_s']:.1f}, prefill {1000 * b['engine_prefill_s']:.1f}, decode "
                f"{1000 * b['engine_decode_s']:.1f}); client CPU judgeloop {j['client_cpu_ms_per_request']:.1f} "
                f"ms, bare {b['client_cpu_ms_per_request']:.1f} ms per request",
                flush=True,
            )
        profiled = judge_for(
            args.concurrency[0]
        )  # built (tokenizer loaded, server checked) outside the profile
        profile = client_profile(lambda: profiled.score(pairs))
        print("client CPU by group (cProfile, one judgeloop run):", json.dumps(profile["seconds_by_group"]))
    finally:
        if proc is not None:
            vllm.stop_server(proc)
    load.append(os.getloadavg()[0])
    report = {
        "server": f"vLLM at {url} serving {model}" + ("" if proc is None else " (judgeloop.testing.vllm)"),
        "prefix_caching": True if args.prefix_caching else (None if args.base_url else False),
        "pairs": args.pairs,
        "pairs_per_article": args.pairs_per_article,
        "requests_per_run": 2 * args.pairs,
        "repeats": args.repeats,
        "max_length": args.max_length,
        "articles": str(args.summeval),
        "cpus": os.cpu_count(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS", "1 (the server's default)"),
        "machine": platform.processor() or platform.machine(),
        "load_average_start_end": load,
        "runs": runs,
        "client_profile": profile,
    }
    print(f"load average {load[0]:.2f} -> {load[1]:.2f}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
