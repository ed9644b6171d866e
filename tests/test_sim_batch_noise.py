"""The batch-time noise: the wander split off the loaded residuals, and drawn per window of simulated time."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchpilot.sim.service import MIN_WINDOW_BATCHES, WANDER_WINDOW_S, BatchNoise, FrontEnd, split_wander
from batchpilot.sim.target import simulate_encoder
from batchpilot.sim.traces import Workload


def synthetic(wander: float, spread: float, windows: int = 60, per: int = 12, seed: int = 0
              ) -> tuple[np.ndarray, np.ndarray]:
    """Batch starts and relative residuals: a log-normal speed per 2 s window times one per batch."""
    rng = np.random.default_rng(seed)
    starts = np.concatenate([w * WANDER_WINDOW_S + np.sort(rng.uniform(0, WANDER_WINDOW_S * 0.99, per))
                             for w in range(windows)])
    starts[0] = 0.0  # the windows count from the first batch
    speed = np.repeat(rng.normal(0.0, wander, windows), per)
    return starts, np.expm1(speed + rng.normal(0.0, spread, windows * per))


@pytest.mark.parametrize("wander", [0.0, 0.03, 0.08])
def test_split_wander_recovers_the_speed_wander_beside_a_larger_per_batch_spread(wander: float) -> None:
    estimates = [split_wander(*synthetic(wander, 0.10, seed=s))[0] for s in range(20)]
    assert abs(float(np.median(estimates)) - wander) < 0.012
    assert all(e >= 0.0 for e in estimates)


def test_split_wander_takes_each_windows_offset_out_of_its_residuals() -> None:
    starts, rel = synthetic(0.08, 0.0, windows=10, per=5)  # no per-batch spread: only the wander
    sigma, within, windows = split_wander(starts, rel)
    assert windows == 10
    assert sigma > 0.02
    logs = np.log1p(within)
    assert np.allclose(logs, logs[0])  # every window moved onto the same level


def test_split_wander_leaves_residuals_alone_without_enough_windows() -> None:
    starts = np.linspace(0.0, 3.9, 2 * MIN_WINDOW_BATCHES)  # two windows
    rel = np.linspace(-0.2, 0.2, starts.size)
    sigma, within, windows = split_wander(starts, rel)
    assert (sigma, windows) == (0.0, 2)
    assert np.allclose(within, rel)


@settings(max_examples=50, deadline=None)
@given(st.floats(0.0, 0.3), st.integers(0, 10_000), st.floats(0.0, 50.0))
def test_batch_noise_one_speed_per_window_with_mean_one(wander: float, seed: int, t: float) -> None:
    noise = BatchNoise((), wander=wander, seed=seed)
    k = math.floor(t / WANDER_WINDOW_S)
    inside = k * WANDER_WINDOW_S + 0.5 * WANDER_WINDOW_S
    assert noise.draw(1.0, t) == noise.draw(1.0, inside) == noise.speed(t) > 0.0
    if wander == 0.0:
        assert noise.speed(t) == 1.0
    again = BatchNoise((), wander=wander, seed=seed)
    assert again.speed(t) == noise.speed(t)  # seeded


def test_batch_noise_speed_is_log_normal_with_the_given_spread_and_mean_one() -> None:
    noise = BatchNoise((), wander=0.1, seed=3)
    speeds = np.array([noise.speed(k * WANDER_WINDOW_S) for k in range(20_000)])
    assert abs(float(np.log(speeds).std()) - 0.1) < 0.005
    assert abs(float(speeds.mean()) - 1.0) < 0.005


def test_batch_noise_without_wander_draws_residuals_as_before() -> None:
    res = (-0.2, 0.0, 0.3)
    a, b = BatchNoise(res, seed=7), BatchNoise(res, wander=0.0, seed=7)
    rng = np.random.default_rng(7)
    u = rng.random(4096).tolist()
    for i in range(50):
        want = 1.0 + res[min(int(u.pop() * 3), 2)]
        assert a.draw(1.0, i * 0.1) == b.draw(1.0, i * 0.1) == pytest.approx(want)
    with pytest.raises(ValueError, match="wander"):
        BatchNoise(res, wander=-0.1)


def test_the_simulator_slows_every_batch_of_a_window_together() -> None:
    """Residuals of 0 leave only the wander: a window's batches share one factor over their line."""
    n = 400
    wl = Workload.from_columns("steady", [i * 0.05 for i in range(n)], [64] * n, [0] * n)
    still = simulate_encoder(wl, frontend=FrontEnd(loaded_residuals=(0.0,)), seed=1).record
    moved = simulate_encoder(wl, frontend=FrontEnd(loaded_residuals=(0.0,), loaded_wander=0.2), seed=1).record
    ratio = np.array(moved.b_duration) / np.array(still.b_duration)
    window = np.floor(np.array(moved.b_start) / WANDER_WINDOW_S)
    assert np.array(still.b_size).max() == 1  # one request a batch in both: the same batches
    assert np.allclose(np.array(moved.b_start), np.array(still.b_start), atol=0.05)
    per_window = [ratio[window == w] for w in np.unique(window)]
    assert all(np.allclose(r, r[0]) for r in per_window)
    assert np.std([r[0] for r in per_window]) > 0.05
    assert FrontEnd.from_dict(FrontEnd(loaded_wander=0.2).to_dict()).loaded_wander == 0.2
    with pytest.raises(ValueError, match="loaded_wander"):
        FrontEnd(loaded_wander=-0.1)
