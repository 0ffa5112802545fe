"""Work done once across the runs of an ablation: the starting policy's outputs, keyed by what they depend on.

Every arm of a seed starts from the same policy, and with LoRA (adapters start at zero) or a seed-free
warm start every seed does too. What that policy produces before step 1 (its greedy summaries of the
test and validation articles, the reference policy's summaries, one sample per test article with its
KL, the step-0 calibration pairs) is therefore the same in every run that shares those inputs.
:class:`StartCache` stores each such result as a JSON file named by a digest of its inputs, so the
first run computes it and the others read it.

The key of every entry includes a *fingerprint* of the model that produced it: a digest of its logits
on a fixed probe batch (:func:`model_fingerprint`). Two starts with the same fingerprint compute the
same function on that probe, bit for bit (a LoRA policy whose B matrices are zero, whatever its seed);
two different starts, in practice, never share one. Nothing is assumed about which settings make the
start seed-free: it is observed.

Entries are written atomically under a per-entry file lock, so concurrent workers (``ablation.num_workers``,
or cluster jobs on a shared file system) compute each entry once: a second worker waits for the first
and reads its result. Values round-trip exactly (JSON keeps every float's repr).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from judgeloop.data import SummExample
from judgeloop.hashing import json_digest
from judgeloop.io import atomic_write_json
from judgeloop.logging import get_logger
from judgeloop.loop.config import FeedbackLoopConfig
from judgeloop.loop.policy import Policy, eval_mode

logger = get_logger(__name__)


def digest(obj: Any) -> str:
    """Stable short digest of a JSON-serializable key."""
    return json_digest(obj)


@torch.no_grad()
def model_fingerprint(model: Any, input_ids: torch.Tensor) -> str:
    """Digest of ``model``'s float32 logits on ``input_ids`` (1, T): equal for models that compute the
    same function on the probe, bit for bit."""
    device = next(model.parameters()).device
    with eval_mode(model):
        logits = model(input_ids=input_ids.to(device)).logits.float().cpu().contiguous()
    return hashlib.sha256(logits.numpy().tobytes()).hexdigest()[:24]


class StartCache:
    """A folder of JSON results, one per key (see the module docstring)."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.hits = 0
        self.misses = 0

    @contextlib.contextmanager
    def _locked(self, path: Path) -> Iterator[None]:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path.with_suffix(".lock"), "w") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)

    def get_or_compute(self, kind: str, key: dict[str, Any], compute: Callable[[], Any]) -> Any:
        """The stored value for (kind, key), or ``compute()``'s, stored. Values must be JSON-serializable."""
        path = self.root / f"{kind}-{digest(key)}.json"
        with self._locked(path):
            if path.is_file():
                self.hits += 1
                logger.info("shared start work: %s read from %s", kind, path.name)
                return json.loads(path.read_text())["value"]
            value = compute()
            atomic_write_json(path, {"kind": kind, "key": key, "value": value})
            self.misses += 1
            return value


class StartWork:
    """What the starting policy computes before step 1, shared with the other runs of an ablation.

    With a :class:`StartCache` (``cfg.start_cache``, one process), each result is stored under a key
    made of the model's fingerprint and every setting it depends on, so the runs that share them (every
    arm of a seed; every seed too when the start is seed-free) compute it once. Without one, or under
    several processes, everything is computed here as always. Either way the values are the same.
    """

    def __init__(self, cfg: FeedbackLoopConfig, policy: Policy, probe_article: str):
        self.cache: StartCache | None = None
        accelerator = policy.accelerator
        if cfg.start_cache and accelerator.num_processes == 1:
            self.cache = StartCache(cfg.start_cache)
        elif cfg.start_cache:
            logger.info("start_cache is ignored under %d processes", accelerator.num_processes)
        if self.cache is None:
            return
        probe = torch.tensor([policy.build_prompt(probe_article)])
        self.policy_fp = model_fingerprint(policy.unwrapped, probe)
        with policy.as_reference() as ref:
            self.ref_fp = model_fingerprint(ref, probe)
        self.base = {
            "policy": dataclasses.asdict(cfg.policy),
            "data": dataclasses.asdict(cfg.data),
            "generation": dataclasses.asdict(cfg.generation),
            "eval_batch_size": cfg.eval_batch_size,
            "mixed_precision": cfg.mixed_precision,
        }

    def get(self, kind: str, key: dict[str, Any], compute: Any) -> Any:
        if self.cache is None:
            return compute()
        return self.cache.get_or_compute(kind, {**self.base, **key}, compute)

    def greedy(self, which: str, examples: Sequence[SummExample], compute: Any) -> list[str]:
        """Greedy summaries of the starting policy (``which="policy"``) or the reference (``"reference"``):
        one entry when their fingerprints agree (the LoRA reference is the start)."""
        fp = None if self.cache is None else (self.policy_fp if which == "policy" else self.ref_fp)
        return list(self.get("greedy", {"model": fp, "ids": [e.id for e in examples]}, compute))
