"""Text and calibration metrics."""
