"""Judges: a batch of (article, summary_a, summary_b) -> raw preference logits with per-item status.

The package's face: the settings live in :mod:`judgeloop.judges.config`, the building in
:mod:`judgeloop.judges.build`. ``build_judge(JudgeConfig(...))`` makes one of four in-process extractors,
each reading model logits (no text is generated or parsed):

* ``choice``: log P(verdict A) - log P(verdict B) of a causal-LM judge prompt (both orders by default);
* ``likelihood``: difference of length-normalized log-likelihoods of the summaries;
* ``reward_model``: difference of a scalar sequence-classification head (Bradley-Terry);
* ``embedding``: difference of cosine similarities to the article or references, times ``scale``;

or ``served``: the ``choice`` judge's verdict logit (or, by ``judge.extractor``, a graded rubric or the
``likelihood`` judge's log-likelihoods) read from a vLLM / SGLang / OpenAI-compatible server
(:mod:`judgeloop.judges.served`, settings under ``judge.server``), or an objective signal (``objective``: ROUGE, a length or copy penalty, an NLI factual-consistency
score; :mod:`judgeloop.judges.objective`), or a ``panel`` of any of these, each member calibrated on
its own and combined (:mod:`judgeloop.judges.panel`).

Any of them takes a style bias of a chosen strength: ``style_weight * d(pair)`` added to its logit
(:class:`~judgeloop.judges.styled.StyledJudge`), the dial of the calibration experiments.
"""

from __future__ import annotations

from judgeloop.judges.base import (
    VALID_STATUSES,
    Judge,
    JudgeOutput,
    JudgeStats,
    Pair,
    PointwiseJudge,
    combine_orders,
)
from judgeloop.judges.build import build_judge, build_panel, references_for
from judgeloop.judges.config import (
    DTYPES,
    JUDGE_TYPES,
    JudgeConfig,
    JudgeNeeds,
    JudgeType,
    PanelConfig,
    judge_needs,
    member_names,
    members_models,
    models_of,
)
from judgeloop.judges.prompts import PROMPTS, JudgePrompt, get_prompt
from judgeloop.judges.served_client import ServerConfig
from judgeloop.judges.styled import STYLE_FEATURES, StyledJudge, style_feature

__all__ = [
    "DTYPES",
    "JUDGE_TYPES",
    "JudgeType",
    "PROMPTS",
    "VALID_STATUSES",
    "Judge",
    "JudgeConfig",
    "JudgeNeeds",
    "PanelConfig",
    "ServerConfig",
    "build_panel",
    "member_names",
    "members_models",
    "models_of",
    "JudgeOutput",
    "JudgePrompt",
    "JudgeStats",
    "Pair",
    "PointwiseJudge",
    "STYLE_FEATURES",
    "StyledJudge",
    "build_judge",
    "judge_needs",
    "references_for",
    "style_feature",
    "combine_orders",
    "get_prompt",
]
