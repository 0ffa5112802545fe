"""Model folders in the layout transformers' ``save_pretrained`` writes, for every tool that reads them.

A model whose output head is tied to its input embedding (SmolLM2, the tiny models:
``tie_word_embeddings``) holds one tensor under two names. ``save_pretrained`` stores it once, under
the *source* name of the tie (``model.embed_tokens.weight``), and leaves the tied target
(``lm_head.weight``) out: readers tie it back from the config. safetensors' own ``save_model`` keeps
whichever name it meets first instead, and a folder with only ``lm_head.weight`` loads silently wrong
in tools that follow transformers' convention (vLLM loads no embedding and repeats token 0).
:func:`tied_state_dict` names the weights the way transformers does, and :func:`merged_state_dict`
folds a peft model's LoRA adapters into its base weights under the base model's names (the merged
policy that a generation engine or a plain transformers load reads).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from judgeloop.io import atomic_path

WEIGHTS_NAME = "model.safetensors"


def tied_targets(model: Any) -> dict[str, str]:
    """``{target: source}`` of ``model``'s tied weights (``{"lm_head.weight": "model.embed_tokens.weight"}``
    for a tied causal LM; empty when nothing is tied), as transformers computes it."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # peft
    tied = getattr(base, "all_tied_weights_keys", None)
    if tied is None and hasattr(base, "get_expanded_tied_weights_keys"):
        tied = base.get_expanded_tied_weights_keys(all_submodels=True)
    return dict(tied or {})


def tied_state_dict(model: Any, state: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """``state`` (default: ``model.state_dict()``) with each tied weight stored once, under its source
    name: a tied target is dropped when its source is there and renamed to the source when it is the only
    copy (as a folder written by safetensors' ``save_model`` has it). Tensors are made contiguous."""
    out = dict(model.state_dict() if state is None else state)
    for target, source in tied_targets(model).items():
        if target not in out:
            continue
        if source in out:
            del out[target]
        else:
            out[source] = out.pop(target)
    return {name: t.detach().contiguous() for name, t in out.items()}


def _lora_layers(model: Any) -> list[tuple[str, Any]]:
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [(n, m) for n, m in model.named_modules() if isinstance(m, BaseTunerLayer)]


def base_name(name: str) -> str:
    """A peft parameter name as the base model names it (``base_model.model.`` and ``.base_layer`` out)."""
    name = name.removeprefix("base_model.model.")
    return name.replace(".base_layer.", ".")


@torch.no_grad()
def merged_state_dict(
    model: Any, names: set[str] | None = None, dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """The weights ``model`` computes with, under the base model's names (tied ones stored once):
    a plain model's state, or a peft model's base weights with each active LoRA adapter merged in
    (``W + scaling * B @ A``, by peft's own ``get_delta_weight``); the adapters' own tensors are left out.

    Args:
        model: a transformers model, or a peft model wrapping one.
        names: only these (base-model) names; None: all.
        dtype: cast every floating tensor to it (the engine's dtype); None: as stored.

    Returns:
        ``{name: tensor}``, contiguous, on the CPU.
    """
    if not hasattr(model, "get_base_model"):
        state = tied_state_dict(model)
    else:
        state = {}
        for name, t in model.state_dict().items():
            if ".lora_" in name:  # the adapters themselves: merged below
                continue
            state[base_name(name)] = t
        for name, layer in _lora_layers(model):
            if layer.merged or layer.disable_adapters:
                continue
            key = base_name(name + ".base_layer.weight")
            weight = state[key]
            for adapter in layer.active_adapters:
                if adapter in layer.lora_A:
                    delta = layer.get_delta_weight(adapter)
                    weight = weight + delta.to(weight.dtype)
            state[key] = weight
        state = tied_state_dict(model, state)
    if names is not None:
        state = {n: t for n, t in state.items() if n in names}
    out = {}
    for n, t in state.items():
        t = t.detach().to("cpu")
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        out[n] = t.contiguous()
    return out


def save_weights(path: str | Path, state: dict[str, torch.Tensor]) -> None:
    """``state`` as one safetensors file (``format: pt`` metadata, as transformers writes), atomically."""
    from safetensors.torch import save_file

    with atomic_path(Path(path)) as tmp:
        save_file(state, str(tmp), metadata={"format": "pt"})


def save_model_folder(
    path: str | Path, model: Any, tokenizer: Any | None, state: dict[str, torch.Tensor] | None = None
) -> Path:
    """A folder ``AutoModelForCausalLM.from_pretrained`` (and vLLM) loads: ``config.json``, the
    generation config when the model has one, ``model.safetensors`` in transformers' tied-weight layout
    (``state``: default :func:`merged_state_dict`) and the tokenizer. Written in place (callers make the
    folder atomic when they need it)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = base.config
    if hasattr(config, "quantization_config"):  # a model read from GGUF is flagged as quantized
        delattr(config, "quantization_config")
    if not getattr(config, "architectures", None):  # save_pretrained sets it; config.save_pretrained does not
        config.architectures = [type(base).__name__]
    config.save_pretrained(path)
    if getattr(base, "generation_config", None) is not None:
        base.generation_config.save_pretrained(path)
    save_weights(path / WEIGHTS_NAME, merged_state_dict(model) if state is None else state)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    return path
