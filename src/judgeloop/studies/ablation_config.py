"""The ablation's settings: ``ablation:`` (:class:`AblationConfig`), and :class:`AblateConfig`, the schema of
``judgeloop ablate``: the loop's own config plus that section.

The arm x seed grid is a study of the loop, not a part of it, so its settings live here, above the loop
(:mod:`judgeloop.loop.config` knows nothing of them). One YAML file serves both commands:
``judgeloop train`` reads a file's ``ablation:`` section as another command's (accepted, unread:
``FeedbackLoopConfig.SHARED_SECTIONS``), and ``judgeloop ablate`` checks it here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from judgeloop.config import bounded, check_fields
from judgeloop.loop.config import ARMS, RESUME_FREE_KEYS, FeedbackLoopConfig
from judgeloop.loop.metrics_table import TARGET, keys

#: what ``ablation.style_metric`` may name: the premise check's metrics but the task's target
STYLE_METRICS = tuple(k for k in keys("premise") if k != TARGET)


@dataclass
class AblationConfig:
    """The arm x seed grid and how it is run and compared.

    Arms are compared with ``baseline`` (default ``raw``) on per-article differences paired on
    (seed, article), with a two-level bootstrap (``bootstrap_samples`` replicates, ``bootstrap_seed``).
    ``style_metric`` / ``style_direction``: what the judge's bias rewards (for the premise check: did
    the raw arm drift that way?). ``num_workers``: jobs run at once on this machine, the CPU cores split
    between them (``null``: auto, one single-thread job per core as memory allows on CPU, one on a GPU;
    see :func:`judgeloop.studies.ablation.default_workers` for the measurement behind it).
    ``share_start_work``: compute what every run of a seed shares before step 1 once (the loop's ``start_cache``, :mod:`judgeloop.loop.start_cache`).
    ``threads_per_job``: the intra-op thread count of every job, however it is launched (one process,
    workers, or ``--job`` on a cluster task), recorded in the job's config as its ``threads``; float
    reductions split over another number of threads round differently, and training amplifies that, so a
    grid whose jobs ran at different counts would mix that noise into its paired differences
    (``--aggregate`` refuses one). Default 1: the workers' one single-thread job per core. ``null``: each
    job keeps the thread count of the process it runs in (not comparable across launches).
    ``save_every_n_steps``: every job keeps its newest checkpoint at this interval and runs with
    ``resume_from: auto``, so a job killed or preempted mid-run and started again with the same ``--job``
    continues from it (0: no checkpoints, a rerun starts over). Default 1: a checkpoint costs a few percent
    of a tiny job's steps and well under 1% of a quickstart job's (measured: docs/benchmarks.md "Figures
    behind config defaults").
    """

    arms: list[str] = field(default_factory=lambda: ["raw", "platt", "isotonic", "oracle"])
    seeds: list[int] = field(default_factory=lambda: [0, 1])
    baseline: str = "raw"
    style_metric: str = "copy_rate"
    style_direction: Literal["increase", "decrease"] = "increase"
    bootstrap_samples: int = bounded(
        4000, ge=1000, message="{key}={value} is too few for a 95% interval; use >= 1000"
    )
    bootstrap_seed: int = bounded(0, ge=0, le=2**32 - 1)
    num_workers: int | None = bounded(None, ge=1, hint=", or null for auto", shape="section")
    share_start_work: bool = True
    threads_per_job: int | None = bounded(
        1, ge=1, hint=", or null for the launching process's count", shape="section"
    )
    save_every_n_steps: int = bounded(1, ge=0, hint=" (0: no checkpoints)", shape="section")

    def __post_init__(self) -> None:
        check_fields("ablation", self)
        bad = [a for a in self.arms if a not in ARMS]
        if bad:
            raise ValueError(f"ablation.arms has unknown arm(s) {bad}; choose from {list(ARMS)}")
        if not self.arms or not self.seeds:
            raise ValueError("ablation.arms and ablation.seeds must not be empty")
        named: tuple[tuple[str, list[Any]], ...] = (("arms", list(self.arms)), ("seeds", list(self.seeds)))
        for key, values in named:
            dups = sorted({v for v in values if values.count(v) > 1}, key=str)
            if dups:
                raise ValueError(
                    f"ablation.{key}={list(values)} lists {', '.join(map(str, dups))} more than once; a repeated "
                    "run would count as an independent one and fake a confidence interval. List each once"
                )
        if self.baseline not in self.arms:
            raise ValueError(
                f"ablation.baseline={self.baseline!r} is not among ablation.arms {self.arms}; add it or pick one"
            )
        if self.style_metric not in STYLE_METRICS:
            raise ValueError(f"ablation.style_metric={self.style_metric!r}; use one of {list(STYLE_METRICS)}")


@dataclass
class AblateConfig(FeedbackLoopConfig):
    """Schema of ``judgeloop ablate``: every job's loop config
    (:class:`~judgeloop.loop.config.FeedbackLoopConfig`) plus the grid (``ablation``). Each job runs the loop on this config with its arm and seed set
    (:func:`judgeloop.studies.ablation.arm_config`)."""

    SHARED_SECTIONS: ClassVar[dict[str, str]] = {}
    RUN_FREE_KEYS: ClassVar[tuple[str, ...]] = RESUME_FREE_KEYS  # "ablation" among them
    ablation: AblationConfig = field(default_factory=AblationConfig)


__all__ = ["STYLE_METRICS", "AblateConfig", "AblationConfig"]
