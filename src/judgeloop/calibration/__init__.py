"""Calibration: labels for preference pairs, calibrators (Platt, isotonic, temperature, feature-aware
Platt), and calibration metrics (ECE, MCE, Brier, NLL, AUC, accuracy)."""

from judgeloop.calibration.calibrators import (
    CALIBRATORS,
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
from judgeloop.calibration.labels import (
    FEATURE_NAMES,
    LabelConfig,
    LabeledPair,
    build_labeled_pairs,
    pair_feature_matrix,
    pair_features,
    rouge_label,
)
from judgeloop.calibration.metrics import all_metrics, brier, ece, mce, nll, reliability_bins

__all__ = [
    "CALIBRATORS",
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
    "brier",
    "build_labeled_pairs",
    "calibrator_from_state",
    "ece",
    "load_calibrator",
    "make_calibrator",
    "mce",
    "nll",
    "pair_feature_matrix",
    "pair_features",
    "reliability_bins",
    "rouge_label",
]
