"""The cold start: a batch after an idle server costs more than one right after another. The probe
that measures it, the curve the profile keeps, and the simulator and the loaded fit that use it."""

from __future__ import annotations

import time
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from batchpilot.core.config import PolicyConfig, SchedulerConfig
from batchpilot.core.costmodel import CostModel
from batchpilot.models.cold import measure_cold, nondecreasing
from batchpilot.server.serving_load import Loaded, fit_loaded
from batchpilot.sim.frontend import FrontEnd, idle_before
from batchpilot.sim.target import simulate_encoder
from batchpilot.sim.traces import Workload


@given(st.lists(st.floats(-1e3, 1e3), min_size=1, max_size=30))
def test_pooled_adjacent_violators_is_non_decreasing_and_keeps_the_sum(values: list[float]) -> None:
    out = nondecreasing(values)
    assert len(out) == len(values) and all(a <= b + 1e-9 for a, b in zip(out, out[1:], strict=False))
    assert sum(out) == pytest.approx(sum(values), abs=1e-6)
    assert nondecreasing(sorted(values)) == pytest.approx(sorted(values))


class _Cold:
    """A model whose call takes 2 ms, plus 6 ms when it follows a sleep of 50 ms or more."""

    max_length = 64

    def __init__(self) -> None:
        self.cold = False

    def prepare(self, batch: Any) -> Any:
        return batch

    def run(self, batch: Any) -> None:
        time.sleep(0.008 if self.cold else 0.002)
        self.cold = False


def test_the_probe_measures_the_extra_after_each_idle_gap() -> None:
    model = _Cold()
    slept: list[float] = []

    def sleep(gap: float) -> None:  # the idle gap, not waited for: its effect is the model's
        slept.append(gap)
        model.cold = gap >= 0.05

    gaps, extra, details = measure_cold(model, [1, 5, 2], "none", rounds=3, gaps_s=(0.0, 0.01, 0.1, 1.0),
                                        sleep=sleep)
    assert gaps == (0.0, 0.01, 0.1, 1.0) and sorted(slept) == [0.01] * 3 + [0.1] * 3 + [1.0] * 3
    assert extra[0] == 0.0 and extra[1] < 0.002 and extra == tuple(sorted(extra))
    assert extra[2] == pytest.approx(0.006, abs=0.003) and extra[3] == pytest.approx(0.006, abs=0.003)
    assert details["length"] == 3 and details["rounds"] == 3
    with pytest.raises(ValueError, match="gaps starting at 0"):
        measure_cold(model, [1], "none", gaps_s=(0.01,))


def test_the_curve_is_interpolated_validated_and_round_trips() -> None:
    fe = FrontEnd(cold_idle_s=(0.0, 0.01, 0.1), cold_extra_s=(0.0, 0.001, 0.003))
    assert [fe.cold_seconds(t) for t in (0.0, 0.005, 0.055, 0.1, 9.0)] == pytest.approx(
        [0.0, 0.0005, 0.002, 0.003, 0.003])
    assert fe.batch_seconds(0.01, 0.0, 0.1) == pytest.approx(0.013) and FrontEnd().cold_seconds(5.0) == 0.0
    assert FrontEnd.from_dict(fe.to_dict()) == fe
    with pytest.raises(ValueError, match="increasing"):
        FrontEnd(cold_idle_s=(0.0, 0.0), cold_extra_s=(0.0, 0.001))
    with pytest.raises(ValueError, match="cold"):
        FrontEnd(cold_idle_s=(0.0,), cold_extra_s=(-0.001,))
    assert idle_before([0.0, 0.01, 0.5], [0.02, 0.02, 0.02]) == pytest.approx([float("inf"), 0.0, 0.47])


def test_the_simulator_charges_a_batch_after_an_idle_server_and_not_one_behind_another() -> None:
    cm = CostModel(latency_coef=(0.01, 0.0, 0.0, 0.0))
    fe = FrontEnd(cold_idle_s=(0.0, 0.05), cold_extra_s=(0.0, 0.004))
    cfg = SchedulerConfig(policy=PolicyConfig(name="window", max_batch_size=1, max_wait_s=0.0))
    apart = Workload.from_columns("apart", [i * 1.0 for i in range(5)], [8] * 5)
    assert simulate_encoder(apart, cfg, cm, frontend=fe).record.b_duration == pytest.approx([0.014] * 5)
    burst = Workload.from_columns("burst", [0.0] * 5, [8] * 5)  # a queue: each batch starts as one ends
    assert simulate_encoder(burst, cfg, cm, frontend=fe).record.b_duration == pytest.approx(
        [0.014] + [0.010] * 4)
    warm = simulate_encoder(apart, cfg, cm, frontend=FrontEnd())  # no curve: nothing added
    assert warm.record.b_duration == pytest.approx([0.01] * 5)


def test_the_loaded_fit_takes_the_cold_start_out_before_it_prices_the_speed() -> None:
    model = CostModel(latency_coef=(0.01, 0.0, 0.0, 0.0))
    curve = FrontEnd(cold_idle_s=(0.0, 0.05), cold_extra_s=(0.0, 0.005))
    batches, alpha = [], 1.5
    for k in range(30):  # alternately right behind the last batch and after 0.2 s idle
        start = 0.0 if not batches else batches[-1].start + batches[-1].slot_s + (0.2 if k % 2 else 0.0)
        idle = float("inf") if not batches else (0.2 if k % 2 else 0.0)
        batches.append(Loaded({"const": 1.0}, 0.01 * alpha + curve.cold_seconds(idle), start, [start]))
    (a, _, _), details = fit_loaded(batches, model, 0.0, curve.cold_seconds)
    assert a == pytest.approx(alpha) and max(abs(r) for r in details["residuals"]) < 1e-9
    (blind, _, _), _ = fit_loaded(batches, model, 0.0)  # without the curve the speed soaks it up
    assert blind > alpha * 1.1
