"""The ``choice`` judge: ask a causal LM which of two summaries is better and read its verdict logits.

The judge prompt (a chat template when the tokenizer has one, with the generation prompt and the
template's fixed ``answer_prefix``) ends where the model would write its answer. At that single
position, ``s = log P(verdict A) - log P(verdict B)`` (log-softmax over the full vocabulary). No text
is generated or parsed. Position bias (preferring whichever summary is shown first) is real for
small judges, so both orders are scored and combined by default (see ``base.combine_orders``).

The article comes before the summaries in every template, so all the prompts about one article
(both orders, every pair of candidates) share a long token prefix. Its key/value cache is computed
once and kept in a small LRU (``prefix_cache_size``); only the summaries and the question are run
per prompt. This is exact (same logits up to float rounding) and cuts the cost of judging several
candidates of one article several-fold.
"""

from __future__ import annotations

import copy
import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch

from judgeloop.judges.base import Judge, Pair
from judgeloop.judges.prompts import get_prompt, has_chat_template, render_choice
from judgeloop.judges.tokens import ModelBacked, attach_judge_model, fit_article, forward_accepts, pad_batch
from judgeloop.models import load_causal_lm

DEFAULT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


def verdict_token_ids(tokenizer: Any, verdict_tokens: Sequence[str]) -> tuple[int, int]:
    """Ids of the two verdict strings; each must be exactly one token, and they must differ."""
    if len(verdict_tokens) != 2:
        raise ValueError(
            f"judge.verdict_tokens={list(verdict_tokens)!r}; give exactly two strings, e.g. ['A', 'B']"
        )
    ids = []
    for v in verdict_tokens:
        enc = tokenizer.encode(v, add_special_tokens=False)
        if len(enc) != 1:
            pieces = tokenizer.convert_ids_to_tokens(enc)
            raise ValueError(
                f"judge.verdict_tokens: {v!r} is {len(enc)} tokens {pieces} for this tokenizer; each verdict "
                "must be a single token (use a short label such as 'A', or try it with a leading space, ' A')"
            )
        ids.append(enc[0])
    if ids[0] == ids[1]:
        raise ValueError(
            f"judge.verdict_tokens={list(verdict_tokens)!r} map to the same token id {ids[0]}; use two different labels"
        )
    return ids[0], ids[1]


class ChoiceJudge(Judge, ModelBacked):
    """Pairwise LLM judge reading verdict-token log-probabilities.

    Args:
        model: hub id / local path (loaded with ``judgeloop.models.load_causal_lm``) or a loaded causal LM.
        tokenizer: required when ``model`` is a loaded model; loaded by name otherwise.
        prompt: template name from ``judgeloop.judges.prompts.PROMPTS``.
        verdict_tokens: the two answer labels, each a single token; their stripped text labels the
            summaries in the prompt.
        position_debias: score both orders and combine (default on).
        batch_size: prompts per forward pass (left padded).
        max_length: token budget of a prompt; the article alone is cut to fit (status ``truncated``),
            and a prompt that cannot fit even without the article is ``too_long``.
        device, dtype: where and how the model runs.
        prefix_cache_size: article prefixes whose key/value cache is kept (0 disables prefix reuse).
    """

    def __init__(
        self,
        model: str | Any = DEFAULT_MODEL,
        tokenizer: Any = None,
        prompt: str = "neutral",
        verdict_tokens: Sequence[str] = ("A", "B"),
        position_debias: bool = True,
        batch_size: int = 8,
        max_length: int = 2048,
        device: str = "cpu",
        dtype: str = "float32",
        cache_size: int = 100_000,
        prefix_cache_size: int = 4,
    ):
        self.prompt = get_prompt(prompt)
        model_name = attach_judge_model(self, model, tokenizer, load_causal_lm, dtype, device, max_length)
        self.verdict_ids = verdict_token_ids(self.tokenizer, verdict_tokens)
        self.labels = (verdict_tokens[0].strip(), verdict_tokens[1].strip())
        self._chat = has_chat_template(self.tokenizer)
        self._logits_to_keep = forward_accepts(self.model, "logits_to_keep")
        self._position_ids = forward_accepts(self.model, "position_ids")
        self._cache_kw = next(
            (k for k in ("cache", "past_key_values") if forward_accepts(self.model, k)), None
        )
        self.prefix_cache_size = prefix_cache_size if (self._cache_kw and self._position_ids) else 0
        self._prefixes: OrderedDict[str, Any] = OrderedDict()
        self.prefix_hits = 0
        self.verdict_mass_sum = 0.0
        self.verdict_mass_n = 0
        name = f"choice|{model_name}|{prompt}|{verdict_tokens[0]}|{verdict_tokens[1]}|{max_length}"
        super().__init__(name, position_debias=position_debias, batch_size=batch_size, cache_size=cache_size)

    @property
    def mean_verdict_mass(self) -> float:
        """Mean P(verdict A) + P(verdict B) at the answer position over items scored so far.

        Near 1: the model answers in the asked format; near 0: it would write something else first,
        and its verdict logits are a weaker signal.
        """
        return self.verdict_mass_sum / self.verdict_mass_n if self.verdict_mass_n else float("nan")

    def render(self, article: str, a: str, b: str) -> str:
        """The full judge prompt text for one order, up to the answer position."""
        return render_choice(self.tokenizer, self.prompt, article, a, b, self.labels)

    def _ids(self, pair: Pair) -> tuple[list[int] | None, str, int]:
        """Prompt token ids, status, and the length of the prefix shared by every prompt on this article."""

        def render_ids(article: str, a: str = pair.a, b: str = pair.b) -> list[int]:
            text = self.render(article, a, b)
            # a chat template writes its own special tokens; plain text gets the tokenizer's (e.g. BOS)
            return self.tokenizer.encode(text, add_special_tokens=not self._chat)

        ids, status, used = fit_article(render_ids, self.tokenizer, pair.article, self.max_length)
        if ids is None:
            return None, status, 0
        # the prefix is what this prompt shares with the same article's prompt for empty summaries
        # (compared as token ids, so it is exact whatever the tokenizer merges); keep >= 1 token after it
        dummy = render_ids(used, "", "")
        n = 0
        for x, y in zip(ids, dummy):
            if x != y:
                break
            n += 1
        return ids, status, min(n, len(ids) - 1)

    def _model_kwargs(self, batch: dict[str, torch.Tensor]) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
        if self._position_ids:
            kwargs["position_ids"] = batch["position_ids"]
        if self._logits_to_keep:
            kwargs["logits_to_keep"] = 1
        return kwargs

    def _prefix_cache(self, prefix: list[int]) -> Any:
        """Key/value cache of ``prefix`` (one row), from the LRU or computed now."""
        key = hashlib.sha256(torch.tensor(prefix, dtype=torch.int64).numpy().tobytes()).hexdigest()
        if key in self._prefixes:
            self._prefixes.move_to_end(key)
            self.prefix_hits += 1
            return self._prefixes[key]
        kwargs: dict[str, Any] = {"input_ids": torch.tensor([prefix], device=self.device), "use_cache": True}
        if self._logits_to_keep:
            kwargs["logits_to_keep"] = 1
        out = self.model(**kwargs)
        cache = out.cache if getattr(out, "cache", None) is not None else out.past_key_values
        self._prefixes[key] = cache
        while len(self._prefixes) > self.prefix_cache_size:
            self._prefixes.popitem(last=False)
        return cache

    def _answer_logits(self, seqs: list[list[int]], prefix_lens: list[int]) -> torch.Tensor:
        """Next-token logits at the answer position (the end of each prompt): (B, V).

        Without prefix reuse: one left-padded batch. With it: prompts are grouped by their shared
        prefix, and each group runs only its suffixes on a copy of the prefix's cache.
        """
        if not self.prefix_cache_size:
            batch = {k: v.to(self.device) for k, v in pad_batch(seqs, self.pad_id, side="left").items()}
            return self.model(**self._model_kwargs(batch)).logits[:, -1, :]
        groups: dict[tuple[int, ...], list[int]] = {}
        for i, (ids, n) in enumerate(zip(seqs, prefix_lens)):
            groups.setdefault(tuple(ids[:n]), []).append(i)
        parts: dict[int, torch.Tensor] = {}
        for prefix_t, rows in groups.items():
            n = len(prefix_t)
            cache = self._prefix_cache(list(prefix_t)) if n else None
            # a cache type that cannot be repeated along the batch gets one suffix per forward pass
            one_by_one = cache is not None and not hasattr(cache, "batch_repeat_interleave")
            for chunk in [[r] for r in rows] if one_by_one else [rows]:
                logits = self._suffix_logits(cache, n, [seqs[i][n:] for i in chunk])  # (b, V)
                parts.update(zip(chunk, logits))
        return torch.stack([parts[i] for i in range(len(seqs))])

    def _suffix_logits(self, cache: Any, n_prefix: int, suffixes: list[list[int]]) -> torch.Tensor:
        """Answer-position logits (b, V) of each ``prefix + suffix``, given the prefix's cache.

        Suffixes are left padded after the prefix: the padding holes are masked out and position
        ids count real tokens only, so each row sees exactly its own unpadded prompt.
        """
        batch = pad_batch(suffixes, self.pad_id, side="left")
        mask = torch.cat(
            [torch.ones((len(suffixes), n_prefix), dtype=torch.long), batch["attention_mask"]], 1
        )
        batch["position_ids"] = (mask.cumsum(-1) - 1).clamp(min=0)[:, n_prefix:]
        batch["attention_mask"] = mask  # (b, P + S)
        batch = {k: v.to(self.device) for k, v in batch.items()}
        kwargs = self._model_kwargs(batch)
        if cache is not None and self._cache_kw is not None:
            cache = copy.deepcopy(cache)  # the forward pass appends to it
            if len(suffixes) > 1:
                cache.batch_repeat_interleave(len(suffixes))
            kwargs[self._cache_kw] = cache
            kwargs["use_cache"] = True
        return self.model(**kwargs).logits[:, -1, :]

    def _score_ordered(self, pairs: Sequence[Pair]) -> tuple[list[float], list[str]]:
        scores = [float("nan")] * len(pairs)
        statuses: list[str] = [""] * len(pairs)
        seqs, prefix_lens, rows = [], [], []
        for i, p in enumerate(pairs):
            ids, statuses[i], n_prefix = self._ids(p)
            if ids is not None:
                seqs.append(ids)
                prefix_lens.append(n_prefix)
                rows.append(i)
        if not seqs:
            return scores, statuses
        with torch.inference_mode():
            logp = self._answer_logits(seqs, prefix_lens).float().log_softmax(-1)  # (B, V)
            id_a, id_b = self.verdict_ids
            s = (logp[:, id_a] - logp[:, id_b]).cpu().tolist()
            mass = (logp[:, id_a].exp() + logp[:, id_b].exp()).cpu()
        finite = torch.isfinite(mass)
        self.verdict_mass_sum += float(mass[finite].sum())
        self.verdict_mass_n += int(finite.sum())
        for row, value in zip(rows, s):
            scores[row] = value  # nan/inf -> "nonfinite" in the base class
        return scores, statuses
