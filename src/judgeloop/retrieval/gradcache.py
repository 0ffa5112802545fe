"""Gradient caching for contrastive losses (Gao et al. 2021, "Scaling Deep Contrastive Learning Batch
Size under Memory Limited Setup", https://arxiv.org/abs/2101.06983).

A contrastive loss couples every query with every document in the batch, so plain gradient
accumulation changes the loss. GradCache keeps the loss exact with memory for one sub-batch:

1. embed every sub-batch without a graph;
2. compute the loss on the (detached, leaf) embeddings and backprop to them -> d loss / d emb;
3. re-embed each sub-batch with a graph (same dropout masks: the RNG state is replayed) and
   backprop ``sum(emb * d loss / d emb)``, which gives each parameter its exact full-batch gradient.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch

Features = dict[str, torch.Tensor]


class _RngState:
    """CPU (and current CUDA device) RNG state, to replay dropout masks in the second forward."""

    def __init__(self) -> None:
        self.cpu = torch.get_rng_state()
        self.cuda = (
            torch.cuda.get_rng_state() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
        )

    @contextlib.contextmanager
    def replay(self) -> Any:
        with torch.random.fork_rng(devices=[torch.cuda.current_device()] if self.cuda is not None else []):
            torch.set_rng_state(self.cpu)
            if self.cuda is not None:
                torch.cuda.set_rng_state(self.cuda)
            yield


def grad_cache_step(
    embed: Callable[[Features], torch.Tensor],
    groups: Sequence[Sequence[Features]],
    loss_fn: Callable[..., torch.Tensor],
    backward: Callable[[torch.Tensor], None] | None = None,
    no_sync: Callable[[], Any] | None = None,
) -> torch.Tensor:
    """One exact large-batch backward pass through ``embed``, in sub-batches.

    Args:
        embed: tokenized features -> (b, D) embeddings (the wrapped model's forward).
        groups: one list of sub-batch features per loss argument, e.g.
            ``[query_chunks, positive_chunks, negative_chunks]``; the chunks of a group are embedded
            and concatenated in order, and the concatenations are passed to ``loss_fn`` positionally.
        loss_fn: embeddings of each group -> scalar loss.
        backward: how to backprop a scalar (``accelerator.backward``); default ``Tensor.backward``.
        no_sync: context manager factory that suspends gradient all-reduce (``lambda:
            accelerator.no_sync(model)``); every re-forward but the last runs under it.

    Returns:
        The detached loss value.
    """
    backward = backward or (lambda t: t.backward())
    # 1) embeddings without a graph; remember the RNG state before each sub-batch
    states: list[list[_RngState]] = []
    cached: list[torch.Tensor] = []
    for chunks in groups:
        group_states, embs = [], []
        for feats in chunks:
            group_states.append(_RngState())
            with torch.no_grad():
                embs.append(embed(feats))
        states.append(group_states)
        cached.append(torch.cat(embs).detach().requires_grad_(True))
    # 2) loss on the cached embeddings -> gradient w.r.t. each embedding
    loss = loss_fn(*cached)
    grads = torch.autograd.grad(loss, cached)
    # 3) replay each sub-batch with a graph and push the cached gradient through it
    jobs = []
    for chunks, group_states, grad in zip(groups, states, grads):
        start = 0
        for feats, state in zip(chunks, group_states):
            n = int(feats["input_ids"].shape[0])
            jobs.append((feats, state, grad[start : start + n]))
            start += n
    for i, (feats, state, grad) in enumerate(jobs):
        last = i == len(jobs) - 1
        ctx = no_sync() if (no_sync is not None and not last) else contextlib.nullcontext()
        with ctx, state.replay():
            emb = embed(feats)
            backward(torch.sum(emb * grad))
    return loss.detach()


def split_features(feats: Features, chunk_size: int) -> list[Features]:
    """Split a tokenized batch into sub-batches of at most ``chunk_size`` rows."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size} must be >= 1")
    n = int(feats["input_ids"].shape[0])
    return [{k: v[s : s + chunk_size] for k, v in feats.items()} for s in range(0, n, chunk_size)]
