"""The shared constructor of the pointwise judges that read a summary as the reply to a prompt.

:class:`~judgeloop.judges.likelihood.LikelihoodJudge` and
:class:`~judgeloop.judges.reward_model.RewardModelJudge` differ in the model they load and in how they
value a summary, not in how they are built: both take a prompt template, a model (hub id, path, or a
loaded model with its tokenizer), a token budget and the judge's cache settings.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

from judgeloop.judges.base import PointwiseJudge
from judgeloop.judges.prompts import get_prompt, has_chat_template
from judgeloop.judges.tokens import ModelBacked, attach_judge_model, forward_accepts


class PromptedModelJudge(PointwiseJudge, ModelBacked):
    """Base of the prompted pointwise judges; subclasses set ``kind``, ``default_model`` and ``load``.

    Args:
        model: hub id / local path or a loaded model (then pass ``tokenizer``); ``None`` takes the
            class's ``default_model``.
        prompt: template name; its ``summarize`` form is the user turn the summary answers.
        max_length: token budget of prompt + summary; only the article is cut (``truncated``).
        batch_size: summaries per forward pass.
        device: ``cpu``, ``cuda[:i]``, ``mps`` or ``auto`` (the GPU when there is one).
    """

    kind: ClassVar[str]
    default_model: ClassVar[str | None] = None
    load: ClassVar[Callable[..., Any]]

    def __init__(
        self,
        model: str | Any = None,
        tokenizer: Any = None,
        prompt: str = "neutral",
        position_debias: bool = False,
        batch_size: int = 8,
        max_length: int = 2048,
        device: str = "cpu",
        dtype: str = "float32",
        cache_size: int = 100_000,
    ):
        if model is None:
            if self.default_model is None:
                raise ValueError(f"the {self.kind} judge has no default model; set judge.model")
            model = self.default_model
        self.prompt = get_prompt(prompt)
        model_name = attach_judge_model(self, model, tokenizer, type(self).load, dtype, device, max_length)
        self._chat = has_chat_template(self.tokenizer)
        self._position_ids = forward_accepts(self.model, "position_ids")
        self._check_model(model_name)
        name = f"{self.kind}|{model_name}|{prompt}|{max_length}"
        super().__init__(name, position_debias=position_debias, batch_size=batch_size, cache_size=cache_size)

    def _check_model(self, model_name: str) -> None:
        """Hook: refuse a model the judge cannot use, or adapt its config (after it is attached)."""
