"""A robust straight line for the serving-path fits: ``y ~ a + b x`` with ``a, b >= 0``."""

from __future__ import annotations

import numpy as np


def fit_line(x: np.ndarray, y: np.ndarray, trim: bool = True) -> tuple[float, float]:
    """``y ~ a + b x`` by least squares without the worst 10% of residuals (``trim``), with a, b >= 0 (a
    negative slope or intercept is noise: fall back to the one-parameter fit — the median, or untrimmed
    the mean, so that the fitted line keeps the mean of ``y``)."""
    a, b = _lstsq(x, y)
    keep = np.abs(y - a - b * x) <= np.percentile(np.abs(y - a - b * x), 90)  # drop the scheduler hiccups
    if trim and keep.sum() >= 3:
        a, b = _lstsq(x[keep], y[keep])
    if b < 0 or np.ptp(x) == 0:
        return max(float(np.median(y) if trim else np.mean(y)), 0.0), 0.0
    if a < 0:
        return 0.0, max(float(np.dot(x, y) / np.dot(x, x)), 0.0)
    return a, b


def _lstsq(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    if np.ptp(x) == 0:
        return float(np.mean(y)), 0.0
    coef = np.linalg.lstsq(np.column_stack([np.ones_like(x), x]), y, rcond=None)[0]
    return float(coef[0]), float(coef[1])
