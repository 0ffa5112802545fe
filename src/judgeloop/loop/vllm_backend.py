"""``generation.backend: vllm``: the policy's rollouts and greedy evaluations on a vLLM engine, the way
TRL's trainers use one in server mode.

judgeloop starts vLLM's OpenAI-compatible server (``python -m vllm.entrypoints.openai.api_server``)
from the vLLM environment's python, on a folder holding the policy's weights in transformers' layout
(:func:`judgeloop.models.saving.save_model_folder`), or uses a server already running at
``generation.vllm.url``. The run's generation backend (:class:`judgeloop.loop.rollout.GenerationBackend`,
made in set-up and passed to every step that generates) holds the engine: each
:func:`judgeloop.loop.rollout.generate` call on the policy with it becomes one completions request per
prompt (token ids in, token ids out), and the training model only scores: the KL and the update's
log-probs are its own.

Weights: after every optimizer step (counted by a hook on the run's optimizer), and after any other
in-place write to the trainable tensors (their version counters: a resume, a restored best
checkpoint), the next generation first
writes the policy's merged weights (LoRA folded in) to ``model.safetensors`` in the sync folder and has
the engine reload them (``reload_weights`` through the server's ``/collective_rpc``, which needs
``VLLM_SERVER_DEV_MODE=1``), then drops the engine's prefix cache, whose keys and values were computed
with the old weights. Measured on 2 shared CPU cores with SmolLM2-135M in float32 (538 MB), the
reload took 0.7-1.6 s against 27.5 s for vLLM's own LoRA path in the issue's trial (docs/vllm.md).

Sampling maps one to one: ``temperature``, ``top_p``, ``top_k``, ``max_tokens = max_new_tokens``, the
special tokens other than EOS masked out (``allowed_token_ids``: -inf, as ``suppress_tokens``), EOS
kept at the end of a summary, greedy at ``temperature = 0``. Prompt ``i`` of a call with seed ``s``
is sent with ``seed = derive_seed(s, "vllm", i)`` and ``n`` samples, which vLLM draws with seeds
``seed + j``: a run's samples are reproducible. vLLM draws its own random numbers, so the samples
differ from the ``hf`` backend's; greedy output at float32 is the same (tests/loop/test_vllm.py).

On a CPU the server runs eagerly (``--enforce-eager``: it starts in about 45 s instead of 2.5-4.5 min
of compilation here) and without chunked prefill: vLLM 0.32's CPU runner rewinds a seeded generator
after a partial prefill and fails ("CPU Generator does not use offset").
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from judgeloop.hashing import derive_seed
from judgeloop.logging import get_logger
from judgeloop.loop.config import FeedbackLoopConfig, GenerationConfig, VllmConfig

logger = get_logger(__name__)

PYTHON_ENV = "JUDGELOOP_VLLM_PYTHON"
SERVED_NAME = "policy"
_REPO = Path(__file__).resolve().parents[3]  # the checkout (an editable install), where make vllm builds


class VllmError(RuntimeError):
    """The vLLM engine failed: it did not start, or a request was refused."""


def default_pythons() -> list[Path]:
    """Where the vLLM environment's python is looked for when ``generation.vllm.python`` is null:
    ``$JUDGELOOP_VLLM_PYTHON``, then ``.venv-vllm`` (``make vllm``) in the working directory and in
    the checkout judgeloop runs from."""
    found = [Path(os.environ[PYTHON_ENV])] if os.environ.get(PYTHON_ENV) else []
    found += [Path.cwd() / ".venv-vllm" / "bin" / "python", _REPO / ".venv-vllm" / "bin" / "python"]
    return found


def has_vllm(python: str | Path) -> bool:
    """Whether ``python`` runs and can import vllm (found without importing it: seconds faster)."""
    code = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
    try:
        return subprocess.run([str(python), "-c", code], capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def find_python(cfg: VllmConfig) -> str:
    """The vLLM environment's python (see :func:`default_pythons`).

    Raises:
        ValueError: one line naming the key, what was looked for and the fix.
    """
    if cfg.python is not None:
        path = Path(cfg.python).expanduser()
        if not path.is_file():
            raise ValueError(
                f"generation.vllm.python={cfg.python!r} is not a file; point it at the python of "
                "an environment with vLLM (make vllm builds .venv-vllm/bin/python)"
            )
        if not has_vllm(path):
            raise ValueError(
                f"generation.vllm.python={cfg.python!r} cannot import vllm; install vLLM there "
                "or run make vllm"
            )
        return str(path.absolute())  # not resolved: a venv's python finds its packages by its own path
    for path in default_pythons():
        if path.is_file() and has_vllm(path):
            return str(path.absolute())
    looked = ", ".join(str(p) for p in default_pythons())
    raise ValueError(
        f"generation.backend=vllm: no vLLM environment found (looked for {looked}); run make vllm, or set "
        f"generation.vllm.python (or ${PYTHON_ENV}) to its python, or generation.vllm.url to a running server"
    )


def _get(url: str, timeout: float) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def check_server(url: str, timeout: float = 5.0, served_name: str = SERVED_NAME) -> None:
    """A server at ``url`` answers ``/health``, has the development routes weight syncing needs and
    serves the model as ``served_name``.

    Raises:
        ValueError: one line naming the key, the value and the fix.
    """
    base = url.rstrip("/")
    try:
        status, _ = _get(base + "/health", timeout)
    except (OSError, urllib.error.URLError) as err:
        reason = getattr(err, "reason", err)
        raise ValueError(
            f"generation.vllm.url={url!r} does not answer ({reason}); start the server "
            "(docs/vllm.md) or unset the key to let judgeloop start one"
        ) from None
    if status != 200:
        raise ValueError(f"generation.vllm.url={url!r}: /health answered {status}; is it a vLLM server?")
    status, _ = _get(base + "/is_sleeping", timeout)
    if status == 404:
        raise ValueError(
            f"generation.vllm.url={url!r} has no development routes: judgeloop syncs the policy's weights "
            "through /collective_rpc; start it with VLLM_SERVER_DEV_MODE=1 (docs/vllm.md)"
        )
    status, body = _get(base + "/v1/models", timeout)
    served = [m.get("id") for m in json.loads(body).get("data", [])] if status == 200 else []
    if served_name not in served:
        raise ValueError(
            f"generation.vllm.url={url!r} serves {served or 'no model'}, not {served_name!r}: start it with "
            f"--served-model-name {served_name} (docs/vllm.md)"
        )


def check_backend(cfg: FeedbackLoopConfig) -> None:
    """Before any data or weights load: ``generation.backend: vllm`` can run here.

    Raises:
        ValueError: one line naming the key and the fix (vLLM's python not found, a URL that does not
            answer, ``colocate`` where vLLM is not in the training environment, several processes).
    """
    gen = cfg.generation
    if gen.backend != "vllm":
        return
    vcfg = gen.vllm
    if vcfg.mode == "colocate":
        if importlib.util.find_spec("vllm") is None:
            raise ValueError(
                "generation.vllm.mode=colocate runs vLLM inside the training process, but vllm is not "
                "importable in this environment (vLLM's CPU build needs transformers<5.20, judgeloop's "
                "environment has a newer one); use generation.vllm.mode=server"
            )
        raise ValueError(
            "generation.vllm.mode=colocate is not built yet (it could not be tested: vLLM shares no "
            "environment with judgeloop on the machines it was built on); use generation.vllm.mode=server"
        )
    check_head_size(cfg.policy.model)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        raise ValueError(
            f"generation.backend=vllm runs in one training process (this launch has {world}); launch one "
            "process, or use generation.backend=hf"
        )
    if vcfg.url is not None:
        check_server(vcfg.url)
    else:
        find_python(vcfg)


# vLLM 0.32's CPU attention (vllm/v1/attention/backends/cpu_attn.py, get_supported_head_sizes)
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def head_size(name: str) -> int | None:
    """The attention head size of the causal LM ``name`` from its config alone (no weights), or None
    when its config cannot be read here (vLLM then reports what it finds)."""
    from judgeloop.models import is_tiny, resolve_model_path

    try:
        if is_tiny(name):
            from judgeloop.models.tiny import build_tiny_model

            config = build_tiny_model(name).config  # 140k parameters: milliseconds
        else:
            from transformers import AutoConfig

            config = AutoConfig.from_pretrained(resolve_model_path(name))
    except (OSError, ValueError):
        return None
    size = getattr(config, "head_dim", None)
    heads = getattr(config, "num_attention_heads", None)
    if size is None and heads:
        size = config.hidden_size // heads
    return int(size) if size else None


def check_head_size(name: str) -> None:
    """Where vLLM runs on the CPU (no CUDA GPU here), the policy's head size is one its attention takes.

    Raises:
        ValueError: one line naming ``policy.model``, its head size and the fix.
    """
    if torch.cuda.is_available():
        return
    size = head_size(name)
    if size is not None and size not in CPU_HEAD_SIZES:
        hint = "judgeloop-tiny/causal-lm-h32 (heads of 32), " if name.startswith("judgeloop-tiny/") else ""
        raise ValueError(
            f"policy.model={name!r} has attention heads of size {size}, which vLLM's CPU attention does not "
            f"take ({', '.join(map(str, CPU_HEAD_SIZES))}); use {hint}a GPU, or generation.backend=hf"
        )


def engine_dtype(cfg: FeedbackLoopConfig) -> torch.dtype:
    """The engine's weights and compute: ``generation.vllm.dtype``, or (``auto``) bfloat16 when the
    policy's frozen weights are (``policy.dtype=bfloat16``), else float32."""
    name = cfg.generation.vllm.dtype
    if name == "auto":
        name = "bfloat16" if cfg.policy.dtype == "bfloat16" else "float32"
    return torch.bfloat16 if name == "bfloat16" else torch.float32


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class VllmServer:
    """A ``vllm serve`` process judgeloop started (its own process group, ended on :meth:`close`)."""

    def __init__(
        self, python: str, folder: Path, cfg: VllmConfig, dtype: torch.dtype, log_path: Path, cpu: bool
    ):
        self.port = cfg.port or _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        max_len = cfg.max_model_len or 2048
        cmd = [
            python,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(folder),
            "--served-model-name",
            SERVED_NAME,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--dtype",
            "float32" if dtype == torch.float32 else "bfloat16",
            "--max-model-len",
            str(max_len),
            "--generation-config",
            "vllm",
            "--seed",
            "0",
        ]
        if cpu:  # see the module docstring
            cmd += ["--enforce-eager", "--no-enable-chunked-prefill"]
        cmd += list(cfg.extra_args)
        env = dict(os.environ)
        env["VLLM_SERVER_DEV_MODE"] = "1"  # /collective_rpc and /reset_prefix_cache
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(cfg.kv_cache_gib))
        for key in ("PYTHONPATH", "VIRTUAL_ENV"):  # the training environment's paths are not vLLM's
            env.pop(key, None)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(log_path, "ab")  # noqa: SIM115 - closed in close()
        logger.info("starting vLLM (%s) on %s; its log: %s", python, self.url, log_path)
        self.proc = subprocess.Popen(
            cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        self._wait_ready(cfg.startup_timeout_s)

    def _wait_ready(self, timeout_s: float) -> None:
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < timeout_s:
            if self.proc.poll() is not None:
                self.close()
                raise VllmError(
                    f"vLLM exited with status {self.proc.returncode} while starting; the end of its log "
                    f"({self.log_path}):\n{_tail(self.log_path)}"
                )
            with contextlib.suppress(OSError, urllib.error.URLError):
                if _get(self.url + "/health", 2.0)[0] == 200:
                    logger.info("vLLM is up after %.0f s", time.perf_counter() - t0)
                    return
            time.sleep(1.0)
        self.close()
        raise VllmError(
            f"vLLM did not answer within generation.vllm.startup_timeout_s={timeout_s:g} s; raise it, or "
            f"see its log {self.log_path}:\n{_tail(self.log_path)}"
        )

    def close(self) -> None:
        """End the server's process group (SIGTERM, then SIGKILL after 30 s)."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self._log.close()


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def engine_state(model: Any, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The weights the engine loads: the policy's merged weights (:func:`merged_state_dict`) with every
    tied weight written out under both names (see :func:`write_engine_folder`)."""
    from judgeloop.models.saving import merged_state_dict, tied_targets

    state = merged_state_dict(model, dtype=dtype)
    for target, source in tied_targets(model).items():
        if source in state:
            state[target] = state[source].clone()  # a copy: safetensors stores no shared tensors
    return state


def write_engine_folder(folder: Path, model: Any, tokenizer: Any, dtype: torch.dtype) -> None:
    """The folder the engine starts on: the policy in transformers' layout, but untied
    (``tie_word_embeddings: false``, the head stored beside the embedding). vLLM's CPU build packs the
    head's weight into its own GEMM layout when it loads; a reload that brings the embedding alone
    leaves that packed copy as it was (measured: after an update of a tied embedding, greedy output no
    longer matched ``model.generate``), while a head of its own is reloaded and packed again."""
    from judgeloop.models.saving import save_model_folder

    save_model_folder(folder, model, tokenizer, engine_state(model, dtype))
    config_file = folder / "config.json"
    config = json.loads(config_file.read_text())
    if config.get("tie_word_embeddings"):
        config["tie_word_embeddings"] = False
        config_file.write_text(json.dumps(config, indent=2, sort_keys=True))


def _version(model: Any) -> tuple[tuple[int, int], ...]:
    """Identity and in-place version counter of every trainable tensor: it changes with
    ``load_state_dict`` (a resume, a restored best policy) or any other in-place write through autograd's
    view of the tensor. A fused optimizer step does not count (torch's fused AdamW leaves the counters
    as they were): the engine watches the optimizer for those (:meth:`VllmEngine.watch`)."""
    return tuple((id(p), p._version) for p in model.parameters() if p.requires_grad)


class VllmEngine:
    """The client side: completions requests to a vLLM server, and the weight sync into it.

    Args:
        url: the server's address.
        folder: the sync folder the server can read (``model.safetensors`` is rewritten there).
        dtype: the engine's dtype (weights are written in it).
        request_timeout_s: the longest wait for one request.
    """

    def __init__(self, url: str, folder: Path, dtype: torch.dtype, request_timeout_s: float = 600.0):
        self.url = url.rstrip("/")
        self.folder = Path(folder)
        self.dtype = dtype
        self.timeout = request_timeout_s
        self.synced: tuple[Any, ...] | None = None  # weights_key() of what the server holds
        self.steps = 0  # optimizer steps seen by the hooks of watch()
        self.sync_seconds: list[float] = []
        self.requests = 0
        self._allowed: dict[int, list[int] | None] = {}

    def _post(self, path: str, body: dict[str, Any]) -> Any:
        data = json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as err:
            detail = err.read().decode(errors="replace")[:500]
            raise VllmError(f"vLLM {path} answered {err.code}: {detail}") from None
        except (OSError, urllib.error.URLError) as err:
            raise VllmError(f"vLLM at {self.url} did not answer {path} ({err})") from None
        return json.loads(raw) if raw else None

    def watch(self, optimizer: Any) -> Any:
        """Count ``optimizer``'s steps (a post-step hook; accelerate's wrapper hooks its inner optimizer),
        so the next generation syncs after each; returns the hook's handle."""
        inner = getattr(optimizer, "optimizer", optimizer)

        def stepped(*_: Any) -> None:
            self.steps += 1

        return inner.register_step_post_hook(stepped)

    def weights_key(self, model: Any) -> tuple[Any, ...]:
        """What identifies the weights ``model`` holds now: optimizer steps seen and version counters."""
        return (self.steps, _version(model))

    def sync(self, model: Any, force: bool = False) -> bool:
        """Load ``model``'s current weights into the engine when they changed since the last sync (or
        ``force``); returns whether it synced. Under LoRA the adapters are merged into the base weights."""
        from judgeloop.models.saving import WEIGHTS_NAME, save_weights

        version = self.weights_key(model)
        if not force and version == self.synced:
            return False
        t0 = time.perf_counter()
        save_weights(self.folder / WEIGHTS_NAME, engine_state(model, self.dtype))
        self._post(
            "/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(self.folder)}}
        )
        self._post("/reset_prefix_cache", {})  # cached keys/values were computed with the old weights
        self.synced = version
        self.sync_seconds.append(time.perf_counter() - t0)
        return True

    def allowed_tokens(self, tokenizer: Any, vocab_size: int) -> list[int] | None:
        """Every token but the special ones other than EOS (``generate``'s ``suppress_tokens``), or None."""
        if vocab_size not in self._allowed:
            suppress = {t for t in tokenizer.all_special_ids if t != tokenizer.eos_token_id}
            self._allowed[vocab_size] = (
                [t for t in range(vocab_size) if t not in suppress] if suppress else None
            )
        return self._allowed[vocab_size]

    def generate(
        self,
        model: Any,
        tokenizer: Any,
        prompts: Sequence[Sequence[int]],
        gen: GenerationConfig,
        num_samples: int = 1,
        greedy: bool = False,
        seed: int | None = None,
    ) -> list[list[int]]:
        """:func:`judgeloop.loop.rollout.generate` on the engine: ``len(prompts) * num_samples``
        completions (``len(prompts)`` when greedy), sample j of prompt i at ``i * num_samples + j``, each
        cut after its first EOS (kept)."""
        self.sync(model)
        if seed is None:  # as generate() without a seed: drawn from torch's global generator
            seed = int(torch.randint(0, 2**31 - 1, ()).item())
        n = 1 if greedy else num_samples
        vocab = int(model.config.vocab_size)
        body: dict[str, Any] = {
            "model": SERVED_NAME,
            "max_tokens": gen.max_new_tokens,
            "n": n,
            "return_token_ids": True,
            "allowed_token_ids": self.allowed_tokens(tokenizer, vocab),
            "stop_token_ids": [tokenizer.eos_token_id],
        }
        if greedy:
            body.update(temperature=0.0)
        else:
            body.update(temperature=gen.temperature, top_p=gen.top_p, top_k=gen.top_k or 0)

        def one(i: int) -> list[list[int]]:
            req = {**body, "prompt": list(prompts[i])}
            if not greedy:
                req["seed"] = derive_seed(seed, "vllm", i)
            out = self._post("/v1/completions", req)
            choices = sorted(out["choices"], key=lambda c: c["index"])
            return [list(c["token_ids"]) for c in choices]

        with ThreadPoolExecutor(max_workers=max(1, min(64, len(prompts)))) as pool:
            rows = list(pool.map(one, range(len(prompts))))
        self.requests += len(prompts)
        eos = tokenizer.eos_token_id
        out: list[list[int]] = []
        for samples in rows:
            for ids in samples:
                cut = ids[: ids.index(eos) + 1] if eos in ids else ids
                out.append(cut)
        return out


@contextlib.contextmanager
def serving(
    python: str | None,
    folder: Path,
    model: Any,
    tokenizer: Any,
    cfg: VllmConfig,
    dtype: torch.dtype,
    log_path: Path,
    cpu: bool,
) -> Iterator[VllmEngine]:
    """An engine for ``model`` for the block: a server judgeloop starts on ``folder`` (``python``), or
    the one at ``cfg.url``; the server it started is ended on leaving."""
    server = None
    try:
        if cfg.url is None:
            assert python is not None
            write_engine_folder(folder, model, tokenizer, dtype)
            server = VllmServer(python, folder, cfg, dtype, log_path, cpu)
            engine = VllmEngine(server.url, folder, dtype, cfg.request_timeout_s)
            engine.synced = engine.weights_key(model)  # the server was started on these weights
        else:
            folder.mkdir(parents=True, exist_ok=True)
            engine = VllmEngine(cfg.url, folder, dtype, cfg.request_timeout_s)  # first use syncs everything
        yield engine
    finally:
        if server is not None:
            server.close()


def _sync_parent(model: Any, dtype: torch.dtype) -> str | None:
    """Where the temporary sync folder goes: ``/dev/shm`` (memory: a sync writes and reads no disk) when
    it has room for two copies of the weights (a container's is often 64 MB), else the system's temp."""
    shm = Path("/dev/shm")
    need = 2 * sum(p.numel() for p in model.parameters()) * torch.finfo(dtype).bits // 8
    if shm.is_dir() and shutil.disk_usage(shm).free > need:
        return str(shm)
    return None


@contextlib.contextmanager
def policy_engine(
    cfg: FeedbackLoopConfig, model: Any, tokenizer: Any, out_dir: Path, optimizer: Any = None
) -> Iterator[VllmEngine]:
    """The engine of ``generation.backend: vllm`` for the block: it serves the policy ``model`` (the
    unwrapped one the steps generate with), synced after every step of ``optimizer``; the server is
    started here (or ``generation.vllm.url``'s used) and ended on leaving."""
    vcfg = cfg.generation.vllm
    python = None if vcfg.url is not None else find_python(vcfg)
    dtype = engine_dtype(cfg)
    temp = None
    if vcfg.sync_dir is None:
        temp = Path(tempfile.mkdtemp(prefix="judgeloop-vllm-", dir=_sync_parent(model, dtype)))
    folder = Path(vcfg.sync_dir) if vcfg.sync_dir is not None else temp
    assert folder is not None
    cpu = not torch.cuda.is_available()  # vLLM runs where this process sees no GPU: its CPU build
    try:
        with serving(
            python, folder, model, tokenizer, vcfg, dtype, out_dir / "vllm_server.log", cpu
        ) as engine:
            hook = engine.watch(optimizer) if optimizer is not None else None
            try:
                yield engine
            finally:
                if hook is not None:
                    hook.remove()
                if engine.sync_seconds:
                    logger.info(
                        "vLLM: %d requests, %d weight syncs (mean %.2f s)",
                        engine.requests,
                        len(engine.sync_seconds),
                        sum(engine.sync_seconds) / len(engine.sync_seconds),
                    )
    finally:
        if temp is not None:
            shutil.rmtree(temp, ignore_errors=True)
