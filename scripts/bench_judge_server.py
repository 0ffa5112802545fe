"""Throughput and latency of ``judgeloop serve-judge`` on loopback: batched vs ``max_batch_size=1``.

    .venv/bin/python scripts/bench_judge_server.py --judge runs/cal/calibrated_judge/platt \
        [--judge runs/cal_choice/calibrated_judge/platt] [--clients 1 4 16] [--requests 5 1] \
        [--items 8 2] [--server server.num_threads=1] [--out runs/bench_server.json]

For each judge folder it starts two real servers as processes on free loopback ports, batched (the
config's ``max_batch_size`` / ``max_wait_ms``) and unbatched (``max_batch_size=1``, ``max_wait_ms=0``),
then for 1, 4 and 16 concurrent clients has each client post ``--requests`` sequential ``/v1/compare``
requests of ``--items`` comparisons (distinct texts, so the judge's caches do not answer them) and
reports comparisons/s over the wall time and the p50 / p99 request latency. The two arms alternate
(batched then unbatched at one client count, the other order at the next), so a change in the
machine's load falls on both. ``--requests`` and ``--items`` take one value per judge (a slow judge
gets a smaller load) or one for all. Clients and servers share the machine's cores; the load average at
the start and the end is printed with the table. ``--out`` writes the figures as JSON.

The SmolLM2 choice judge for it (a small calibration on SummEval, about 2 minutes on 2 CPU cores)::

    .venv/bin/judgeloop calibrate --config configs/calibrate/summeval_choice.yaml max_fit_articles=8 \
        max_eval_articles=4 max_pairs_per_article=4 judge.max_length=512 methods=[platt] \
        output_dir=runs/cal_choice
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
CONFIG = str(ROOT / "configs" / "serve" / "judge.yaml")
WORDS = [
    "council",
    "city",
    "bus",
    "network",
    "northern",
    "suburbs",
    "demand",
    "study",
    "walking",
    "blood",
    "pressure",
    "adults",
    "club",
    "coach",
    "season",
    "river",
    "bridge",
    "storm",
    "rain",
    "school",
    "budget",
    "teachers",
    "election",
    "vote",
    "market",
    "prices",
    "energy",
    "wind",
    "solar",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(judge: str, overrides: list[str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    exe = str(Path(sys.executable).parent / "judgeloop")
    cmd = [exe, "serve-judge", "--config", CONFIG, f"judge_path={judge}", f"server.port={port}", *overrides]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited {proc.returncode}: {' '.join(cmd)}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise SystemExit("server did not start in 300 s")


def text(rng: np.random.Generator, n: int) -> str:
    return " ".join(rng.choice(WORDS, n))


def make_items(rng: np.random.Generator, n: int) -> list[dict[str, str]]:
    return [
        {
            "prompt": text(rng, 60),
            "a": text(rng, int(rng.integers(8, 30))),
            "b": text(rng, int(rng.integers(8, 30))),
        }
        for _ in range(n)
    ]


async def load(url: str, clients: int, requests: int, items: int, seed: int) -> dict[str, float]:
    rng = np.random.default_rng(seed)
    bodies = [[{"items": make_items(rng, items)} for _ in range(requests)] for _ in range(clients)]
    latencies: list[float] = []

    async def client(mine: list[dict]) -> None:
        async with httpx.AsyncClient(base_url=url, timeout=600) as http:
            for body in mine:
                t0 = time.perf_counter()
                r = await http.post("/v1/compare", json=body)
                latencies.append(time.perf_counter() - t0)
                assert r.status_code == 200, r.text

    t0 = time.perf_counter()
    await asyncio.gather(*(client(b) for b in bodies))
    wall = time.perf_counter() - t0
    lat = np.array(latencies) * 1000
    return {
        "comparisons_per_s": clients * requests * items / wall,
        "p50_ms": float(np.percentile(lat, 50)),
        "p99_ms": float(np.percentile(lat, 99)),
        "wall_s": wall,
    }


SETTINGS = {"batched": [], "max_batch_size=1": ["server.max_batch_size=1", "server.max_wait_ms=0"]}


def per_judge(values: list[int], judges: list[str], flag: str) -> list[int]:
    if len(values) == 1:
        return values * len(judges)
    if len(values) != len(judges):
        raise SystemExit(
            f"{flag} has {len(values)} values for {len(judges)} --judge folders; give one or one each"
        )
    return values


def bench_judge(judge: str, clients: list[int], requests: int, items: int, extra: list[str]) -> list[dict]:
    """Both servers of one judge (``extra``: overrides for both), the arms alternating at each client count."""
    servers = {name: start(judge, [*extra, *overrides]) for name, overrides in SETTINGS.items()}
    rows = []
    try:
        info = httpx.get(servers["batched"][1] + "/v1/info").json()
        for _, url in servers.values():
            asyncio.run(load(url, 1, 2, items, seed=999))  # warm-up
        for k, c in enumerate(clients):
            for name in list(SETTINGS) if k % 2 == 0 else list(SETTINGS)[::-1]:
                url = servers[name][1]
                before = httpx.get(url + "/v1/info").json()["stats"]
                fig = asyncio.run(load(url, c, requests, items, seed=c))  # the same texts for both arms
                after = httpx.get(url + "/v1/info").json()["stats"]
                calls = after["judge_calls"] - before["judge_calls"]
                batch = (after["comparisons"] - before["comparisons"]) / max(calls, 1)
                rows.append(
                    {
                        "judge": judge,
                        "model": info["judge"]["model"],
                        "type": info["judge"]["type"],
                        "server": name,
                        "clients": c,
                        "requests": requests,
                        "items": items,
                        **fig,
                        "mean_batch": batch,
                    }
                )
                print(f"{info['judge']['model']} {name} clients={c}: {fig}", file=sys.stderr)
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(timeout=60)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--judge", action="append", required=True, help="a calibrated judge folder (repeatable)")
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--requests", type=int, nargs="+", default=[5], help="requests per client (per judge)")
    ap.add_argument("--items", type=int, nargs="+", default=[8], help="comparisons per request (per judge)")
    ap.add_argument(
        "--server", nargs="*", default=[], help="overrides for both servers, e.g. server.num_threads=1"
    )
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    requests = per_judge(args.requests, args.judge, "--requests")
    items = per_judge(args.items, args.judge, "--items")
    load_start, t0 = os.getloadavg()[0], time.time()
    rows = []
    for judge, r, n in zip(args.judge, requests, items):
        rows += bench_judge(judge, args.clients, r, n, args.server)
    load_end = os.getloadavg()[0]
    print(
        f"\n{time.strftime('%Y-%m-%d %H:%M', time.localtime(t0))}, {platform.machine()}, {os.cpu_count()} CPUs, "
        f"load average {load_start:.1f} at the start and {load_end:.1f} at the end, "
        f"{time.time() - t0:.0f} s; server overrides {args.server or 'none'}\n"
    )
    print(
        "| judge | server | clients | requests x comparisons per client | comparisons/s | p50 ms | p99 ms | "
        "mean batch |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['model']} | {r['server']} | {r['clients']} | {r['requests']} x {r['items']} | "
            f"{r['comparisons_per_s']:.1f} | {r['p50_ms']:.0f} | {r['p99_ms']:.0f} | {r['mean_batch']:.1f} |"
        )
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
