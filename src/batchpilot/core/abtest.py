"""Is a candidate arm better or worse than the primary, and is the difference real at this sample size?

    compare_arms(ArmSample(...primary), ArmSample(...candidate)) -> ArmComparison

Latency: the ratio candidate / primary of the P50 and of the P99 of the ok answers, each with a
percentile-bootstrap confidence interval (both arms resampled with replacement, ``resamples`` times,
seeded). Errors and rejections: the difference of the rates, with Newcombe's hybrid Wilson score
interval. The verdict tests three things (P99 ratio, error rate, rejection rate), so each interval is
taken at ``1 - (1 - confidence) / 3`` (Bonferroni): an A/A comparison calls a difference in at most
about ``1 - confidence`` of runs.

    worse                        a tested interval lies wholly on the bad side (P99 ratio above 1,
                                 or a rate difference above 0)
    better                       the P99 ratio's interval lies below 1 and nothing tested is worse
    no significant difference    otherwise
    not enough samples           either arm has fewer than ``min_samples`` answers

Pure numpy; the same function reads a live server's windows (``/v1/arms``) and a load generator's
own records (``bench ab``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np


@dataclass(frozen=True)
class Interval:
    estimate: float
    low: float
    high: float

    def to_dict(self) -> dict[str, float | None]:
        return {k: (None if math.isnan(v) else v)
                for k, v in (("estimate", self.estimate), ("low", self.low), ("high", self.high))}


NAN_INTERVAL = Interval(math.nan, math.nan, math.nan)


@dataclass(frozen=True)
class ArmSample:
    """One arm's answers: ok latencies (seconds) and the counts of the other outcomes."""

    name: str
    latencies: np.ndarray
    errors: int = 0
    rejected: int = 0

    @property
    def total(self) -> int:
        return len(self.latencies) + self.errors + self.rejected


@dataclass(frozen=True)
class ArmComparison:
    primary: str
    candidate: str
    n_primary: int
    n_candidate: int
    confidence: float
    p50_ratio: Interval
    p99_ratio: Interval
    error_rate_diff: Interval
    rejection_rate_diff: Interval
    verdict: str
    reasons: tuple[str, ...]

    @property
    def significant(self) -> bool:
        return self.verdict in ("better", "worse")

    def to_dict(self) -> dict[str, object]:
        return {"primary": self.primary, "candidate": self.candidate, "n_primary": self.n_primary,
                "n_candidate": self.n_candidate, "confidence": self.confidence,
                "p50_ratio": self.p50_ratio.to_dict(), "p99_ratio": self.p99_ratio.to_dict(),
                "error_rate_diff": self.error_rate_diff.to_dict(),
                "rejection_rate_diff": self.rejection_rate_diff.to_dict(), "verdict": self.verdict,
                "significant": self.significant, "reasons": list(self.reasons)}


def _z(confidence: float) -> float:
    """The two-sided normal quantile for ``confidence``."""
    return NormalDist().inv_cdf(1.0 - (1.0 - confidence) / 2.0)


def wilson(k: int, n: int, confidence: float) -> tuple[float, float]:
    """Wilson score interval of a proportion ``k / n``."""
    if n == 0:
        return 0.0, 1.0
    z = _z(confidence)
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def rate_difference(k_a: int, n_a: int, k_b: int, n_b: int, confidence: float) -> Interval:
    """``k_b/n_b - k_a/n_a`` with Newcombe's hybrid score interval."""
    if n_a == 0 or n_b == 0:
        return NAN_INTERVAL
    pa, pb = k_a / n_a, k_b / n_b
    la, ua = wilson(k_a, n_a, confidence)
    lb, ub = wilson(k_b, n_b, confidence)
    diff = pb - pa
    return Interval(diff, diff - math.sqrt((pb - lb) ** 2 + (ua - pa) ** 2),
                    diff + math.sqrt((ub - pb) ** 2 + (pa - la) ** 2))


def quantile_ratio(a: np.ndarray, b: np.ndarray, q: float, confidence: float, resamples: int,
                   rng: np.random.Generator) -> Interval:
    """``quantile(b, q) / quantile(a, q)`` with a percentile-bootstrap interval."""
    if len(a) == 0 or len(b) == 0:
        return NAN_INTERVAL
    qa, qb = float(np.quantile(a, q)), float(np.quantile(b, q))
    est = qb / qa if qa > 0 else math.nan
    ra = np.quantile(a[rng.integers(0, len(a), (resamples, len(a)))], q, axis=1)
    rb = np.quantile(b[rng.integers(0, len(b), (resamples, len(b)))], q, axis=1)
    ratios = rb / np.maximum(ra, 1e-12)
    tail = (1.0 - confidence) / 2.0
    return Interval(est, float(np.quantile(ratios, tail)), float(np.quantile(ratios, 1.0 - tail)))


def _at_most(x: np.ndarray, n: int, rng: np.random.Generator) -> np.ndarray:
    return x if len(x) <= n else rng.choice(x, n, replace=False)


def compare_arms(primary: ArmSample, candidate: ArmSample, confidence: float = 0.95,
                 resamples: int = 1000, seed: int = 0, min_samples: int = 30,
                 max_sample: int = 5000) -> ArmComparison:
    """The candidate against the primary (module docstring for the verdict). Latency samples over
    ``max_sample`` are subsampled (seeded) to that size: the bootstrap's cost is resamples x sample."""
    if not 0.5 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0.5, 1), got {confidence}")
    rng = np.random.default_rng(seed)
    per_test = 1.0 - (1.0 - confidence) / 3.0
    a, b = (_at_most(np.asarray(s.latencies, float), max_sample, rng) for s in (primary, candidate))
    p50 = quantile_ratio(a, b, 0.50, per_test, resamples, rng)
    p99 = quantile_ratio(a, b, 0.99, per_test, resamples, rng)
    errs = rate_difference(primary.errors, primary.total, candidate.errors, candidate.total, per_test)
    rej = rate_difference(primary.rejected, primary.total, candidate.rejected, candidate.total, per_test)
    reasons: list[str] = []
    if min(len(a), len(b)) < min_samples:
        verdict = "not enough samples"
        reasons.append(f"{min(len(a), len(b))} ok answers on the smaller arm; at least {min_samples} needed")
    else:
        if p99.low > 1.0:
            reasons.append(f"P99 {p99.estimate:.2f}x the primary's (interval {p99.low:.2f}-{p99.high:.2f})")
        if errs.low > 0.0:
            reasons.append(f"error rate +{errs.estimate:.2%} (interval {errs.low:+.2%} to {errs.high:+.2%})")
        if rej.low > 0.0:
            reasons.append(f"rejection rate +{rej.estimate:.2%} (interval {rej.low:+.2%} to {rej.high:+.2%})")
        if reasons:
            verdict = "worse"
        elif p99.high < 1.0:
            verdict = "better"
            reasons.append(f"P99 {p99.estimate:.2f}x the primary's (interval {p99.low:.2f}-{p99.high:.2f})")
        else:
            verdict = "no significant difference"
    return ArmComparison(primary.name, candidate.name, primary.total, candidate.total, confidence, p50, p99,
                         errs, rej, verdict, tuple(reasons))
