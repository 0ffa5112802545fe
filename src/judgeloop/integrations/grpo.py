"""The schema and the parts of ``recipes/grpo_trl.py``: TRL's ``GRPOTrainer`` rewarded by a calibrated
judge saved by ``judgeloop calibrate`` (groupwise rewards, :class:`~judgeloop.integrations.trl.JudgeReward`).

The dataset TRL trains on has a conversational ``prompt`` (the summarization instruction with the
article), the ``article`` the judge reads the completions against and the ``reference`` summary (the
``anchor`` scheme's anchor).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from judgeloop.config import bounded, check_fields
from judgeloop.data import DataConfig, SplitConfig
from judgeloop.judges.calibrated import check_judge_path
from judgeloop.loop.config import PolicyBase
from judgeloop.rewards import RewardConfig


@dataclass
class GrpoPolicyConfig(PolicyBase):
    """The policy TRL trains (``policy.*``, the keys and checks of :class:`~judgeloop.loop.config.PolicyBase`):
    LoRA adapters by default (peft, through TRL's ``peft_config``)."""

    model: str = "HuggingFaceTB/SmolLM2-135M-Instruct"
    lora: bool = True


@dataclass
class GrpoTrainConfig:
    """TRL's ``GRPOConfig`` settings the recipe sets (``grpo.*``); ``per_device_train_batch_size`` counts
    completions and must be a multiple of ``num_generations`` (each group on one process)."""

    num_generations: int = bounded(
        4, ge=2, hint=" (a group needs two completions to compare)", shape="section"
    )
    per_device_train_batch_size: int = bounded(8, ge=0)
    max_completion_length: int = bounded(24, ge=0)
    temperature: float = bounded(1.0, gt=0, hint=" (a sampling / softmax temperature)")
    learning_rate: float = bounded(1e-4, gt=0)
    beta: float = bounded(0.04, ge=0, hint=" (TRL's KL weight; 0: no reference model)")
    max_steps: int = bounded(10, ge=1, shape="section")
    logging_steps: int = bounded(1, ge=1)
    seed: int = bounded(0, ge=0, le=2**32 - 1)

    def __post_init__(self) -> None:
        check_fields("grpo", self)
        if self.per_device_train_batch_size % self.num_generations:
            raise ValueError(
                f"grpo.per_device_train_batch_size={self.per_device_train_batch_size} is not a multiple of "
                f"grpo.num_generations={self.num_generations}; a group's completions must be on one process"
            )


@dataclass
class GrpoTrlConfig:
    """Schema of ``recipes/grpo_trl.py``."""

    judge_path: str = ""
    judge_overrides: list[str] = field(default_factory=list)
    policy: GrpoPolicyConfig = field(default_factory=GrpoPolicyConfig)
    RENAMED: ClassVar[dict[str, str]] = {"reward": "rewards"}
    rewards: RewardConfig = field(default_factory=RewardConfig)  # anchor: the article's reference summary
    grpo: GrpoTrainConfig = field(default_factory=GrpoTrainConfig)
    data: DataConfig = field(default_factory=lambda: DataConfig(split=SplitConfig(calibration=0.2, test=0.1)))
    max_train_articles: int | None = bounded(None, ge=0)
    device: Literal["auto", "cpu", "cuda"] = "auto"
    output_dir: str = "runs/grpo_trl"
    overwrite: bool = False  # true: clear an output_dir that holds another run (judgeloop.rundir)

    def __post_init__(self) -> None:
        check_fields("", self)
        check_judge_path(self.judge_path, on_disk=False)


def prompt_rows(examples: list[Any], tokenizer: Any, policy: GrpoPolicyConfig) -> list[dict[str, Any]]:
    """TRL's rows: a conversational ``prompt`` (the article cut to ``max_article_tokens`` tokens), the
    ``article`` the judge reads and the ``reference`` summary."""
    rows = []
    for ex in examples:
        ids = tokenizer(ex.article, add_special_tokens=False)["input_ids"][: policy.max_article_tokens]
        article = tokenizer.decode(ids)
        content = policy.prompt_template.format(article=article)
        rows.append(
            {
                "prompt": [{"role": "user", "content": content}],
                "article": ex.article,
                "reference": ex.neutral[0] if ex.neutral else "",
            }
        )
    return rows


__all__ = ["GrpoPolicyConfig", "GrpoTrainConfig", "GrpoTrlConfig", "prompt_rows"]
