"""The judge's settings (``judge:`` of every command): :class:`JudgeConfig`, a panel's :class:`PanelConfig`, and
what a config alone says about its judge (the models it loads, :func:`models_of`; the references it reads,
:func:`judge_needs`). Nothing here loads a model; :mod:`judgeloop.judges.build` builds the judge.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from judgeloop.config import ANY_FINITE, bounded, check_fields
from judgeloop.judges.prompts import get_prompt
from judgeloop.judges.served_client import ServerConfig, check_served
from judgeloop.judges.styled import STYLE_FEATURES

JudgeType = Literal["choice", "likelihood", "reward_model", "embedding", "objective", "panel", "served"]
JUDGE_TYPES: tuple[str, ...] = get_args(JudgeType)
DTYPES = ("float32", "fp32", "bfloat16", "bf16", "float16", "fp16", "auto")


@dataclass
class PanelConfig:
    """A judge panel (``judge.type: panel``; in the loop also ``calibration.panel``).

    Attributes:
        members: the member judges, each a full judge config (any type but ``panel``); give two members
            of one type distinct ``name``s.
        combine: ``mean_prob``, ``mean_logit`` (default) or ``stacked`` (see :mod:`judgeloop.judges.panel`).
        weights: per-member weights of ``mean_prob`` / ``mean_logit`` (default equal): with objective
            signals as members, the mixing weights.
        member_calibration: each member's calibrator: ``platt`` (default), ``isotonic``, ``temperature``
            or ``feature_platt``.
        min_points: the fewest labeled pairs a member's calibrator is fitted on.
    """

    members: list[JudgeConfig] = field(default_factory=list)
    combine: Literal["mean_prob", "mean_logit", "stacked"] = "mean_logit"
    weights: list[float] = field(default_factory=list)
    member_calibration: Literal["platt", "isotonic", "temperature", "feature_platt"] = "platt"
    min_points: int = bounded(10, ge=2, message="{key}={value}; it must be at least 2")

    def __post_init__(self) -> None:
        check_fields("judge.panel", self)
        if self.weights and (len(self.weights) != len(self.members) or any(w < 0 for w in self.weights)):
            raise ValueError(
                f"judge.panel.weights={self.weights}: give {len(self.members)} non-negative weights (one per "
                "member), or none for equal weights"
            )
        if self.weights and not sum(self.weights) > 0:
            raise ValueError(
                f"judge.panel.weights={self.weights} are all zero; give at least one positive weight"
            )
        names = member_names(self)
        if len(set(names)) != len(names):
            raise ValueError(
                f"judge.panel.members are named {names}: give repeated ones a distinct judge name"
            )
        if any(m.type == "panel" for m in self.members):
            raise ValueError(
                "judge.panel.members: a member cannot be a panel itself; list its judges instead"
            )


def member_names(panel: PanelConfig) -> list[str]:
    """Each member's name: its ``name``, else its type (``objective:SIGNAL`` for an objective signal)."""
    return [m.name or (f"objective:{m.signal}" if m.type == "objective" else m.type) for m in panel.members]


@dataclass
class JudgeConfig:
    """Which judge to build and how (embedded as ``judge:`` in command configs).

    Attributes:
        type: extractor, one of ``choice``, ``likelihood``, ``reward_model``, ``embedding``.
        model: hub id or local path (packaged offline sources resolve without network).
        prompt: template name in ``judgeloop.judges.prompts.PROMPTS`` (``neutral``, ``extractive_bias``,
            ``length_bias``); used by choice, likelihood and reward_model.
        position_debias: score both orders and average ``(s(a,b) - s(b,a)) / 2``; ``None`` means on
            for ``choice`` (the only judge that sees an order) and off otherwise.
        batch_size: items per forward pass.
        max_length: token budget of one model input. Only the article (or a reference, for the
            embedding judge) is cut to fit, counted as status ``truncated``; if the summaries and
            prompt alone exceed it, the item is ``too_long`` and not scored.
        embedding_target: ``article``, ``references`` (the neutral references) or ``extractive`` (the
            extractive references: a judge that prefers the extractive style), embedding judge.
        scale: embedding judge: cosine difference times ``scale``. 20 is the scale
            sentence-transformers' MultipleNegativesRankingLoss applies to cosines.
        dtype: model weights dtype (``float32``, ``bfloat16``, ``float16``, ``auto``).
        verdict_tokens: choice judge: the two answer labels, each a single token.
        device: ``auto`` (default: a GPU when torch sees one; inside a run, the process's own), ``cpu``,
            ``cuda``, ``cuda:N`` or ``mps``.
        cache_size: judged pairs kept in the in-memory cache (0 disables it).
        style_weight: adds ``style_weight * d(pair)`` to the judge's logit, ``d`` the antisymmetric
            pair feature ``style_feature`` (``copy_rate``, ``log_length_ratio``, ``novel_bigram``);
            0 (default) leaves the judge as it is.
        name: what reports and panels call the judge (default: its type).
        signal: ``objective`` judge: ``rouge``, ``length``, ``copy_rate`` or ``factual`` (``model`` is then
            the NLI model); the value difference is multiplied by ``scale``.
        entailment_label: ``objective`` judge, ``factual`` signal: the NLI model's entailment class.
        panel: ``panel`` judge: its members and combination rule (:class:`PanelConfig`).
        server: ``served`` judge: the server, its model and how to call it (:class:`ServerConfig`);
            ``model`` then names the served model's tokenizer, which renders the prompts here.
        extractor: ``served`` judge: ``verdict`` (default: the pairwise verdict logit
            ``log P(A) - log P(B)``), ``graded`` (a pointwise rubric prompt per summary, grades 1 to
            ``grades``, each a single token; the logit is the difference of the two expected grades) or
            ``likelihood`` (the ``likelihood`` judge's length-normalized log-likelihood difference, from the
            server's prompt log-probabilities: ``server.route`` ``auto``, ``vllm`` or ``sglang``).
        grades: ``graded`` extractor: the top grade K (2 to 9).
        calibrate: as a panel member, whether its calibrator is fitted on the labeled pairs; ``None``
            (default) means yes for a judge and no for an objective signal, whose logit then enters as it
            is (``p = sigmoid(s)``): a penalty keeps the direction and the ``scale`` it was given, where a
            calibrator fitted on ROUGE labels would turn a length penalty into a length reward.
    """

    type: JudgeType = "choice"
    model: str = "HuggingFaceTB/SmolLM2-135M-Instruct"
    prompt: str = "neutral"
    position_debias: bool | None = None
    batch_size: int = bounded(8, ge=1, message="{key}={value}; it must be at least 1")
    max_length: int = bounded(
        2048, ge=16, message="{key}={value}; it must be at least 16 tokens (typical: 2048)"
    )
    embedding_target: Literal["article", "references", "extractive"] = "article"
    scale: float = bounded(
        20.0, gt=0, message="{key}={value}; it must be a positive finite number (default 20)"
    )
    dtype: str = "float32"
    verdict_tokens: list[str] = field(default_factory=lambda: ["A", "B"])
    device: str = "auto"
    cache_size: int = bounded(
        100_000, ge=0, message="{key}={value}; use 0 to disable the cache or a positive size"
    )
    # a style bias either way is an experiment (negative: the judge leans against the style)
    style_weight: float = bounded(0.0, ANY_FINITE)
    style_feature: str = "copy_rate"
    name: str = ""
    signal: Literal["rouge", "length", "copy_rate", "factual"] = "rouge"
    entailment_label: str = "entailment"
    panel: PanelConfig = field(default_factory=lambda: PanelConfig())
    server: ServerConfig = field(default_factory=lambda: ServerConfig())
    extractor: Literal["verdict", "graded", "likelihood"] = "verdict"
    grades: int = bounded(5, ge=2, le=9, hint=" (grades 1..K, one digit token each)", shape="section")
    calibrate: bool | None = None

    def __post_init__(self) -> None:
        if self.type not in JUDGE_TYPES:
            raise ValueError(f"judge.type={self.type!r} is not a judge; use one of {list(JUDGE_TYPES)}")
        if self.type == "panel" and len(self.panel.members) < 2:
            raise ValueError(
                f"judge.type=panel has {len(self.panel.members)} member(s) in judge.panel.members; list at least two"
            )
        if self.type == "panel" and self.style_weight:
            raise ValueError(
                f"judge.style_weight={self.style_weight} on a panel; set style_weight on a member instead"
            )
        if self.type != "panel" and self.panel.members:
            raise ValueError(f"judge.panel.members is set but judge.type={self.type!r}; set judge.type=panel")
        if self.type == "served":
            check_served(self.server)
        if self.type != "served" and self.server.base_url:
            raise ValueError(
                f"judge.server.base_url is set but judge.type={self.type!r}; set judge.type=served"
            )
        if self.extractor != "verdict" and self.type != "served":
            raise ValueError(
                f"judge.extractor={self.extractor!r} is read by the served judge only (judge.type={self.type!r}); "
                "set judge.type=served or drop judge.extractor"
            )
        if self.extractor in ("graded", "likelihood") and self.position_debias:
            raise ValueError(
                f"judge.position_debias=true with judge.extractor={self.extractor}: each summary is scored alone, "
                "there is no order to debias; drop judge.position_debias"
            )
        if self.extractor == "likelihood" and self.server.route not in ("auto", "vllm", "sglang"):
            raise ValueError(
                f"judge.server.route={self.server.route!r} with judge.extractor=likelihood: only the vllm and sglang "
                "routes return prompt log-probabilities; set judge.server.route to auto, vllm or sglang"
            )
        if self.extractor == "graded" and self.server.route in ("decisions", "systemone"):
            raise ValueError(
                f"judge.server.route={self.server.route!r} with judge.extractor=graded: the decision routes ask the "
                "pairwise verdict only; set judge.server.route to auto, vllm, sglang, generative_scoring, "
                "top_logprobs or text"
            )
        if not self.model:
            raise ValueError("judge.model is empty; set a hub id or a local model directory")
        get_prompt(self.prompt)  # raises naming the closest template
        if self.embedding_target not in ("article", "references", "extractive"):
            raise ValueError(
                f"judge.embedding_target={self.embedding_target!r}; use 'article', 'references' or 'extractive'"
            )
        if self.style_feature not in STYLE_FEATURES:
            raise ValueError(f"judge.style_feature={self.style_feature!r}; use one of {list(STYLE_FEATURES)}")
        if not math.isfinite(self.scale):  # before check_fields: its message names the setting's meaning
            raise ValueError(f"judge.scale={self.scale}; it must be a positive finite number (default 20)")
        if self.dtype not in DTYPES:
            raise ValueError(f"judge.dtype={self.dtype!r} is not supported; use one of {list(DTYPES)}")
        if len(self.verdict_tokens) != 2:
            raise ValueError(
                f"judge.verdict_tokens={self.verdict_tokens!r}; give exactly two labels, e.g. ['A', 'B']"
            )
        if any(not v.strip() for v in self.verdict_tokens):
            raise ValueError(
                f"judge.verdict_tokens={self.verdict_tokens!r}; a label cannot be empty or only spaces"
            )
        if self.verdict_tokens[0].strip() == self.verdict_tokens[1].strip():
            raise ValueError(f"judge.verdict_tokens={self.verdict_tokens!r}; the two labels must differ")
        dev = self.device.split(":")
        bad = dev[0] not in ("auto", "cpu", "cuda", "mps") or len(dev) > 2
        if bad or (len(dev) == 2 and (dev[0] != "cuda" or not dev[1].isdigit())):
            raise ValueError(f"judge.device={self.device!r}; use auto, cpu, cuda, cuda:N or mps")
        check_fields("judge", self)  # last: the choices above say more than a Literal's list

    @property
    def debias(self) -> bool:
        """Resolved position debiasing: the explicit setting, else on for ``choice`` and ``served`` only."""
        if self.type == "served" and self.extractor in ("graded", "likelihood"):
            return False  # each summary is scored alone: no order to debias
        return self.type in ("choice", "served") if self.position_debias is None else self.position_debias


def models_of(cfg: JudgeConfig, key: str = "judge") -> list[tuple[str, str, str]]:
    """``(config key, model, device)`` of every model ``cfg`` loads: none for a text signal, each member's
    for a panel; for checking them before any weights load."""
    if cfg.type == "panel":
        return members_models(cfg.panel, f"{key}.panel")
    if cfg.type == "objective" and cfg.signal != "factual":
        return []
    return [(f"{key}.model", cfg.model, cfg.device)]


def members_models(panel: PanelConfig, key: str) -> list[tuple[str, str, str]]:
    """:func:`models_of` over a panel's members (``KEY.members[i]``)."""
    return [m for i, member in enumerate(panel.members) for m in models_of(member, f"{key}.members[{i}]")]


@dataclass(frozen=True)
class JudgeNeeds:
    """What a judge reads per call besides the source text (the article) and the two summaries.

    Attributes:
        references: which reference summaries it compares to: ``neutral`` (the human / neutral ones),
            ``extractive``, or ``""`` when it reads none.
        setting: the config setting that makes it read them (``judge.embedding_target=references``,
            ``judge.signal=rouge``, ``judge.panel.members[1].embedding_target=extractive``); ``""`` if none.
    """

    references: str = ""
    setting: str = ""

    @property
    def reads_references(self) -> bool:
        return bool(self.references)

    def describe(self) -> str:
        """One phrase for a card or an error: what each call must carry."""
        if not self.references:
            return "the source text (the article) and the two summaries; no references"
        return (
            f"the source text, the two summaries and each item's {self.references} reference summaries "
            f"(it reads them: {self.setting})"
        )

    @property
    def alternative(self) -> str:
        """The change, at calibration, that gives a judge reading no references."""
        if self.setting.endswith("signal=rouge"):
            return self.setting.replace("signal=rouge", "signal=length")
        return self.setting.rsplit("=", 1)[0] + "=article"

    def as_dict(self) -> dict[str, Any]:
        return {"references": self.references or None, "setting": self.setting or None}


def judge_needs(cfg: JudgeConfig, key: str = "judge") -> JudgeNeeds:
    """What the judge ``cfg`` describes reads per call (:class:`JudgeNeeds`), from its config alone (no
    model loads): an embedding judge whose target is ``references`` / ``extractive``, the ``rouge``
    objective signal, or a panel with such a member reads references; every other judge reads none."""
    if cfg.type == "panel":
        for i, member in enumerate(cfg.panel.members):
            needs = judge_needs(member, f"{key}.panel.members[{i}]")
            if needs.reads_references:
                return needs
        return JudgeNeeds()
    if cfg.type == "embedding" and cfg.embedding_target != "article":
        style = "extractive" if cfg.embedding_target == "extractive" else "neutral"
        return JudgeNeeds(style, f"{key}.embedding_target={cfg.embedding_target}")
    if cfg.type == "objective" and cfg.signal == "rouge":
        return JudgeNeeds("neutral", f"{key}.signal=rouge")
    return JudgeNeeds()
