"""What a run carries from step to step: the saved state, the article splits and the batch order.

:class:`LoopState` is everything besides weights and optimizer that a resumed run needs (``state.json``
in each checkpoint); :class:`Splits` are the four disjoint article splits; :func:`next_batch` walks a
seeded permutation of the train split per epoch, with the cursor checkpointed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from accelerate import Accelerator

from judgeloop.config import ConfigError
from judgeloop.data import SummExample, load_examples, split_examples
from judgeloop.hashing import derive_seed
from judgeloop.logging import get_logger
from judgeloop.loop.config import FeedbackLoopConfig
from judgeloop.loop.pairs import check_calibration_disjoint

logger = get_logger(__name__)


@dataclass
class LoopState:
    """Everything besides weights/optimizer that a resumed run needs (saved as state.json)."""

    step: int = 0
    epoch: int = 0
    cursor: int = 0
    kl_coef: float = 0.0
    history: list[dict[str, Any]] = field(default_factory=list)
    train_log: list[dict[str, Any]] = field(default_factory=list)
    refits: list[dict[str, Any]] = field(default_factory=list)
    ref_summaries: list[str] = field(default_factory=list)
    per_article: list[dict[str, Any]] = field(default_factory=list)
    coupling: list[dict[str, Any]] = field(default_factory=list)
    curve: list[dict[str, Any]] = field(default_factory=list)  # the validation curve (loop/curve.py)
    curve_rows: list[dict[str, Any]] = field(default_factory=list)  # its per-article rows
    # run-long counters, so a resumed run's report counts the whole run
    judge_status: dict[str, int] = field(default_factory=dict)
    judge_cache_hits: int = 0
    truncated_articles: list[str] = field(default_factory=list)
    best_val: float = -1.0  # ROUGE is >= 0, so any first evaluation improves on it
    best_step: int = 0
    bad_evals: int = 0
    stopped_early: bool = False
    last_monitored_ece: float | None = None
    judge_state: dict[str, Any] | None = None  # a panel's fitted members (what its refits learned)
    judge_weight: float = 1.0  # shrinks when a divergence alarm down-weights the judge
    # the ceiling arm's labeled training pairs of every step so far (a CalibrationPairs as a dict)
    label_pool: dict[str, Any] | None = None
    alarm_checks: list[dict[str, Any]] = field(default_factory=list)
    alarms: list[dict[str, Any]] = field(default_factory=list)
    stop_reason: str = ""
    # what set the run's float rounding (:func:`judgeloop.devices.numerics`), one entry per start or resume
    numerics: list[dict[str, Any]] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class Splits:
    """The four disjoint article splits of a run."""

    train: list[SummExample]
    calibration: list[SummExample]
    validation: list[SummExample]
    test: list[SummExample]


def load_splits(cfg: FeedbackLoopConfig, num_processes: int = 1) -> Splits:
    """Load the articles, split them by stable hash, and check the calibration/train disjointness and
    that the train split fills one global batch (``batch_size`` on each of ``num_processes``)."""
    parts = split_examples(load_examples(cfg.data), cfg.data.split)
    splits = Splits(
        parts["train"],
        parts["calibration"],
        parts["validation"][: cfg.num_validation_articles],
        parts["test"][: cfg.num_eval_articles],
    )
    for name in ("train", "calibration", "test"):
        if not getattr(splits, name):
            raise ConfigError(
                f"the '{name}' split is empty; use more articles (data.max_articles) or change "
                f"data.split fractions (now {cfg.data.split})"
            )
    keeps_best = cfg.early_stopping_patience or (cfg.alarms.enabled and cfg.alarms.action == "stop")
    if keeps_best and not splits.validation:  # else every step runs and no best_policy/ is ever saved
        what = (
            f"early_stopping_patience={cfg.early_stopping_patience}"
            if cfg.early_stopping_patience
            else ("alarms.action=stop")
        )
        raise ConfigError(
            f"{what} chooses the best validation checkpoint but the 'validation' split is empty; use more "
            f"articles (data.max_articles) or a larger data.split.validation (now {cfg.data.split.validation})"
        )
    if cfg.curve.every_n_steps and not splits.validation:
        raise ConfigError(
            f"curve.every_n_steps={cfg.curve.every_n_steps} draws its curve on validation articles but the "
            "'validation' split is empty; use more articles (data.max_articles) or a larger "
            f"data.split.validation (now {cfg.data.split.validation})"
        )
    step_articles = cfg.articles_per_step  # batch_size, or a round's prompts under mode=rounds
    if len(splits.train) < step_articles * num_processes:  # a process would get a short or empty batch
        per = f" x {num_processes} processes" if num_processes > 1 else ""
        key = "rounds.prompts_per_round" if cfg.mode == "rounds" else "batch_size"
        raise ConfigError(
            f"the train split has {len(splits.train)} articles, fewer than {key}={step_articles}{per}; "
            f"lower {key} or use more data (data.max_articles)"
        )
    for name, asked, have in (
        ("num_eval_articles", cfg.num_eval_articles, len(splits.test)),
        ("num_validation_articles", cfg.num_validation_articles, len(splits.validation)),
    ):
        if have < asked:  # evaluated on what there is, and said so (the report's counts show it too)
            logger.warning(
                "%s=%d but its split has %d articles: evaluating on %d (raise data.max_articles or the "
                "split fraction for more)",
                name,
                asked,
                have,
                have,
            )
    check_calibration_disjoint(splits.train, splits.calibration)
    return splits


def _batch_at(
    epoch: int, cursor: int, train: Sequence[SummExample], cfg: FeedbackLoopConfig, accelerator: Accelerator
) -> tuple[list[SummExample], int, int]:
    """This process's share of the global batch at (epoch, cursor), and the (epoch, cursor) after it
    (a batch is ``batch_size`` articles per process, a round's ``rounds.prompts_per_round`` under
    ``mode: rounds``)."""
    per_process = cfg.articles_per_step
    global_bs = per_process * accelerator.num_processes
    if cursor + global_bs > len(train):
        epoch, cursor = epoch + 1, 0
    order = np.random.RandomState(derive_seed(cfg.seed, "order", epoch)).permutation(len(train))
    idx = order[cursor : cursor + global_bs]
    mine = idx[accelerator.process_index * per_process : (accelerator.process_index + 1) * per_process]
    return [train[i] for i in mine], epoch, cursor + global_bs


def next_batch(
    state: LoopState, train: Sequence[SummExample], cfg: FeedbackLoopConfig, accelerator: Accelerator
) -> list[SummExample]:
    """This process's share of the next global batch (a seeded permutation per epoch; the cursor is checkpointed)."""
    batch, state.epoch, state.cursor = _batch_at(state.epoch, state.cursor, train, cfg, accelerator)
    return batch


def peek_batch(
    state: LoopState, train: Sequence[SummExample], cfg: FeedbackLoopConfig, accelerator: Accelerator
) -> list[SummExample]:
    """The batch :func:`next_batch` will return next, without moving the cursor."""
    return _batch_at(state.epoch, state.cursor, train, cfg, accelerator)[0]
