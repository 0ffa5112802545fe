"""Servers for tests, benchmarks and demos, not for production: no library module imports this package.

* :mod:`judgeloop.testing.openai_compat`: a small OpenAI-compatible completion server (vLLM's and SGLang's
  fields too) over a local causal LM, ``python -m judgeloop.testing.openai_compat MODEL --port 8000``;
* :mod:`judgeloop.testing.llamacpp`: llama.cpp's own server (``llama-cpp-python[server]``) started on a
  loopback port with SmolLM2-135M-Instruct;
* :mod:`judgeloop.testing.vllm`: vLLM's OpenAI-compatible server (from ``make vllm``'s ``.venv-vllm``) on a
  loopback port, serving the packaged SmolLM2-135M-Instruct at float32.

The served judge's tests, ``scripts/gpu_check.sh``'s CPU dry run and the docs' served-judge walk-through
(docs/served.md) judge against them.
"""
