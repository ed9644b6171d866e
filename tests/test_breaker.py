"""core/breaker.py on a fake clock: open on failures, probe after the interval, back off, close."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from batchpilot.core.breaker import BreakerConfig, BreakerState, CircuitBreaker


def test_one_failure_opens_by_default_and_traffic_stops_until_the_probe_is_due() -> None:
    b = CircuitBreaker(BreakerConfig(probe_interval_s=5.0))
    assert b.allows and b.state is BreakerState.CLOSED
    assert b.record_failure(now=10.0)
    assert not b.allows and b.state is BreakerState.OPEN and b.probe_at == 15.0
    assert not b.take_probe(14.99)
    assert b.take_probe(15.0) and b.state is BreakerState.HALF_OPEN
    assert not b.take_probe(15.0)  # one probe at a time
    assert not b.allows  # half-open: still no traffic until the probe succeeds


def test_a_successful_probe_closes_and_resets_the_interval() -> None:
    b = CircuitBreaker(BreakerConfig(probe_interval_s=1.0, backoff=2.0))
    b.record_failure(0.0)
    assert b.take_probe(1.0)
    assert b.record_failure(1.0) and b.probe_at == 3.0  # failed probe: waits twice as long
    assert b.take_probe(3.0)
    assert b.record_success(3.5) and b.allows and b.num_closed == 1 and b.num_opened == 2
    b.record_failure(10.0)
    assert b.probe_at == 11.0  # back to the first interval after a close


def test_failed_probes_back_off_to_the_cap() -> None:
    b = CircuitBreaker(BreakerConfig(probe_interval_s=1.0, backoff=3.0, max_probe_interval_s=5.0))
    now = 0.0
    b.record_failure(now)
    waits = []
    for _ in range(4):
        assert b.probe_at is not None
        now = b.probe_at
        waits.append(b.probe_at)
        assert b.take_probe(now)
        b.record_failure(now)
    assert b.interval_s == 5.0
    assert [round(w2 - w1, 6) for w1, w2 in zip(waits, waits[1:], strict=False)] == [3.0, 5.0, 5.0]


def test_the_threshold_counts_consecutive_failures_only() -> None:
    b = CircuitBreaker(BreakerConfig(failure_threshold=3))
    b.record_failure(0.0)
    b.record_failure(0.1)
    b.record_success(0.2)
    b.record_failure(0.3)
    b.record_failure(0.4)
    assert b.allows
    assert b.record_failure(0.5) and not b.allows


def test_a_late_success_while_open_does_not_close() -> None:
    b = CircuitBreaker()
    b.record_failure(0.0)
    assert not b.record_success(0.1) and b.state is BreakerState.OPEN
    assert not b.record_failure(0.2)  # already open: the probe time does not move
    assert b.probe_at == 5.0


@pytest.mark.parametrize("kw", [{"failure_threshold": 0}, {"probe_interval_s": 0.0}, {"backoff": 0.5},
                                {"probe_interval_s": 10.0, "max_probe_interval_s": 5.0}])
def test_invalid_configs_are_refused(kw: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="breaker"):
        BreakerConfig(**kw)  # type: ignore[arg-type]


@given(st.lists(st.tuples(st.sampled_from(["ok", "fail", "probe"]), st.floats(0, 10)), max_size=60))
def test_traffic_is_allowed_exactly_when_closed_and_probes_only_follow_an_open(
        events: list[tuple[str, float]]) -> None:
    b, now = CircuitBreaker(BreakerConfig(failure_threshold=2, probe_interval_s=1.0)), 0.0
    for kind, dt in events:
        now += dt
        before = b.state
        if kind == "ok":
            b.record_success(now)
        elif kind == "fail":
            b.record_failure(now)
        elif b.take_probe(now):
            assert before is BreakerState.OPEN
        assert b.allows == (b.state is BreakerState.CLOSED)
        assert (b.probe_at is None) == (b.state is BreakerState.CLOSED)
