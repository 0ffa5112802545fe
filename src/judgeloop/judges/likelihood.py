"""The ``likelihood`` judge: how likely a causal LM finds each summary as its reply to "summarize this".

``v(x) = (1/|x|) sum_t log P(x_t | prompt(article), x_<t)`` (length-normalized log-likelihood, so
longer summaries are not penalized just for having more tokens) and ``s = v(a) - v(b)``.

:func:`likelihood_ids` builds the scored sequence (context, then the summary's tokens); the served judge's
``likelihood`` extractor (:mod:`judgeloop.judges.served`) sends the very same ids to a server that
returns prompt log-probabilities.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from judgeloop.judges.choice import DEFAULT_MODEL
from judgeloop.judges.prompted import PromptedModelJudge
from judgeloop.judges.prompts import JudgePrompt, render_chat
from judgeloop.judges.tokens import fit_article, forward_accepts, pad_batch
from judgeloop.models import load_causal_lm


def likelihood_context(tokenizer: Any, prompt: JudgePrompt, article: str) -> str:
    """The text a summary continues: the summarize prompt of ``article`` up to the assistant's reply."""
    return render_chat(tokenizer, prompt.system, prompt.summarize_text(article), marker="Summary:\n")


def likelihood_ids(
    tokenizer: Any, prompt: JudgePrompt, chat: bool, article: str, summary: str, max_length: int
) -> tuple[list[int] | None, int, str]:
    """The sequence whose summary tokens the likelihood judge scores: ``(ids, n_summary, status)``.

    ``ids`` is the context's tokens (special tokens added when there is no chat template) followed by the
    summary's ``n_summary`` tokens, the article cut to fit ``max_length``; status ``ok``, ``truncated``,
    ``too_long`` (``ids`` is ``None``) or ``empty_summary`` (``ids`` is ``None``, ``n_summary`` 0).
    """
    target = tokenizer.encode(summary, add_special_tokens=False)
    if not target:
        return None, 0, "empty_summary"

    def render_ids(art: str) -> list[int]:
        return (
            tokenizer.encode(likelihood_context(tokenizer, prompt, art), add_special_tokens=not chat) + target
        )

    ids, status, _ = fit_article(render_ids, tokenizer, article, max_length)
    return ids, len(target), status


class LikelihoodJudge(PromptedModelJudge):
    """Length-normalized log-likelihood difference under a causal LM.

    Args:
        model: hub id / local path or a loaded causal LM (then pass ``tokenizer``).
        prompt: template name; its ``summarize`` form is the context the summary continues.
        max_length: token budget of prompt + summary; only the article is cut (``truncated``);
            a summary that cannot fit with an empty article is ``too_long``.
        batch_size: summaries per forward pass.
    """

    kind = "likelihood"
    default_model = DEFAULT_MODEL
    load = staticmethod(load_causal_lm)

    def _check_model(self, model_name: str) -> None:
        self._logits_to_keep = forward_accepts(self.model, "logits_to_keep")

    def context(self, article: str) -> str:
        """The text the summary continues: the summarize prompt up to the assistant's reply."""
        return likelihood_context(self.tokenizer, self.prompt, article)

    def _value_points(
        self, points: Sequence[tuple[str, str, tuple[str, ...]]]
    ) -> tuple[list[float], list[str]]:
        values = [float("nan")] * len(points)
        statuses: list[str] = [""] * len(points)
        seqs, lengths, rows = [], [], []
        for i, (article, summary, _) in enumerate(points):
            ids, n_summary, statuses[i] = likelihood_ids(
                self.tokenizer, self.prompt, self._chat, article, summary, self.max_length
            )
            if ids is not None:
                seqs.append(ids)
                lengths.append(n_summary)
                rows.append(i)
        if not seqs:
            return values, statuses
        # Left padding aligns every summary at the right edge, so only the last n_max + 1 positions
        # need logits: position t predicts token t + 1.
        n_max = max(lengths)
        batch = {k: v.to(self.device) for k, v in pad_batch(seqs, self.pad_id, side="left").items()}
        kwargs: dict[str, Any] = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
        if self._position_ids:
            kwargs["position_ids"] = batch["position_ids"]
        if self._logits_to_keep:
            kwargs["logits_to_keep"] = n_max + 1
        with torch.inference_mode():
            logits = self.model(**kwargs).logits[:, -(n_max + 1) : -1, :]  # (B, n_max, V)
            targets = batch["input_ids"][:, -n_max:]  # (B, n_max)
            logp = logits.float().log_softmax(-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # (B, n_max)
            n = torch.tensor(lengths, device=logp.device)
            mask = torch.arange(n_max, device=logp.device)[None, :] >= (n_max - n)[:, None]  # summary tokens
            mean_logp = (logp * mask).sum(-1) / n  # (B,)
        for row, value in zip(rows, mean_logp.cpu().tolist()):
            values[row] = value
        return values, statuses
