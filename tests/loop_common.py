"""What the loop's tests share: the repository, the tiny config and its fast settings, a row comparison."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "feedback_loop" / "tiny.yaml"


FAST = [
    "judge.model=judgeloop-tiny/encoder",
    "judge.cache_size=0",
    "policy.sft_steps=60",
    "max_steps=4",
    "eval_every_n_steps=2",
    "calibration.recalibrate_every_n_steps=2",
    "calibration.num_articles=40",
    "calibration.min_points=4",
    "num_eval_articles=4",
    "num_validation_articles=4",
    "progress_bar=false",
    "log_with=[jsonl]",
    "data.embedded_size=120",
    "generation.max_new_tokens=8",
]


def tiny_policy(accelerator: Any, model: Any, ref: Any | None) -> Any:
    """The :class:`~judgeloop.loop.policy.Policy` of ``model`` (the tiny Llama, as the test prepared it)
    and its reference, with the tiny tokenizer (pad id 0) and the default prompts: what a ``Learner``
    updates."""
    from judgeloop.loop.config import PolicyConfig
    from judgeloop.loop.policy import Policy
    from judgeloop.loop.rollout import PromptBuilder
    from judgeloop.models import load_tokenizer

    tok = load_tokenizer("judgeloop-tiny/causal-lm")
    return Policy(accelerator, model, ref, tok, PromptBuilder(tok, PolicyConfig()))


def _floats(x: object) -> bool:
    return isinstance(x, float) or (
        isinstance(x, list) and bool(x) and all(isinstance(v, float) or v is None for v in x)
    )


def same_row(a: dict, b: dict) -> None:
    """Equal rows: the same keys, floats (and lists of floats, e.g. intervals) to rel 1e-6."""
    assert a.keys() == b.keys()
    for k in a:
        if _floats(a[k]) and _floats(b[k]):
            x, y = (v if isinstance(v, list) else [v] for v in (a[k], b[k]))
            assert len(x) == len(y) and all(
                u is v is None or (None not in (u, v) and u == pytest.approx(v, rel=1e-6, abs=1e-9))
                for u, v in zip(x, y)
            ), (k, a[k], b[k])
        else:
            assert a[k] == b[k], (k, a[k], b[k])
