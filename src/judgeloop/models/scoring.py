"""Next-token scoring with a causal LM: the log-probabilities after a prompt, batched. Constrained answers
(the RAFT evaluation's yes / no / maybe, the answer step's "do the passages answer it?") read them instead of
generating."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def next_token_logprobs(model: Any, tokenizer: Any, texts: Sequence[str], batch_size: int) -> Any:
    """Log-softmax ``(N, V)`` of the next-token logits after each of ``texts`` (already chat-formatted;
    no special tokens added), batched with left padding and explicit positions, so a text scores the same
    alone or in a batch (tested). One forward pass per batch, the LM head on the last position only."""
    import torch

    rows = []
    for start in range(0, len(texts), batch_size):
        batch = [
            tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts[start : start + batch_size]
        ]
        width = max(len(b) for b in batch)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        ids = torch.tensor([[pad] * (width - len(b)) + b for b in batch])  # (B, T)
        mask = torch.tensor([[0] * (width - len(b)) + [1] * len(b) for b in batch])  # (B, T)
        # Left padding shifts positions unless they are given: count real tokens only.
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        with torch.inference_mode():
            # logits_to_keep=1: only the last position goes through the LM head (V is ~50k for SmolLM2).
            logits = model(input_ids=ids, attention_mask=mask, position_ids=pos, logits_to_keep=1).logits[
                :, -1, :
            ]
        rows.append(torch.log_softmax(logits.float(), dim=-1))
    return torch.cat(rows)
