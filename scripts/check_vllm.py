"""The check `make vllm` ends with: does the vLLM environment generate what judgeloop's training model does?

Starts vLLM's server from the environment's python (``--python``, else ``$JUDGELOOP_VLLM_PYTHON``, else
``.venv-vllm``) on SmolLM2-135M-Instruct at float32, as ``generation.backend: vllm`` does, and compares
its greedy summaries of ``--prompts`` embedded articles with ``model.generate``'s, token for token;
then merges random LoRA adapters in (one weight sync) and compares again. Exits 1 on any difference.

    python scripts/check_vllm.py --prompts 8 --max-new-tokens 16
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

from judgeloop.data.embedded import embedded_texts
from judgeloop.logging import setup_logging
from judgeloop.loop.config import GenerationConfig, PolicyConfig, VllmConfig
from judgeloop.loop.rollout import PromptBuilder, generate
from judgeloop.loop.vllm_backend import find_python, serving
from judgeloop.models import load_causal_lm, load_tokenizer

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", default=None, help="the vLLM environment's python")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    args = parser.parse_args(argv)
    setup_logging()
    from peft import LoraConfig, get_peft_model

    python = find_python(VllmConfig(python=args.python))
    tok = load_tokenizer(MODEL)
    model = load_causal_lm(MODEL, dtype="float32").eval()
    build = PromptBuilder(tok, PolicyConfig(model=MODEL, max_article_tokens=96))
    prompts = [build(a) for a in list(embedded_texts())[: args.prompts]]
    gen = GenerationConfig(max_new_tokens=args.max_new_tokens)
    failures = 0
    with tempfile.TemporaryDirectory(prefix="judgeloop-vllm-check-") as tmp:
        t0 = time.perf_counter()
        with serving(
            python,
            Path(tmp) / "weights",
            model,
            tok,
            VllmConfig(max_model_len=1024),
            torch.float32,
            Path(tmp) / "server.log",
            cpu=not torch.cuda.is_available(),
        ) as engine:
            print(f"vLLM ({python}) started in {time.perf_counter() - t0:.0f} s")
            torch.manual_seed(0)
            for label in ("SmolLM2-135M-Instruct", "with LoRA adapters merged (one weight sync)"):
                if label.startswith("with"):
                    model = get_peft_model(model, LoraConfig(r=8, target_modules=["q_proj", "v_proj"]))
                    with torch.no_grad():
                        for name, p in model.named_parameters():
                            if "lora_B" in name:
                                p.normal_(0, 0.03)
                with torch.no_grad():
                    want = generate(model, tok, prompts, gen, greedy=True)
                t1 = time.perf_counter()
                got = engine.generate(model, tok, prompts, gen, greedy=True)
                same = sum(a == b for a, b in zip(want, got))
                failures += len(prompts) - same
                print(
                    f"greedy parity, {label}: {same}/{len(prompts)} prompts equal at float32 "
                    f"({time.perf_counter() - t1:.1f} s on vLLM)"
                )
    print("vLLM environment: OK" if not failures else "vLLM environment: outputs DIFFER from model.generate")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
