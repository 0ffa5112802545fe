"""The loop's arms, one row each: what an arm (``calibration.method``) trains against and how it is fitted.

Every place the loop treats arms differently reads this table: which judge trains the policy
(:func:`judgeloop.loop.recalibration.build_training_judge`), which calibrator is fitted and whether at all
(``build_calibrator``, ``needs_fit``), which oracle labels its fits read (the calibration pairs, none, or
those and every training pair), whether a refit is kept only when it is better held out, the loss settings
it implies, and whether a calibrated judge is saved. Adding an arm is a row here and its tests.

The rows, by what they need from a user:

- no fit: ``raw`` (the judge's logit as it is) and ``oracle`` (the neutral ROUGE labeler in the judge's
  place: the upper bound of what any judge can teach);
- few labels (the calibration pairs, ``calibration.num_articles`` x ``pairs_per_article`` per refit):
  ``platt``, ``isotonic``, ``temperature`` (monotone maps: they change how sure the judge is, never which
  summary it prefers), ``feature_platt`` (reorders: discounts the style features it is shown),
  ``feature_platt_cw`` (``feature_platt``'s ordering as hard targets, each pair's DPO term weighted by its
  calibrated confidence ``|2p - 1|``: near a zero margin its gradient equals the soft target's, so it
  differs as the margins grow), ``feature_platt_sharp`` (``feature_platt``'s targets sharpened,
  ``loss.target_temperature`` 0.4: the same order at about the oracle's signal size), ``panel``;
- no labels: ``style_residual`` (the style term of the judge's logit, linear, subtracted) and
  ``bias_curve`` (the same with a monotone curve per feature);
- the ceiling of this judge: ``ceiling``, ``feature_platt`` fitted on oracle labels of the calibration
  pairs *and of every training pair of the run so far*: many more labels than a user would give, so its
  gain is what a perfect feature-aware calibration of this judge's logit can teach (the denominator of
  the "performance gap recovered" beside the oracle's).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from judgeloop.calibration import CALIBRATORS


@dataclass(frozen=True)
class ArmSpec:
    """One arm of the loop.

    Attributes:
        name: the ``calibration.method`` value.
        calibrator: the calibrator fitted at each (re)fit (:data:`judgeloop.calibration.CALIBRATORS`);
            ``raw`` is p = sigmoid(logit).
        judge: the training judge: the configured one, the ROUGE ``oracle``, or a ``panel`` of judges.
        labels: the oracle labels a fit reads: ``none`` (no fit, or a label-free one), ``calibration``
            (the calibration pairs), ``all`` (those and every training pair of the run so far).
        accept: ``config``: a refit is kept as ``calibration.refit_accept`` says; ``always``: every refit
            (a label-free arm: a guard that reads labels would make it a labeled method).
        loss: the loss settings the arm implies, ``(key, value)`` of ``loss.*`` (a config that sets one of
            them otherwise is refused).
    """

    name: str
    calibrator: str = "raw"
    judge: Literal["configured", "oracle", "panel"] = "configured"
    labels: Literal["none", "calibration", "all"] = "calibration"
    accept: Literal["config", "always"] = "config"
    loss: tuple[tuple[str, Any], ...] = ()

    @property
    def fits(self) -> bool:
        """Whether the arm fits anything (a calibrator, or a panel's members) on calibration pairs."""
        return self.name not in ("raw", "oracle")

    @property
    def saves_judge(self) -> bool:
        """The run saves ``calibrated_judge/``: the configured judge with the arm's calibrator (not the
        oracle, nor a panel, whose members' calibrators live in the report)."""
        return self.judge == "configured"

    @property
    def reorders(self) -> bool:
        """Whether the arm can prefer another summary than the configured judge does: a calibrator that
        reads the pair's features (``uses_features``), or another training judge. A monotone calibrator (platt, isotonic,
        temperature) only changes how sure the judge is, so with hard targets it trains raw's labels."""
        return CALIBRATORS[self.calibrator].uses_features or self.judge != "configured"


ARM_TABLE: tuple[ArmSpec, ...] = (
    ArmSpec("raw", labels="none"),
    ArmSpec("platt", "platt"),
    ArmSpec("isotonic", "isotonic"),
    ArmSpec("temperature", "temperature"),
    ArmSpec("feature_platt", "feature_platt"),
    ArmSpec("feature_platt_cw", "feature_platt", loss=(("target", "hard"), ("pair_weighting", "confidence"))),
    # T = 0.4: the temperature at which feature_platt's step-0 targets have the oracle arm's mean signal size
    # (|p - 0.5| = 0.29) on the 48-step study's calibration pairs (0.29-0.49 over its three seeds), fixed
    # before the arm ran; for another judge set loss.target_temperature on calibration.method=feature_platt
    ArmSpec("feature_platt_sharp", "feature_platt", loss=(("target_temperature", 0.4),)),
    ArmSpec("style_residual", "style_residual", labels="none", accept="always"),
    ArmSpec("bias_curve", "bias_curve", labels="none", accept="always"),
    ArmSpec("ceiling", "feature_platt", labels="all"),
    ArmSpec("panel", judge="panel"),
    ArmSpec("oracle", judge="oracle", labels="none"),
)
ARMS_BY_NAME: dict[str, ArmSpec] = {a.name: a for a in ARM_TABLE}
ARM_NAMES: tuple[str, ...] = tuple(ARMS_BY_NAME)


def arm(name: str) -> ArmSpec:
    """The row of arm ``name``."""
    try:
        return ARMS_BY_NAME[name]
    except KeyError:
        raise ValueError(f"unknown arm {name!r}; choose one of {list(ARM_NAMES)}") from None
