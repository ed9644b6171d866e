"""The serving-path fits' shapes: a robust straight line (``y ~ a + b x`` with ``a, b >= 0``), factors
per bin of a step function (``binned_factors``, read back with ``step_factor``), a rate slope of either
sign (``rate_line``), and the loaded line they make (``served_seconds``)."""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import numpy as np

# upper edges of the bins of the idle time before a batch (no batch running); the last bin is >= 0.3 s
IDLE_EDGES_S = (0.002, 0.01, 0.03, 0.1, 0.3)


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


def binned_factors(index: np.ndarray, bins: int, took: np.ndarray, line: np.ndarray,
                   prior: float) -> tuple[tuple[float, ...], list[int]]:
    """Per bin ``k`` (the rows with ``index == k``): ``(sum took + prior * m) / (sum line + prior * m)``,
    ``m`` the bin's mean line, so a bin of few rows stays near 1 (none: exactly 1). Normalised so that
    the line times the factors keeps the totals (``sum took``). Returns the factors and the rows per
    bin."""
    factors, counts = [], []
    for k in range(bins):
        cell = index == k
        n = int(cell.sum())
        counts.append(n)
        m = float(line[cell].mean()) if n else 1.0
        factors.append((float(took[cell].sum()) + prior * m) / (float(line[cell].sum()) + prior * m))
    scale = float(line.sum()) / float(sum(line[index == k].sum() * f for k, f in enumerate(factors)))
    return tuple(f * scale for f in factors), counts


def step_factor(steps: Sequence[tuple[int, float]], x: float) -> float:
    """The factor of the last ``(lower_bound, factor)`` of ``steps`` (ascending bounds) not above ``x``;
    1 without steps."""
    return steps[max(bisect.bisect_right([lo for lo, _ in steps], x) - 1, 0)][1] if steps else 1.0


def rate_line(shaped: np.ndarray, took: np.ndarray, weight_by: np.ndarray,
              rate: np.ndarray) -> tuple[float, float]:
    """``(alpha, rate_coef)`` of ``took ~ shaped * (alpha + rate_coef * rate)``: least squares on errors
    relative to ``weight_by``, the slope of either sign, scaled so that the totals agree. No slope (the
    ratio of the totals) when the rates' 10th and 90th percentiles do not span a factor of 2 (a few
    batches at the edges do not make a span), or when the line would not stay above a fifth of its
    level at the lowest or highest rate (a slope that steep is noise, not a speed)."""
    total = float(took.sum() / shaped.sum()) if shaped.sum() > 0 else 1.0
    lo, hi = float(rate.min()), float(rate.max())
    p10, p90 = (float(np.percentile(rate, q)) for q in (10, 90)) if len(rate) else (0.0, 0.0)
    if len(took) < 10 or p90 < 2.0 * max(p10, 0.5):
        return total, 0.0
    w = 1.0 / np.maximum(weight_by, 1e-6)
    (a, b), *_ = np.linalg.lstsq(np.column_stack([shaped, shaped * rate]) * w[:, None], took * w, rcond=None)
    if not (a > 0 and a + b * hi > 0.2 * a and a + b * lo > 0.2 * a):
        return total, 0.0
    scale = float(took.sum() / (shaped * (a + b * rate)).sum())
    return float(a * scale), float(b * scale)


def served_seconds(predicted_s: float, loaded: tuple[float, float, float, float], rate: float,
                   idle_s: float = 0.0, tokens: float = 0.0, idle_factors: Sequence[float] = (),
                   token_factors: Sequence[tuple[int, float]] = ()) -> float:
    """A batch's line under serving load: ``predicted * (alpha + rate_coef * min(rate, rate_max)) *
    idle_factor * token_factor + const`` for ``loaded = (alpha, rate_coef, const, rate_max)`` (``rate_max``
    0: no bound), the factors looked up for its idle time and tokens (``FrontEnd.batch_seconds``, the
    simulator's target: the one formula)."""
    alpha, rate_coef, const, rate_max = loaded
    if rate_max > 0 and rate > rate_max:
        rate = rate_max
    factor = idle_factor(idle_factors, idle_s) * step_factor(token_factors, tokens)
    return predicted_s * (alpha + rate_coef * rate) * factor + const


def idle_factor(factors: Sequence[float], idle_s: float) -> float:
    """The factor of ``factors`` (one per ``IDLE_EDGES_S`` bin) for a batch after ``idle_s`` seconds
    with no batch running (``inf``: the first); 1 without factors."""
    return factors[bisect.bisect_right(IDLE_EDGES_S, idle_s)] if factors else 1.0
