"""Building the judge a :class:`~judgeloop.judges.config.JudgeConfig` describes (:func:`build_judge`, a
panel's :func:`build_panel`), and the references a built judge compares to (:func:`references_for`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from judgeloop.judges.base import Judge
from judgeloop.judges.config import JudgeConfig, PanelConfig, member_names
from judgeloop.judges.styled import StyledJudge


def build_judge(cfg: JudgeConfig) -> Judge:
    """Load the model and build the judge ``cfg`` describes (styled when ``style_weight`` is not 0)."""
    if cfg.type == "panel":
        return build_panel(cfg.panel, device=cfg.device)
    judge = _build_base_judge(cfg)
    return StyledJudge(judge, cfg.style_weight, cfg.style_feature) if cfg.style_weight else judge


def references_for(judge: Judge, examples: Sequence[Any]) -> list[tuple[str, ...]]:
    """The references ``judge`` compares summaries to, per example: the extractive ones for a judge whose
    ``reference_style`` is ``extractive``, else the neutral ones (what every other judge and the ROUGE
    labels read)."""
    if getattr(judge, "reference_style", "neutral") == "extractive":
        return [tuple(e.extractive) for e in examples]
    return [tuple(e.neutral) for e in examples]


def build_panel(
    panel: PanelConfig, device: str | None = None, first: tuple[str, Judge] | None = None
) -> Judge:
    """The :class:`~judgeloop.judges.panel.PanelJudge` of ``panel``'s members (``device``: where members
    left at ``auto`` run); ``first``: an already built judge to lead the panel (the loop's own judge)."""
    import dataclasses

    from judgeloop.judges.panel import PanelJudge

    members = [first] if first is not None else []
    calibrate = [True] if first is not None else []
    for name, m in zip(member_names(panel), panel.members):
        if device is not None and m.device == "auto":
            m = dataclasses.replace(m, device=device)
        members.append((name, build_judge(m)))
        calibrate.append(m.type != "objective" if m.calibrate is None else m.calibrate)
    return PanelJudge(
        members, panel.combine, panel.weights, panel.member_calibration, panel.min_points, calibrate
    )


def _build_base_judge(cfg: JudgeConfig) -> Judge:
    common: dict[str, Any] = {
        "position_debias": cfg.debias,
        "batch_size": cfg.batch_size,
        "max_length": cfg.max_length,
        "device": cfg.device,
        "dtype": cfg.dtype,
        "cache_size": cfg.cache_size,
    }
    if cfg.type == "choice":
        from judgeloop.judges.choice import ChoiceJudge

        return ChoiceJudge(cfg.model, prompt=cfg.prompt, verdict_tokens=tuple(cfg.verdict_tokens), **common)
    if cfg.type == "served" and cfg.extractor == "graded":
        from judgeloop.judges.served import GradedJudge

        return GradedJudge(
            cfg.server,
            cfg.model,
            prompt=cfg.prompt,
            grades=cfg.grades,
            batch_size=cfg.batch_size,
            max_length=cfg.max_length,
            cache_size=cfg.cache_size,
        )
    if cfg.type == "served" and cfg.extractor == "likelihood":
        from judgeloop.judges.served import ServedLikelihoodJudge

        return ServedLikelihoodJudge(
            cfg.server,
            cfg.model,
            prompt=cfg.prompt,
            batch_size=cfg.batch_size,
            max_length=cfg.max_length,
            cache_size=cfg.cache_size,
        )
    if cfg.type == "served":
        from judgeloop.judges.served import ServedJudge

        return ServedJudge(
            cfg.server,
            cfg.model,
            prompt=cfg.prompt,
            verdict_tokens=tuple(cfg.verdict_tokens),
            position_debias=cfg.debias,
            batch_size=cfg.batch_size,
            max_length=cfg.max_length,
            cache_size=cfg.cache_size,
        )
    if cfg.type == "likelihood":
        from judgeloop.judges.likelihood import LikelihoodJudge

        return LikelihoodJudge(cfg.model, prompt=cfg.prompt, **common)
    if cfg.type == "reward_model":
        from judgeloop.judges.reward_model import RewardModelJudge

        return RewardModelJudge(cfg.model, prompt=cfg.prompt, **common)
    if cfg.type == "objective":
        from judgeloop.judges.objective import ObjectiveJudge

        return ObjectiveJudge(cfg.signal, cfg.scale, cfg.model, cfg.entailment_label, **common)
    from judgeloop.judges.embedding import EmbeddingJudge

    return EmbeddingJudge(cfg.model, target=cfg.embedding_target, scale=cfg.scale, **common)
