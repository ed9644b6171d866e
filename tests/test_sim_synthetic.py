"""Synthetic arrival processes and length distributions have the moments they promise."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchpilot.sim.synthetic import (
    bimodal_lengths,
    diurnal_arrivals,
    mmpp_arrivals,
    parse_spec,
    poisson_arrivals,
    priority_mix,
    renewal_arrivals,
    synthetic_workload,
)


def cv(times: np.ndarray) -> float:
    g = np.diff(times)
    return float(g.std() / g.mean())


def test_poisson_rate_and_cv() -> None:
    t = poisson_arrivals(50.0, 50_000, np.random.default_rng(0))
    assert t[0] == 0.0
    assert (len(t) - 1) / t[-1] == pytest.approx(50.0, rel=0.02)
    assert cv(t) == pytest.approx(1.0, abs=0.03)


@settings(max_examples=15, deadline=None)
@given(target=st.floats(0.3, 4.0), rate=st.floats(1.0, 500.0))
def test_renewal_has_the_chosen_cv_and_rate(target: float, rate: float) -> None:
    t = renewal_arrivals(rate, target, 40_000, np.random.default_rng(1))
    assert cv(t) == pytest.approx(target, rel=0.12)
    assert (len(t) - 1) / t[-1] == pytest.approx(rate, rel=0.08)


def test_mmpp_is_bursty_and_diurnal_follows_the_sine() -> None:
    rng = np.random.default_rng(2)
    t = mmpp_arrivals(100.0, 2.0, 5.0, 20.0, 30_000, rng)
    assert cv(t) > 2.0
    d = diurnal_arrivals(20.0, 0.8, 100.0, 40_000, rng)
    phase = (d % 100.0) / 100.0
    high = ((phase > 0.15) & (phase < 0.35)).sum()  # around the sine's peak
    low = ((phase > 0.65) & (phase < 0.85)).sum()  # around its trough
    assert high > 4 * low


def test_lengths_and_priorities() -> None:
    rng = np.random.default_rng(3)
    b = bimodal_lengths(32, 400, 0.25, 20_000, rng)
    assert 0.2 < (b > 200).mean() < 0.3 and b.min() >= 1 and b.max() <= 512
    p = priority_mix({0: 0.9, -1: 0.1}, 20_000, rng)
    assert (p == -1).mean() == pytest.approx(0.1, abs=0.01)
    with pytest.raises(ValueError, match="priority weights"):
        priority_mix({0: -1.0}, 10, rng)


def test_specs_build_seeded_workloads() -> None:
    assert parse_spec("renewal:rate=20,cv=3") == ("renewal", {"rate": 20.0, "cv": 3.0})
    a = synthetic_workload("mmpp:rate_on=40,rate_off=4", 2000, "bimodal:short=32,long=400", seed=5)
    b = synthetic_workload("mmpp:rate_on=40,rate_off=4", 2000, "bimodal:short=32,long=400", seed=5)
    assert len(a) == 2000 and a.arrival_s.tolist() == b.arrival_s.tolist()
    e = synthetic_workload("poisson:rate=5", 1000, "empirical", empirical_pool=[7, 9], seed=1)
    assert set(e.input_tokens.tolist()) == {7, 9}
    with pytest.raises(ValueError, match="choose one of"):
        synthetic_workload("weibull:rate=3", 10)
    with pytest.raises(ValueError, match="key=value"):
        parse_spec("poisson:rate")
