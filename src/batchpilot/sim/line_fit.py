"""The serving-path fits' shapes: a robust straight line (``y ~ a + b x`` with ``a, b >= 0``), and factors
per bin of a step function (``binned_factors``, read back with ``step_factor``)."""

from __future__ import annotations

import bisect
from collections.abc import Sequence

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


def backfit_factors(bins: Sequence[tuple[np.ndarray, int]], took: np.ndarray, base: np.ndarray,
                    prior: float, rounds: int = 8) -> list[tuple[tuple[float, ...], list[int]]]:
    """Several sets of ``binned_factors`` at once: per set ``(index, bins)``, the factors of
    ``took ~ base * (product of every set's factor for the row)``, each set refitted in turn against
    ``base`` times the others' factors (backfitting, ``rounds`` times), so that a cause that two sets
    both see (a batch after an idle server is also one after a sparse second) lands on the set that
    explains it rather than on the one fitted first. Returns per set its factors and rows per bin."""
    out: list[tuple[tuple[float, ...], list[int]]] = [((1.0,) * n, []) for _, n in bins]
    for _ in range(rounds if len(bins) > 1 else 1):
        for k, (index, n) in enumerate(bins):
            line = base.copy()
            for j, (other, _) in enumerate(bins):
                if j != k:
                    line *= np.asarray(out[j][0])[other]
            out[k] = binned_factors(index, n, took, line * (took.sum() / line.sum()), prior)
    return out
