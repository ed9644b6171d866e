"""core.abtest: the A/B verdict finds a real difference and its direction, and an A/A one rarely."""

from __future__ import annotations

import math

import numpy as np
import pytest

from batchpilot.core.abtest import ArmSample, compare_arms, rate_difference, wilson


def lognormal(rng: np.random.Generator, n: int, median_s: float) -> np.ndarray:
    return median_s * rng.lognormal(0.0, 0.5, n)


def test_wilson_matches_the_textbook_interval() -> None:
    low, high = wilson(10, 100, 0.95)  # Wilson 95% for 10/100: 0.0552 - 0.1744
    assert low == pytest.approx(0.0552, abs=5e-4) and high == pytest.approx(0.1744, abs=5e-4)


def test_rate_difference_covers_zero_for_equal_rates_and_not_for_distant_ones() -> None:
    same = rate_difference(10, 1000, 11, 1000, 0.95)
    assert same.low < 0 < same.high
    far = rate_difference(10, 1000, 80, 1000, 0.95)
    assert far.low > 0 and far.estimate == pytest.approx(0.07)


def test_a_slower_candidate_is_worse_and_a_faster_one_better() -> None:
    rng = np.random.default_rng(1)
    base = ArmSample("primary", lognormal(rng, 2000, 0.050))
    slow = compare_arms(base, ArmSample("canary", lognormal(rng, 2000, 0.080)))
    assert slow.verdict == "worse" and slow.significant and slow.p99_ratio.low > 1.0
    fast = compare_arms(base, ArmSample("canary", lognormal(rng, 2000, 0.030)))
    assert fast.verdict == "better" and fast.p99_ratio.high < 1.0
    assert fast.p99_ratio.low <= fast.p99_ratio.estimate <= fast.p99_ratio.high


def test_an_aa_comparison_rarely_calls_a_difference() -> None:
    calls = 0
    for seed in range(40):
        rng = np.random.default_rng(100 + seed)
        a = ArmSample("primary", lognormal(rng, 600, 0.05), errors=int(rng.binomial(600, 0.01)))
        b = ArmSample("canary", lognormal(rng, 600, 0.05), errors=int(rng.binomial(600, 0.01)))
        calls += compare_arms(a, b, resamples=300, seed=seed).significant
    assert calls <= 6  # ~5% expected at 95% confidence; 6 of 40 is far in the binomial tail


def test_more_errors_make_a_candidate_worse_even_when_it_is_as_fast() -> None:
    rng = np.random.default_rng(3)
    a = ArmSample("primary", lognormal(rng, 1000, 0.05), errors=2)
    b = ArmSample("canary", lognormal(rng, 1000, 0.05), errors=60)
    out = compare_arms(a, b)
    assert out.verdict == "worse" and any("error rate" in r for r in out.reasons)


def test_a_small_sample_has_no_verdict() -> None:
    rng = np.random.default_rng(4)
    out = compare_arms(ArmSample("primary", lognormal(rng, 10, 0.05)),
                       ArmSample("canary", lognormal(rng, 10, 0.5)))
    assert out.verdict == "not enough samples" and not out.significant


def test_the_comparison_is_deterministic_and_serialisable() -> None:
    rng = np.random.default_rng(5)
    a, b = ArmSample("primary", lognormal(rng, 300, 0.05)), ArmSample("canary", lognormal(rng, 300, 0.06))
    one, two = compare_arms(a, b, seed=7).to_dict(), compare_arms(a, b, seed=7).to_dict()
    assert one == two
    empty = compare_arms(a, ArmSample("canary", np.array([])), min_samples=1).to_dict()
    assert empty["verdict"] == "not enough samples"
    assert all(v is None or not math.isnan(v) for v in empty["p99_ratio"].values())  # type: ignore[union-attr]
