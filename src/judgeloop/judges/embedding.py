"""The ``embedding`` judge: which summary is semantically closer to the article (or the references).

Texts are embedded as sentence-transformers does for mean-pooling models such as
``all-MiniLM-L6-v2``: the encoder's token embeddings are averaged over the attention mask, then
L2-normalized. ``v(x) = scale * cos(e(x), e(target))``, where the target is the article or, with
``target="references"``, the mean of the cosines to each reference; ``s = v(a) - v(b)``. With
``target="extractive"`` the references are the extractive ones (the caller passes them, see
:func:`judgeloop.judges.references_for`): a judge biased toward the extractive style by design.

``scale`` turns a cosine difference (at most 2, usually a few hundredths) into a logit-sized
number; the default 20 is the scale sentence-transformers' ``MultipleNegativesRankingLoss`` puts on
cosines before its softmax, i.e. the temperature 1/20 these models were trained with.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F

from judgeloop.judges.base import VALID_STATUSES, Pair, PointwiseJudge, merge_status
from judgeloop.judges.tokens import ModelBacked, attach_judge_model, model_max_length
from judgeloop.models import load_encoder, resolve_model_path
from judgeloop.models.tiny import is_tiny

DEFAULT_ENCODER = "sentence-transformers/all-MiniLM-L6-v2"


def mean_pool(token_embeddings: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Mean of token embeddings (B, T, H) over the mask (B, T) -> (B, H), as sentence-transformers' Pooling."""
    mask = attention_mask.unsqueeze(-1).to(token_embeddings.dtype)  # (B, T, 1)
    return (token_embeddings * mask).sum(1) / mask.sum(1).clamp(min=1e-9)


def _sentence_transformers_max_length(name: str) -> int | None:
    """``max_seq_length`` from a sentence-transformers model folder, if ``name`` resolves to one."""
    if is_tiny(name):
        return None
    path = Path(resolve_model_path(name)) / "sentence_bert_config.json"
    if not path.is_file():
        return None
    value = json.loads(path.read_text()).get("max_seq_length")
    return int(value) if isinstance(value, int) and value > 0 else None


class EmbeddingJudge(PointwiseJudge, ModelBacked):
    """Cosine-similarity difference to the article or to the references, times ``scale``.

    Args:
        model: hub id / local path of an encoder, or a loaded encoder (then pass ``tokenizer``).
        target: ``"article"`` or ``"references"`` (pairs must then carry ``references``).
        scale: multiplies the cosine difference (default 20, see the module docstring).
        max_length: token budget per text, capped at the model's own limit (``max_seq_length`` of a
            sentence-transformers folder, else position embeddings / tokenizer limit). A longer
            article or reference is cut (``truncated``); a longer summary is ``too_long``.
        batch_size: texts per forward pass.
    """

    def __init__(
        self,
        model: str | Any = DEFAULT_ENCODER,
        tokenizer: Any = None,
        target: Literal["article", "references", "extractive"] = "article",
        scale: float = 20.0,
        position_debias: bool = False,
        batch_size: int = 32,
        max_length: int = 2048,
        device: str = "cpu",
        dtype: str = "float32",
        cache_size: int = 100_000,
    ):
        if target not in ("article", "references", "extractive"):
            raise ValueError(f"embedding target={target!r}; use 'article', 'references' or 'extractive'")
        limits = [max_length]
        if isinstance(model, str) and (st_max := _sentence_transformers_max_length(model)) is not None:
            limits.append(st_max)
        model_name = attach_judge_model(self, model, tokenizer, load_encoder, dtype, device, max_length)
        if (own := model_max_length(self.model, self.tokenizer)) is not None:
            limits.append(own)
        self.max_length = min(limits)
        self.reference_style = "extractive" if target == "extractive" else "neutral"
        self.target = "references" if target == "extractive" else target
        self.scale = scale
        self._embeddings: OrderedDict[tuple[str, bool], tuple[torch.Tensor, str]] = OrderedDict()
        name = f"embedding|{model_name}|{target}|{scale}|{self.max_length}"  # extractive != references
        super().__init__(name, position_debias=position_debias, batch_size=batch_size, cache_size=cache_size)

    def embed(self, texts: Sequence[str], is_target: bool) -> list[tuple[torch.Tensor, str]]:
        """Normalized embeddings (H,) with a status each; cached per text.

        A target text over the budget is cut (``truncated``); a summary over it is ``too_long``.
        """
        todo = list(dict.fromkeys(t for t in texts if (t, is_target) not in self._embeddings))
        todo.sort(key=len)  # similar lengths share a batch: less padding
        for start in range(0, len(todo), self.batch_size):
            chunk = todo[start : start + self.batch_size]
            n_tokens = [len(self.tokenizer.encode(t, add_special_tokens=True)) for t in chunk]
            enc = self.tokenizer(
                chunk, padding=True, truncation=True, max_length=self.max_length, return_tensors="pt"
            ).to(self.device)
            with torch.inference_mode():
                hidden = self.model(**enc).last_hidden_state  # (B, T, H)
                emb = F.normalize(mean_pool(hidden.float(), enc["attention_mask"]), p=2, dim=-1).cpu()
            for text, vec, n in zip(chunk, emb, n_tokens):
                status = "ok" if n <= self.max_length else ("truncated" if is_target else "too_long")
                self._embeddings[(text, is_target)] = (vec, status)
        result = [self._embeddings[(t, is_target)] for t in texts]
        if not self.cache_size:  # cache disabled: keep embeddings only for the duration of this call
            self._embeddings.clear()
        while len(self._embeddings) > self.cache_size:
            self._embeddings.popitem(last=False)
        return result

    @property
    def can_prepare(self) -> bool:
        return bool(self.cache_size)  # without a cache nothing prepared would survive until the judge call

    def _prepare(self, articles: Sequence[str], references: Sequence[tuple[str, ...]]) -> None:
        if not self.cache_size:  # nothing would survive until the judge call
            return
        if self.target == "references":
            self.embed([r for refs in references for r in refs], is_target=True)
        else:
            self.embed(list(articles), is_target=True)

    def _score_ordered(self, pairs: Sequence[Pair]) -> tuple[list[float], list[str]]:
        if self.target == "references":
            missing = sum(1 for p in pairs if not p.references)
            if missing:
                raise ValueError(
                    f"embedding judge with target='references' got {missing} of {len(pairs)} pairs without "
                    "references; give each pair its references (CalibratedJudge.compare(..., references=)); a saved "
                    "judge keeps its target, so for one that reads the article calibrate again with "
                    "judge.embedding_target=article"
                )
        return super()._score_ordered(pairs)

    def _value_points(
        self, points: Sequence[tuple[str, str, tuple[str, ...]]]
    ) -> tuple[list[float], list[str]]:
        if self.target == "references":
            targets = [list(refs) for _, _, refs in points]
        else:
            targets = [[article] for article, _, _ in points]
        summaries = self.embed([s for _, s, _ in points], is_target=False)
        flat = self.embed([t for group in targets for t in group], is_target=True)
        values, statuses, k = [], [], 0
        for (s_vec, s_status), group in zip(summaries, targets):
            status = s_status
            cosines = []
            for t_vec, t_status in flat[k : k + len(group)]:
                status = merge_status(status, t_status)
                cosines.append(float(s_vec @ t_vec))
            k += len(group)
            values.append(
                self.scale * sum(cosines) / len(cosines) if status in VALID_STATUSES else float("nan")
            )
            statuses.append(status)
        return values, statuses
