"""Calibration: labels for preference pairs, calibrators (Platt, isotonic, temperature, feature-aware
Platt) and the pair features they read, and calibration metrics (ECE, MCE, Brier, NLL, AUC, accuracy)."""

from judgeloop.calibration.calibrators import (
    CALIBRATORS,
    BiasCurveCalibrator,
    CalibrationError,
    Calibrator,
    FeaturePlattCalibrator,
    IdentityCalibrator,
    IsotonicCalibrator,
    PlattCalibrator,
    StyleResidualCalibrator,
    TemperatureCalibrator,
    calibrator_from_state,
    load_calibrator,
    make_calibrator,
)
from judgeloop.calibration.features import (
    FEATURE_NAMES,
    both_orientations,
    feature_matrix,
    features_for,
    pair_feature_matrix,
    pair_features,
)
from judgeloop.calibration.labels import LabelConfig, LabeledPair, build_labeled_pairs, rouge_label
from judgeloop.calibration.metrics import all_metrics, brier, ece, mce, nll, reliability_bins

__all__ = [
    "CALIBRATORS",
    "BiasCurveCalibrator",
    "FEATURE_NAMES",
    "CalibrationError",
    "Calibrator",
    "FeaturePlattCalibrator",
    "IdentityCalibrator",
    "IsotonicCalibrator",
    "LabelConfig",
    "LabeledPair",
    "PlattCalibrator",
    "StyleResidualCalibrator",
    "TemperatureCalibrator",
    "all_metrics",
    "both_orientations",
    "brier",
    "build_labeled_pairs",
    "calibrator_from_state",
    "ece",
    "feature_matrix",
    "features_for",
    "load_calibrator",
    "make_calibrator",
    "mce",
    "nll",
    "pair_feature_matrix",
    "pair_features",
    "reliability_bins",
    "rouge_label",
]
