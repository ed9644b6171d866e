"""What ran before a batch (``sim.service``): the busy share, its factors, and that the simulator
and the batch-log pricing compute it alike."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchpilot.core.config import PolicyConfig, SchedulerConfig
from batchpilot.core.costmodel import CostModel
from batchpilot.sim.service import (
    BUSY_EDGES,
    BUSY_WINDOW_S,
    BusyWindow,
    FrontEnd,
    busy_factor,
    busy_shares,
    served_seconds,
)
from batchpilot.sim.target import simulate_encoder
from batchpilot.sim.traces import Workload


def _covered(spans: list[tuple[float, float]], lo: float, hi: float) -> float:
    """The time in [lo, hi] covered by some span, on a fine grid (brute force)."""
    grid = np.linspace(lo, hi, 20001)[:-1] + (hi - lo) / 40000
    hit = np.zeros_like(grid, dtype=bool)
    for a, b in spans:
        hit |= (grid >= a) & (grid < b)
    return float(hit.mean() * (hi - lo))


def test_the_busy_share_counts_overlapping_spans_once_and_a_running_one_up_to_now() -> None:
    w = BusyWindow()
    assert w.share(5.0) == 0.0
    w.add(0.0, 0.3)
    w.add(0.2, 0.4)  # overlaps the first (another slot): counted once
    w.add(0.6, 2.0)  # still running at 1.0
    assert w.share(1.0) == pytest.approx(0.8)
    assert w.share(1.5) == pytest.approx(0.9)  # [0.5, 1.5]: 0.9 s of the running span
    assert w.share(3.5) == 0.0  # all spans out of the window
    assert busy_shares([0.0, 0.5, 0.6], [0.5, 0.1, 0.1]) == [0.0, pytest.approx(0.5), pytest.approx(0.6)]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.floats(0.0, 0.4), st.floats(0.001, 0.6)), min_size=1, max_size=25))
def test_busy_shares_are_the_covered_part_of_the_window_before_each_start(gaps: list) -> None:
    starts = np.cumsum([g for g, _ in gaps]).tolist()
    took = [d for _, d in gaps]
    shares = busy_shares(starts, took)
    for i, s in enumerate(starts):
        spans = [(a, a + d) for a, d in zip(starts[:i], took[:i], strict=True)]
        want = _covered(spans, s - BUSY_WINDOW_S, s) / BUSY_WINDOW_S
        assert 0.0 <= shares[i] <= 1.0 and shares[i] == pytest.approx(want, abs=2e-3)


def test_busy_factors_price_a_batch_by_its_busy_share_and_are_checked() -> None:
    factors = (1.2, 0.9)
    assert len(factors) == len(BUSY_EDGES) + 1
    assert [busy_factor(factors, s) for s in (0.0, 0.399, 0.4, 1.0)] == [1.2, 1.2, 0.9, 0.9]
    assert busy_factor((), 0.7) == 1.0
    fe = FrontEnd(loaded_busy_factors=factors)
    assert FrontEnd.from_dict(fe.to_dict()) == fe and FrontEnd.from_dict({}).loaded_busy_factors == ()
    assert fe.batch_seconds(0.01, busy=0.9) == pytest.approx(0.009)
    assert fe.batch_seconds(0.01, busy=0.0) == pytest.approx(0.012)
    for bad in ((1.0,) * 3, (1.0, math.nan), (0.0, 1.0)):
        with pytest.raises(ValueError, match="loaded_busy_factors"):
            FrontEnd(loaded_busy_factors=bad)


@pytest.mark.parametrize("max_batch", [1, 8])
def test_the_simulator_prices_each_batch_at_the_busy_share_its_own_log_shows(max_batch: int) -> None:
    # bursts and gaps on one slot, pipelined batches included: every simulated batch took the price
    # of the busy share that ``busy_shares`` reads off the simulated batches' own starts and times
    rng = np.random.default_rng(3)
    bursts = (rng.uniform(0, 2, 60), rng.uniform(3, 3.4, 80), rng.uniform(5, 9, 40))
    arrivals = np.sort(np.concatenate(bursts))
    tokens = rng.integers(8, 200, arrivals.size)
    factors = tuple(np.linspace(1.3, 0.7, len(BUSY_EDGES) + 1).tolist())
    fe = FrontEnd(loaded_busy_factors=factors)
    cm = CostModel(latency_coef=(0.004, 0.0, 0.0001, 0.0))
    cfg = SchedulerConfig(policy=PolicyConfig(name="window", max_batch_size=max_batch, max_wait_s=0.002))
    workload = Workload.from_columns("t", arrivals.tolist(), tokens.tolist())
    run = simulate_encoder(workload, cfg, cm, frontend=fe)
    rec = run.record
    order = np.argsort(rec.b_start, kind="stable")
    starts, took = np.asarray(rec.b_start)[order], np.asarray(rec.b_duration)[order]
    shares = busy_shares(starts.tolist(), took.tolist())
    want = [served_seconds(cm.batch_latency(int(n), int(t), float(a)), (1.0, 0.0, 0.0), 0.0, 0.0, float(t),
                           busy=s, busy_factors=factors)
            for n, t, a, s in zip(np.asarray(rec.b_size)[order], np.asarray(rec.b_tokens)[order],
                                  np.asarray(rec.b_attn)[order], shares, strict=True)]
    assert took == pytest.approx(want, rel=1e-9)
    assert {busy_factor(factors, s) for s in shares} >= {1.3, 0.7}  # both ends of the bins were hit
