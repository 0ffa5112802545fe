"""Token budgets and padding shared by the model-based judges.

Truncation is explicit and touches the article only: :func:`fit_article` shortens the article
until the whole rendered input fits ``max_length`` tokens and says so (status ``truncated``); if the
input does not fit even with an empty article (the summaries and the prompt alone are too long),
the status is ``too_long`` and the item is not scored.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch

from judgeloop import devices


def fit_article(
    render_ids: Callable[[str], list[int]], tokenizer: Any, article: str, max_length: int
) -> tuple[list[int] | None, str, str]:
    """Token ids of ``render_ids(article)``, shortening the article until they fit ``max_length``.

    Args:
        render_ids: article text -> token ids of the full model input.
        tokenizer: used to cut the article on token boundaries.
        article: the article text.
        max_length: token budget of the full input.

    Returns:
        ``(ids, status, article_used)`` with status ``"ok"``, ``"truncated"`` or ``"too_long"``
        (then ``ids`` is ``None``).
    """
    ids = render_ids(article)
    if len(ids) <= max_length:
        return ids, "ok", article
    overhead = len(render_ids(""))
    if overhead > max_length:
        return None, "too_long", ""
    art_ids = tokenizer.encode(article, add_special_tokens=False)
    keep = min(len(art_ids), max_length - overhead)
    # Re-tokenizing a cut article inside its context can merge tokens differently, so shrink until it fits.
    while keep > 0:
        cut = tokenizer.decode(art_ids[:keep], skip_special_tokens=True)
        ids = render_ids(cut)
        if len(ids) <= max_length:
            return ids, "truncated", cut
        keep -= max(1, len(ids) - max_length)
    return render_ids(""), "truncated", ""


def pad_batch(seqs: Sequence[Sequence[int]], pad_id: int, side: str = "left") -> dict[str, torch.Tensor]:
    """Pad token id lists into ``input_ids``, ``attention_mask`` and ``position_ids``, each (B, T).

    ``position_ids`` count real tokens only, so a left-padded row sees the same positions as it
    would unpadded.
    """
    width = max(len(s) for s in seqs)
    input_ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        if side == "left":
            input_ids[i, width - len(s) :] = torch.tensor(s, dtype=torch.long)
            mask[i, width - len(s) :] = 1
        else:
            input_ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
            mask[i, : len(s)] = 1
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    return {"input_ids": input_ids, "attention_mask": mask, "position_ids": position_ids}


def forward_accepts(model: Any, name: str) -> bool:
    """Whether ``model.forward`` takes the keyword ``name`` explicitly."""
    return name in inspect.signature(model.forward).parameters


def model_max_length(model: Any, tokenizer: Any) -> int | None:
    """The longest input the model can take, from its config and tokenizer (``None`` if unknown)."""
    limits = []
    for attr in ("max_position_embeddings", "n_positions", "max_seq_len"):
        value = getattr(getattr(model, "config", None), attr, None)
        if isinstance(value, int) and value > 0:
            limits.append(value)
            break
    tok_max = getattr(tokenizer, "model_max_length", None)
    if isinstance(tok_max, int) and 0 < tok_max < 1_000_000:
        limits.append(tok_max)
    return min(limits) if limits else None


def load_judge_model(
    model: str | Any, tokenizer: Any, loader: Callable[..., Any], dtype: str, judge: str
) -> tuple[Any, Any, str]:
    """``(model, tokenizer, name)`` for a judge given a hub id / path, or an already loaded model + tokenizer."""
    from judgeloop.models import load_tokenizer

    if isinstance(model, str):
        tok = tokenizer if tokenizer is not None else load_tokenizer(model)
        return loader(model, dtype=dtype), tok, model
    if tokenizer is None:
        raise ValueError(f"{judge} got a loaded model but no tokenizer; pass tokenizer=...")
    name = getattr(getattr(model, "config", None), "_name_or_path", "") or type(model).__name__
    return model, tokenizer, name


class ModelBacked:
    """The attributes :func:`attach_judge_model` sets on a judge that runs a model (declared once)."""

    model: Any
    tokenizer: Any
    device: torch.device
    max_length: int
    pad_id: int


def attach_judge_model(
    judge: Any,
    model: str | Any,
    tokenizer: Any,
    loader: Callable[..., Any],
    dtype: str,
    device: str,
    max_length: int,
) -> str:
    """Load (or take) a judge's model and tokenizer and set ``model`` (on ``device``, eval mode),
    ``tokenizer``, ``device``, ``max_length`` and ``pad_id`` on ``judge``; returns the model's name."""
    model, tokenizer, name = load_judge_model(model, tokenizer, loader, dtype, type(judge).__name__)
    judge.device = devices.resolve_device(device, "judge.device")
    judge.model = model.to(judge.device).eval()
    judge.tokenizer = tokenizer
    judge.max_length = max_length
    judge.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    return name
