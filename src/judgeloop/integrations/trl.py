"""judgeloop's calibrated judge inside TRL's trainers.

* :class:`JudgeReward`: a reward function for ``GRPOTrainer`` and ``RLOOTrainer`` (``reward_funcs=``):
  groupwise rewards from pairwise calibrated judgements (:mod:`judgeloop.rewards`), the groups read from
  TRL's batch layout (each prompt's ``num_generations`` completions side by side) and checked against the
  prompts. In ``anchor`` mode each completion is judged against its row's anchor column alone, which is
  also what TRL's online DPO (``trl.experimental.online_dpo``) accepts.
* :func:`soft_dpo_trainer`: TRL's ``DPOTrainer`` with a per-pair soft target read from the dataset's
  ``p_chosen`` column (what ``judgeloop label-pairs`` writes): judgeloop's soft-target DPO loss
  (:func:`judgeloop.loop.losses.soft_dpo_loss`) in place of the hard one.

TRL passes reward functions ``prompts``, ``completions`` and every other dataset column by name; the
judge's source text (the article the completion summarizes) comes from such a column
(``source_column``), never parsed out of the chat prompt.
"""

from __future__ import annotations

import numbers
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from judgeloop.rewards import EmptyLoses, Group, RewardConfig, checked_reward_config, is_empty, score_groups


def completion_text(completion: Any) -> str:
    """The text of a TRL completion: a string, or a conversational completion (a list of messages,
    the assistant's content joined)."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list) and all(isinstance(m, dict) for m in completion):
        return "".join(
            str(m.get("content", "")) for m in completion if m.get("role", "assistant") == "assistant"
        )
    raise ValueError(
        f"a completion of type {type(completion).__name__} is neither text nor a list of chat messages"
    )


def _is_int(value: Any) -> bool:
    """An integer setting: a Python or numpy integer, not a bool or a float."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


class JudgeReward:
    """A TRL reward function backed by a calibrated judge.

    Args:
        judge: a :class:`~judgeloop.judges.calibrated.CalibratedJudge` (or a folder it loads from).
        rewards: the scheme, aggregate, ``m``, prior and probability
            (:class:`~judgeloop.rewards.RewardConfig`; None: its defaults), passed whole to
            :func:`judgeloop.rewards.score_groups`.
        num_generations: completions per prompt in TRL's batch (``GRPOConfig.num_generations``); None
            reads each group as a run of identical consecutive prompts. ``anchor`` mode judges every row
            alone and needs no groups.
        source_column: the dataset column with the text the judge reads the completions against.
        anchor_column: the column with each row's anchor completion (``anchor`` scheme).
        reference_column: the column with each row's reference summaries (a list of texts, or one text);
            required, and checked at construction, for a judge that reads references
            (``judge.needs.reads_references``); a row without any is an error naming the column.
        empty: ``lose`` (default, like the server's ``empty_completions: lose``): an empty completion
            is not judged and gets the lowest reward of its group under either aggregate; ``judge``:
            the judge is asked about it like any other text.
        deprecated: the settings as keywords, ``JudgeReward(judge, scheme=..., aggregate=...)``, the
            spelling before 0.2.0 (whose scheme defaulted to ``all_pairs``): accepted until 0.3.0 with a
            ``DeprecationWarning`` that names ``JudgeReward(judge, RewardConfig(...))`` with the same values.

    Raises:
        ValueError: an argument the GRPO recipe's config would refuse (a ``num_generations`` or
            ``keep_history`` that is no integer in range, an empty column name, an unknown ``empty``), a
            judge that reads references without ``reference_column``, ``anchor`` without
            ``anchor_column``; one line naming the value and the fix. :class:`RewardConfig` checks its own.
        TypeError: ``rewards`` that is not a :class:`RewardConfig`, or an unknown keyword.

    Each call judges the whole batch in one judge call, and logs through TRL (``log_metric``, when the
    trainer passes it): ``judge/comparisons_per_group``, ``judge/failed``, ``judge/mean_p``,
    ``judge/empty`` (empty completions), and the ones that show the judge's signal:
    ``judge/reward_std`` (mean spread of the rewards within a group), ``judge/mean_margin`` (mean
    |p - 0.5|) and ``judge/order_agreement`` (both orders name the same winner); that one and
    ``judge/position_bias`` are logged only when both orders were scored (a pairwise judge), and no metric
    is logged for a call that judged nothing it needs (e.g. ``judge/mean_margin`` with k = 2 and one
    completion empty): never NaN. ``history`` keeps the last calls' inputs and rewards (``keep_history``).
    """

    def __init__(
        self,
        judge: Any,
        rewards: RewardConfig | None = None,
        num_generations: int | None = None,
        source_column: str = "article",
        anchor_column: str | None = None,
        reference_column: str | None = None,
        keep_history: int = 0,
        name: str = "judgeloop",
        empty: str = "lose",
        **deprecated: Any,
    ):
        rewards = checked_reward_config(rewards, deprecated, "JudgeReward(judge, ...)")
        if empty not in ("lose", "judge"):
            raise ValueError(
                f"JudgeReward: empty={empty!r}; use lose (an empty completion ranks last) or judge"
            )
        if rewards.scheme == "anchor" and not anchor_column:
            raise ValueError("scheme=anchor needs anchor_column: the dataset column with each row's anchor")
        if num_generations is not None and not (_is_int(num_generations) and num_generations >= 1):
            raise ValueError(
                f"JudgeReward: num_generations={num_generations!r}; use TRL's num_generations (an integer "
                ">= 1) or None"
            )
        if not (_is_int(keep_history) and keep_history >= 0):
            raise ValueError(
                f"JudgeReward: keep_history={keep_history!r}; use the number of calls to keep (an integer "
                ">= 0; 0: none)"
            )
        for key, column in [("source_column", source_column), ("name", name)]:
            if not isinstance(column, str) or not column:
                raise ValueError(f"JudgeReward: {key}={column!r}; give a non-empty string")
        for key, optional in [("anchor_column", anchor_column), ("reference_column", reference_column)]:
            if optional is not None and not isinstance(optional, str):
                raise ValueError(f"JudgeReward: {key}={optional!r}; give a dataset column's name or None")
        if isinstance(judge, str) or hasattr(judge, "__fspath__"):
            from judgeloop.judges.calibrated import CalibratedJudge

            judge = CalibratedJudge.from_pretrained(judge)
        needs = getattr(judge, "needs", None)
        if needs is not None and needs.reads_references and not reference_column:
            raise ValueError(
                f"JudgeReward: the judge reads references ({needs.setting}) and reference_column is not set; "
                "pass reference_column=COLUMN, the dataset column with each row's reference summaries, or "
                f"use a judge calibrated with {needs.alternative}"
            )
        self.judge = judge
        self.rewards = rewards
        self.num_generations = num_generations
        self.source_column = source_column
        self.anchor_column = anchor_column
        self.reference_column = reference_column
        self.keep_history = keep_history
        self.empty = empty
        self.history: list[dict[str, Any]] = []
        self.calls = 0
        self.judge_calls = 0
        self.seconds = 0.0  # spent in this reward function (the judge's share of a trainer's step)
        self.__name__ = name  # TRL names the reward's log columns after it

    def _column(self, kwargs: dict[str, Any], name: str, n: int) -> list[Any]:
        if name not in kwargs:
            cols = sorted(k for k in kwargs if k not in ("trainer_state", "log_extra", "log_metric"))
            raise ValueError(
                f"JudgeReward: the batch has no column {name!r} (TRL passes dataset columns by name; this "
                f"batch has {cols}); add it to the dataset or set the column argument"
            )
        values = list(kwargs[name])
        if len(values) != n:
            raise ValueError(f"JudgeReward: column {name!r} has {len(values)} values for {n} completions")
        return values

    def groups(self, prompts: Sequence[Any], n: int) -> list[tuple[int, int]]:
        """``(start, end)`` of each group in the batch, checked: every row of a group has one prompt."""
        if self.rewards.scheme == "anchor" and self.num_generations is None:
            return [(i, i + 1) for i in range(n)]
        if self.num_generations is not None:
            g = self.num_generations
            if n % g:
                raise ValueError(
                    f"JudgeReward: {n} completions do not split into groups of num_generations={g}; "
                    "set the per-device batch to a multiple of num_generations so each group is on one process"
                )
            spans = [(s, s + g) for s in range(0, n, g)]
        else:
            spans, start = [], 0
            for i in range(1, n + 1):
                if i == n or prompts[i] != prompts[start]:
                    spans.append((start, i))
                    start = i
        for s, e in spans:
            if any(prompts[i] != prompts[s] for i in range(s, e)):
                raise ValueError(
                    f"JudgeReward: completions {s}-{e - 1} do not share one prompt, so they are no group of "
                    "TRL's layout (each prompt's num_generations completions side by side); check "
                    "num_generations and that the per-device batch is a multiple of it"
                )
        return spans

    def _log(self, log: Any, scores: Any, texts: list[str]) -> None:
        valid = [[r for r in g if r is not None] for g in scores.rewards]
        spreads = [np.std(g) for g in valid if len(g) > 1]  # within each group: the signal GRPO uses
        values = {
            "judge/comparisons_per_group": float(np.mean(scores.comparisons)),
            "judge/failed": float(sum(scores.failed)),
            "judge/empty": float(sum(is_empty(t) for t in texts)),
            "judge/mean_p": scores.mean_p,
            "judge/reward_std": float(np.mean(spreads)) if spreads else float("nan"),
            "judge/mean_margin": scores.mean_margin,
            "judge/order_agreement": scores.order_agreement,
            "judge/position_bias": scores.position_bias,
        }
        for key, value in values.items():
            # NaN: nothing was judged for it (no comparison in both orders; with k = 2 and one completion
            # empty, no comparison at all): omitted, as TRL averages each metric over the values it got
            if np.isfinite(value):
                log(key, value)

    def __call__(
        self, prompts: Sequence[Any], completions: Sequence[Any], **kwargs: Any
    ) -> list[float | None]:
        t0 = time.perf_counter()
        try:
            return self._rewards(prompts, completions, kwargs)
        finally:
            self.seconds += time.perf_counter() - t0

    def _rewards(
        self, prompts: Sequence[Any], completions: Sequence[Any], kwargs: dict[str, Any]
    ) -> list[float | None]:
        n = len(completions)
        if len(prompts) != n:
            raise ValueError(f"JudgeReward: {len(prompts)} prompts for {n} completions")
        texts = [completion_text(c) for c in completions]
        sources = self._column(kwargs, self.source_column, n)
        anchors = self._column(kwargs, self.anchor_column, n) if self.anchor_column else [None] * n
        refs = self._column(kwargs, self.reference_column, n) if self.reference_column else [()] * n
        spans = self.groups(prompts, n)
        needs = getattr(self.judge, "needs", None)
        if needs is not None and self.reference_column:  # before the judge is asked anything
            from judgeloop.judges.calibrated import check_references

            as_lists = [(r,) if isinstance(r, str) else tuple(r or ()) for r in refs]
            check_references(
                needs,
                as_lists,
                n,
                f"give every row its reference summaries in the column reference_column={self.reference_column!r}",
                "row {i}",
            )
        groups = []
        for s, e in spans:
            if any(sources[i] != sources[s] for i in range(s, e)):
                raise ValueError(
                    f"JudgeReward: rows {s}-{e - 1} share a prompt but not the {self.source_column!r} column"
                )
            ref = refs[s]
            groups.append(
                Group(str(sources[s]), texts[s:e], anchors[s], (ref,) if isinstance(ref, str) else tuple(ref))
            )
        scores = score_groups(
            EmptyLoses(self.judge) if self.empty == "lose" else self.judge, groups, self.rewards
        )
        rewards = [r for group in scores.rewards for r in group]
        self.calls += 1
        self.judge_calls += scores.judge_calls
        log = kwargs.get("log_metric")
        if callable(log):
            self._log(log, scores, texts)
        if self.keep_history:
            self.history.append(
                {"sources": sources, "completions": texts, "spans": spans, "rewards": rewards}
            )
            del self.history[: -self.keep_history]
        return rewards


def soft_dpo_trainer(
    *args: Any, target_column: str = "p_chosen", weight_column: str | None = None, **kwargs: Any
) -> Any:
    """TRL's ``DPOTrainer`` whose loss reads a soft target per pair from ``target_column`` and, when
    ``weight_column`` is set, a weight per pair from it (see :class:`SoftDPOTrainer`); arguments as
    ``DPOTrainer``'s."""
    return make_soft_dpo_trainer_class()(
        *args, target_column=target_column, weight_column=weight_column, **kwargs
    )


def make_soft_dpo_trainer_class() -> type:
    """The ``SoftDPOTrainer`` class (built on first use, so importing this module needs no TRL)."""
    global _SOFT_DPO
    if _SOFT_DPO is None:
        _SOFT_DPO = _build_soft_dpo_class()
    return _SOFT_DPO


_SOFT_DPO: type | None = None


def sequence_logps(model: Any, inputs: dict[str, Any], fused: bool = False) -> Any:
    """Sum of log pi(token) over each row's completion tokens, for TRL's preference batch layout
    (``input_ids``, ``attention_mask``, ``completion_mask``: chosen rows, then rejected rows).

    ``fused``: through the fused LM head TRL's trainers install on their models
    (``model(..., labels=..., fused_lm_head=True).log_probs``, no full logits), as ``DPOTrainer`` itself
    reads them; else from the plain forward's logits."""
    import torch

    ids, mask = inputs["input_ids"], inputs["completion_mask"]
    if fused:
        labels = ids.masked_fill(mask == 0, -100)
        out = model(
            input_ids=ids,
            attention_mask=inputs["attention_mask"],
            labels=labels,
            use_cache=False,
            fused_lm_head=True,
        )
        return out.log_probs[:, -(ids.size(1) - 1) :].sum(dim=1)
    logits = model(input_ids=ids, attention_mask=inputs["attention_mask"], use_cache=False).logits
    token = torch.log_softmax(logits[:, :-1].float(), dim=-1).gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    return (token * mask[:, 1:].to(token.dtype)).sum(dim=1)


class _WithTarget:
    """TRL's preference collator, plus each pair's soft target (and weight) as tensors (TRL's drops extra
    columns)."""

    def __init__(self, inner: Any, column: str, weight_column: str | None = None):
        self.inner, self.column, self.weight_column = inner, column, weight_column

    def _values(self, examples: list[dict[str, Any]], column: str, what: str, setting: str) -> list[float]:
        if any(column not in ex for ex in examples):
            raise ValueError(
                f"SoftDPOTrainer: a pair has no {column!r}; label the pairs with judgeloop label-pairs "
                f"(or set {setting})"
            )
        values = [float(ex[column]) for ex in examples]
        bad = [v for v in values if not 0.0 <= v <= 1.0]
        if bad:
            raise ValueError(f"SoftDPOTrainer: {what} {column} must lie in [0, 1]; got {bad[0]}")
        return values

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        import torch

        targets = self._values(examples, self.column, "the target", "target_column")
        weights = (
            self._values(examples, self.weight_column, "the weight", "weight_column")
            if self.weight_column
            else None
        )
        out = self.inner(examples)
        out[self.column] = torch.tensor(targets, dtype=torch.float32)
        if weights is not None:
            out[self.weight_column] = torch.tensor(weights, dtype=torch.float32)
        return out


def _build_soft_dpo_class() -> type:
    import torch
    from trl import DPOTrainer

    from judgeloop.loop.losses import soft_dpo_loss

    class SoftDPOTrainer(DPOTrainer):  # type: ignore[misc, valid-type]
        """``DPOTrainer`` with judgeloop's soft-target DPO loss: each pair's target ``p`` (the calibrated
        P(chosen better), column ``target_column``) weighs both directions,
        ``-p log s(beta h) - (1 - p) log s(-beta h)``, ``h`` the policy-minus-reference log-ratio margin
        (:func:`judgeloop.loop.losses.soft_dpo_loss`). With ``p = 1`` everywhere it is TRL's sigmoid loss.
        The other loss options of ``DPOConfig`` (``loss_type``, f-divergences, ``ld_alpha``) do not apply."""

        def __init__(
            self,
            *args: Any,
            target_column: str = "p_chosen",
            weight_column: str | None = None,
            **kwargs: Any,
        ):
            if weight_column == target_column:
                raise ValueError(
                    f"SoftDPOTrainer: weight_column={weight_column!r} is the target column; label-pairs writes "
                    'the weight in "weight" (weight_column="weight")'
                )
            self.target_column, self.weight_column = target_column, weight_column
            super().__init__(*args, **kwargs)
            if self.loss_types != ["sigmoid"] or self.f_divergence_type != "reverse_kl" or self.ld_alpha:
                raise ValueError(
                    f"SoftDPOTrainer: loss_type={self.loss_types}, f_divergence_type={self.f_divergence_type}, "
                    f"ld_alpha={self.ld_alpha}; the soft-target loss is the sigmoid DPO loss: use the defaults"
                )
            self.data_collator = _WithTarget(self.data_collator, target_column, weight_column)

        def _set_signature_columns_if_needed(self) -> None:
            super()._set_signature_columns_if_needed()
            for column in (self.target_column, self.weight_column):
                if column and self._signature_columns is not None and column not in self._signature_columns:
                    self._signature_columns.append(column)

        def compute_loss(
            self,
            model: Any,
            inputs: dict[str, Any],
            return_outputs: bool = False,
            num_items_in_batch: Any = None,
        ) -> Any:
            target = inputs.pop(self.target_column)
            weight = inputs.pop(self.weight_column) if self.weight_column else None
            logps = sequence_logps(model, inputs, fused=True)  # TRL's own log-probs (its fused LM head)
            with torch.no_grad():
                if self.precompute_ref_logps:
                    ref = torch.cat([inputs["ref_chosen_logps"], inputs["ref_rejected_logps"]])
                elif self.ref_model is None:  # LoRA: the reference is the base with the adapters off
                    with self.accelerator.unwrap_model(model).disable_adapter():
                        ref = sequence_logps(model, inputs, fused=True)
                else:
                    ref = sequence_logps(self.ref_model, inputs, fused=True)
            chosen, rejected = (logps - ref.to(logps.dtype)).chunk(2)
            weights = None if weight is None else weight.to(logps)
            # weighted as the loop's DPO term: sum of w * loss over the batch's pairs, divided by their number
            per_pair = soft_dpo_loss(chosen - rejected, target.to(logps), self.beta, weights)
            mode = "train" if model.training else "eval"
            gather = self.accelerator.gather_for_metrics
            margins = (self.beta * (chosen - rejected)).detach()
            self._metrics[mode]["rewards/margins"].append(gather(margins).mean().item())
            self._metrics[mode]["rewards/accuracies"].append(gather((margins > 0).float()).mean().item())
            self._metrics[mode]["soft_target/mean"].append(gather(target.to(margins)).mean().item())
            loss = per_pair.mean()
            return (loss, {"per_pair_loss": per_pair.detach()}) if return_outputs else loss

    return SoftDPOTrainer


__all__ = [
    "JudgeReward",
    "completion_text",
    "make_soft_dpo_trainer_class",
    "sequence_logps",
    "soft_dpo_trainer",
]
