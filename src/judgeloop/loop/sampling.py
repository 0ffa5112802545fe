"""Per-row sampling: each generated row draws its tokens from its own random stream, keyed by the call's
seed, its prompt's tokens and its sample index, so a row's sample does not depend on which other rows
share its batch or on which process holds it.

With one global generator (``generate(do_sample=True)``) the draws of a row depend on every row before
it, so two processes with half a batch each sample other summaries than one process with the whole batch,
and a 2-process launch trains another model. Here sampling is the Gumbel-max trick: ``argmax(s + g)``,
``g = -log(-log(u))`` with ``u ~ U(0, 1)`` per vocabulary entry, is a draw from ``softmax(s)``
(Gumbel 1954; e.g. Maddison et al. 2014, "A* Sampling", section 2), applied after the temperature,
top-k and top-p warpers, and ``generate`` then decodes greedily.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import torch
from transformers import (
    LogitsProcessor,
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from judgeloop.hashing import derive_seed


def row_seeds(prompts: Sequence[Sequence[int]], num_samples: int, seed: int) -> list[int]:
    """One seed per output row (row ``i * num_samples + j``: sample j of prompt i), from ``seed``, the
    digest of prompt i's tokens, how many equal prompts came before it in this call, and j."""
    seen: dict[str, int] = {}
    out = []
    for p in prompts:
        digest = hashlib.sha256(",".join(map(str, p)).encode()).hexdigest()[:16]
        occurrence = seen.get(digest, 0)
        seen[digest] = occurrence + 1
        out += [derive_seed(seed, "row", digest, occurrence, j) for j in range(num_samples)]
    return out


class RowSampler(LogitsProcessor):
    """Adds each row's own Gumbel noise to its (warped) scores, so that the greedy pick is a sample.

    Args:
        seeds: one seed per row of the batch ``generate`` decodes (:func:`row_seeds`).
    """

    def __init__(self, seeds: Sequence[int]):
        self.generators = []
        for s in seeds:
            g = torch.Generator()
            g.manual_seed(int(s))
            self.generators.append(g)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        n, vocab = scores.shape  # (N, V)
        if n != len(self.generators):
            raise ValueError(f"{n} rows to sample but {len(self.generators)} row seeds")
        # (N, V) uniforms, each row from its own stream; tiny keeps log() finite
        u = torch.stack([torch.rand(vocab, generator=g, dtype=torch.float64) for g in self.generators])
        u = u.clamp(min=torch.finfo(torch.float64).tiny)
        gumbel = -torch.log(-torch.log(u))
        return scores.float() + gumbel.to(device=scores.device, dtype=torch.float32)


def sampling_processors(gen: Any, seeds: Sequence[int]) -> LogitsProcessorList:
    """The temperature / top-k / top-p warpers of ``gen`` (a GenerationConfig), then :class:`RowSampler`."""
    procs: list[Any] = [TemperatureLogitsWarper(float(gen.temperature))]
    if gen.top_k:
        procs.append(TopKLogitsWarper(int(gen.top_k)))
    if gen.top_p < 1.0:
        procs.append(TopPLogitsWarper(float(gen.top_p)))
    procs.append(RowSampler(seeds))
    return LogitsProcessorList(procs)
