"""The served `choice` judge with a prompt (``judge.prompt``) against the in-process one, on a few embedded pairs.

Starts a real llama.cpp server (``python -m llama_cpp.server``, ``make llamacpp``) on a free loopback port
over SmolLM2-135M-Instruct's F32 GGUF (docs/served.md "Tested"), builds ``judge.type: served`` and
``judge.type: choice`` with the same prompt, scores the same (lead, neutral reference) pairs of the embedded
corpus in one order, and prints one JSON object: each judge's logits and the largest difference.

    python scripts/served_prompt_check.py --prompt extractive_bias --pairs 4
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import time
import urllib.request

import numpy as np

from judgeloop.data import DataConfig, load_examples
from judgeloop.judges import JudgeConfig, build_judge
from judgeloop.judges.served_client import ServerConfig
from judgeloop.serving.llamacpp import smollm2_f32_gguf

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", default="extractive_bias")
    parser.add_argument("--pairs", type=int, default=4)
    args = parser.parse_args()
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "llama_cpp.server",
        "--model",
        str(smollm2_f32_gguf()),
        "--logits_all",
        "true",
    ]
    cmd += ["--type_k", "0", "--type_v", "0", "--n_threads", "1", "--port", str(port), "--model_alias", MODEL]
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(600):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2)
                break
            except OSError:
                time.sleep(1)
        exs = load_examples(DataConfig(format="embedded", embedded_size=400))[: args.pairs]
        arts, a, b = [e.article for e in exs], [e.extractive[0] for e in exs], [e.neutral[0] for e in exs]
        common = dict(model=MODEL, prompt=args.prompt, position_debias=False, max_length=512, batch_size=4)
        served = build_judge(
            JudgeConfig(
                type="served",
                server=ServerConfig(
                    base_url=f"http://127.0.0.1:{port}",
                    model=MODEL,
                    route="auto",  # settles on top_logprobs over text prompts with llama.cpp (docs/served.md)
                    concurrency=1,
                    timeout_s=600,
                ),
                **common,
            )
        )
        local = build_judge(JudgeConfig(type="choice", **common))
        s, c = served(arts, a, b), local(arts, a, b)
        print(
            json.dumps(
                {
                    "prompt": args.prompt,
                    "pairs": "the article's lead (a) vs its neutral reference (b)",
                    "served": s.scores.tolist(),
                    "served_status": list(s.status),
                    "in_process": c.scores.tolist(),
                    "max_abs_diff": float(np.nanmax(np.abs(s.scores - c.scores))),
                }
            )
        )
    finally:
        server.terminate()
        server.wait(timeout=30)


if __name__ == "__main__":
    main()
