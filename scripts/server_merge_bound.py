"""How far a served answer is from the in-process judge's when the server merges requests.

    .venv/bin/python scripts/server_merge_bound.py --judge runs/cal/calibrated_judge/platt [--clients 16]

Starts ``judgeloop serve-judge`` on a free loopback port, posts ``--clients`` concurrent ``/v1/compare``
requests of ``--items`` comparisons each (texts from the embedded corpus, every request its own), which
the server merges into fewer judge calls, and compares each answer with ``CalibratedJudge.compare`` of
that request alone, in process, with a freshly loaded judge (no cache shared with the server). A merged
call pads its texts to the longest of the whole call, not of the request, so the floats may differ in
the last bits; this prints the largest difference in ``p`` and in ``logit`` and whether every status is
equal. The figures go to docs/serving.md with the date and the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np

from judgeloop.data import DataConfig, load_examples
from judgeloop.judges.calibrated import CalibratedJudge

ROOT = Path(__file__).resolve().parents[1]
JUDGELOOP = str(Path(sys.executable).parent / "judgeloop")


def requests_from_corpus(clients: int, items: int, seed: int) -> list[list[dict[str, str]]]:
    """``clients`` lists of ``items`` comparisons: an article and two of the corpus's reference summaries
    (its own or another's, so the lengths and the judgements vary)."""
    examples = load_examples(DataConfig(format="embedded"))
    rng = np.random.default_rng(seed)
    texts = sorted({s for ex in examples for refs in ex.references.values() for s in refs})
    out = []
    for _ in range(clients):
        batch = []
        for _ in range(items):
            ex = examples[int(rng.integers(len(examples)))]
            i, j = rng.choice(len(texts), 2, replace=False)
            batch.append({"prompt": ex.article, "a": texts[int(i)], "b": texts[int(j)]})
        out.append(batch)
    return out


async def post_all(url: str, batches: list[list[dict[str, str]]]) -> list[dict]:
    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        answers = await asyncio.gather(*(http.post("/v1/compare", json={"items": b}) for b in batches))
    for a in answers:
        a.raise_for_status()
    return [a.json() for a in answers]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--judge", required=True, help="a calibrated judge folder")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--items", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--server", nargs="*", default=["server.max_wait_ms=50"], help="serve-judge overrides"
    )
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    cmd = [
        JUDGELOOP,
        "serve-judge",
        "--config",
        str(ROOT / "configs/serve/judge.yaml"),
        f"judge_path={args.judge}",
        f"server.port={port}",
        *args.server,
    ]
    proc = subprocess.Popen(cmd, env=os.environ, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"the server exited {proc.returncode}: {' '.join(cmd)}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise SystemExit("the server did not come up in 180 s")
            time.sleep(0.2)
        batches = requests_from_corpus(args.clients, args.items, args.seed)
        served = asyncio.run(post_all(url, batches))
        stats = httpx.get(url + "/v1/info").json()["stats"]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    judge = CalibratedJudge.from_pretrained(args.judge)
    dp, dl, same_status, exact = 0.0, 0.0, True, 0
    for batch, got in zip(batches, served):
        alone = judge.compare([x["prompt"] for x in batch], [x["a"] for x in batch], [x["b"] for x in batch])
        p = np.array([np.nan if v is None else v for v in got["p"]], dtype=float)
        logit = np.array([np.nan if v is None else v for v in got["logit"]], dtype=float)
        dp = max(dp, float(np.nanmax(np.abs(p - alone.p))))
        dl = max(dl, float(np.nanmax(np.abs(logit - alone.logit))))
        same_status &= got["status"] == alone.status
        exact += int(np.array_equal(p, alone.p, equal_nan=True))
    print(
        json.dumps(
            {
                "judge": args.judge,
                "model": judge.config.model,
                "clients": args.clients,
                "items": args.items,
                "judge_calls": stats["judge_calls"],
                "mean_batch": stats["mean_batch"],
                "max_abs_dp": dp,
                "max_abs_dlogit": dl,
                "statuses_equal": same_status,
                "requests_bit_equal": exact,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
