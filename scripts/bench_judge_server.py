"""Throughput and latency of ``judgeloop serve-judge`` on loopback: batched vs ``max_batch_size=1``.

    .venv/bin/python scripts/bench_judge_server.py --judge runs/cal/calibrated_judge/platt \
        [--judge OTHER_DIR ...] [--clients 1 4 16] [--requests 5] [--items 8] [--out runs/bench_server.json]

For each judge folder and each server setting (batched: the config's ``max_batch_size`` /
``max_wait_ms``; unbatched: ``max_batch_size=1``, ``max_wait_ms=0``) it starts the real server as a
process on a free loopback port, then for 1, 4 and 16 concurrent clients has each client post
``--requests`` sequential ``/v1/compare`` requests of ``--items`` comparisons (distinct texts, so the
judge's caches do not answer them) and reports comparisons/s over the wall time and the p50 / p99
request latency. Clients and server share the machine's cores. Prints a Markdown table; ``--out``
writes the figures as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--judge", action="append", required=True, help="a calibrated judge folder (repeatable)")
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--requests", type=int, default=5, help="requests per client")
    ap.add_argument("--items", type=int, default=8, help="comparisons per request")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    settings = {"batched": [], "max_batch_size=1": ["server.max_batch_size=1", "server.max_wait_ms=0"]}
    rows = []
    for judge in args.judge:
        info = None
        for name, overrides in settings.items():
            proc, url = start(judge, overrides)
            try:
                info = httpx.get(url + "/v1/info").json()
                asyncio.run(load(url, 1, 2, args.items, seed=999))  # warm-up
                for c in args.clients:
                    before = httpx.get(url + "/v1/info").json()["stats"]
                    fig = asyncio.run(load(url, c, args.requests, args.items, seed=c))
                    after = httpx.get(url + "/v1/info").json()["stats"]
                    calls = after["judge_calls"] - before["judge_calls"]
                    batch = (after["comparisons"] - before["comparisons"]) / max(calls, 1)
                    rows.append({"judge": judge, "model": info["judge"]["model"], "server": name, "clients": c, **fig,
                                 "mean_batch": batch})  # fmt: skip
                    print(f"{info['judge']['model']} {name} clients={c}: {fig}", file=sys.stderr)
            finally:
                proc.terminate()
                proc.wait(timeout=60)
    print(f"\n{time.strftime('%Y-%m-%d')}, {platform.machine()} {platform.processor() or ''}, "
          f"{args.requests} requests x {args.items} comparisons per client\n")  # fmt: skip
    print("| judge | server | clients | comparisons/s | p50 ms | p99 ms | mean batch |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['server']} | {r['clients']} | {r['comparisons_per_s']:.0f} | "
              f"{r['p50_ms']:.0f} | {r['p99_ms']:.0f} | {r['mean_batch']:.1f} |")  # fmt: skip
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
