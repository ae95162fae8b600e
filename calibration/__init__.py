"""Calibration: dialogue data, K/V statistics, scales, KV equalization and accuracy evaluation of KV modes."""
