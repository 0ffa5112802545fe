"""The ``reward_model`` judge: a sequence-classification model with one scalar output.

Each summary is scored as the assistant's reply to "summarize this article" (the chat template
when the tokenizer has one; a text pair ``(prompt, summary)`` otherwise, as BERT-style reward models
expect). Under the Bradley-Terry model ``P(a over b) = sigmoid(r(a) - r(b))``, so the raw preference
logit is ``s = r(a) - r(b)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from judgeloop.judges.prompted import PromptedModelJudge
from judgeloop.judges.prompts import render_chat
from judgeloop.judges.tokens import fit_article, pad_batch
from judgeloop.models import load_sequence_classifier


class RewardModelJudge(PromptedModelJudge):
    """Scalar reward difference.

    Args:
        model: hub id / local path or a loaded sequence classifier with ``num_labels == 1``.
        tokenizer: required with a loaded model.
        prompt: template name; its ``summarize`` form is the user turn the summary answers.
        max_length: token budget per (prompt, summary); only the article is cut.
    """

    kind = "reward_model"
    load = staticmethod(load_sequence_classifier)  # num_labels defaults to 1 there: a scalar head

    def _check_model(self, model_name: str) -> None:
        num_labels = getattr(self.model.config, "num_labels", 1)
        if num_labels != 1:
            raise ValueError(
                f"reward model {model_name!r} has num_labels={num_labels}; the reward_model judge needs a "
                "single scalar head (num_labels=1)"
            )
        if getattr(self.model.config, "pad_token_id", None) is None:
            # decoder classifiers pool the last non-pad token and need to know the pad id to find it
            self.model.config.pad_token_id = self.pad_id

    def _features(self, article: str, summary: str) -> dict[str, list[int]]:
        user = self.prompt.summarize_text(article)
        if self._chat:
            text = render_chat(self.tokenizer, self.prompt.system, user, assistant=summary)
            return {"input_ids": self.tokenizer.encode(text, add_special_tokens=False)}
        enc = self.tokenizer(f"{self.prompt.system}\n\n{user}", summary, add_special_tokens=True)
        return {k: list(v) for k, v in enc.items() if k in ("input_ids", "token_type_ids")}

    def _value_points(
        self, points: Sequence[tuple[str, str, tuple[str, ...]]]
    ) -> tuple[list[float], list[str]]:
        values = [float("nan")] * len(points)
        statuses: list[str] = [""] * len(points)
        feats, rows = [], []
        for i, (article, summary, _) in enumerate(points):

            def render_ids(art: str, summary: str = summary) -> list[int]:
                return self._features(art, summary)["input_ids"]

            ids, statuses[i], used = fit_article(render_ids, self.tokenizer, article, self.max_length)
            if ids is not None:
                feats.append(self._features(used, summary))
                rows.append(i)
        if not feats:
            return values, statuses
        # right padding: classifiers pool the last non-pad token (decoders) or [CLS] (encoders)
        batch = pad_batch([f["input_ids"] for f in feats], self.pad_id, side="right")
        kwargs: dict[str, Any] = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
        if "token_type_ids" in feats[0]:
            kwargs["token_type_ids"] = pad_batch([f["token_type_ids"] for f in feats], 0, side="right")[
                "input_ids"
            ]
        if self._position_ids:
            kwargs["position_ids"] = batch["position_ids"]
        kwargs = {k: v.to(self.device) for k, v in kwargs.items()}
        with torch.inference_mode():
            reward = self.model(**kwargs).logits[:, 0].float()  # (B,)
        for row, value in zip(rows, reward.cpu().tolist()):
            values[row] = value
        return values, statuses
