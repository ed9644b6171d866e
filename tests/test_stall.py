"""core/stall.py on a fake clock: the stall bound follows the engine's own step times."""

from __future__ import annotations

import pytest

from batchpilot.core.stall import StallRule, StallWatch, quantile, stall_timeout


def test_the_bound_is_a_multiple_of_the_high_quantile_with_a_floor() -> None:
    rule = StallRule(multiple=10.0, quantile=0.99, floor_s=0.5, min_samples=4)
    assert stall_timeout([0.01] * 99 + [0.2], rule) == pytest.approx(0.5)  # 10 x 0.01 is under the floor
    assert stall_timeout([0.2] * 100, rule) == pytest.approx(2.0)
    assert stall_timeout([0.1] * 98 + [0.3, 0.4], rule) == pytest.approx(3.0)  # p99 of 100 = 99th


def test_before_enough_steps_the_cold_bound_applies_and_a_fixed_timeout_overrides_all() -> None:
    rule = StallRule(cold_s=60.0, min_samples=16)
    assert stall_timeout([0.01] * 15, rule) == 60.0
    assert stall_timeout([0.01] * 16, rule) == rule.floor_s
    assert stall_timeout([], StallRule(timeout_s=0.25)) == 0.25
    assert stall_timeout([100.0] * 50, StallRule(timeout_s=0.25)) == 0.25


def test_a_step_past_the_bound_is_overdue_and_an_idle_engine_never_is() -> None:
    w = StallWatch(StallRule(floor_s=1.0, min_samples=2, multiple=10.0))
    for s in (0.05, 0.05, 0.05):
        w.record(s)
    assert w.timeout_s() == 1.0
    assert w.overdue_s(None, now=1e9) is None  # nothing under way
    assert w.overdue_s(busy_since=100.0, now=101.0) is None  # exactly at the bound: not yet
    assert w.overdue_s(busy_since=100.0, now=101.5) == pytest.approx(0.5)


def test_slow_steps_raise_the_bound_and_the_window_forgets_old_ones() -> None:
    w = StallWatch(StallRule(floor_s=0.1, min_samples=1, window=4, multiple=2.0, quantile=1.0))
    w.record(5.0)
    assert w.timeout_s() == 10.0
    for _ in range(4):
        w.record(0.1)
    assert w.timeout_s() == pytest.approx(0.2) and w.num_samples == 4
    w.record(float("nan"))
    w.record(-1.0)
    assert w.num_samples == 4  # not a measurement


def test_quantile_is_nearest_rank() -> None:
    assert quantile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert quantile([1.0], 0.99) == 1.0
    with pytest.raises(ValueError):
        quantile([], 0.5)


@pytest.mark.parametrize("kw", [{"multiple": 0.5}, {"quantile": 0.0}, {"floor_s": 0.0},
                                {"timeout_s": 0.0}, {"min_samples": 10, "window": 5}])
def test_invalid_rules_are_refused(kw: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="stall"):
        StallRule(**kw)  # type: ignore[arg-type]
