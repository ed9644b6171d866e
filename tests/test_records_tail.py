"""``records.tail_seconds``: how many seconds of arrivals a run's slowest requests came from."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from batchpilot.bench.records import RequestRecord, tail_seconds


def rec(i: int, scheduled_s: float, latency_s: float, status: int = 200,
        warmup: bool = False) -> RequestRecord:
    return RequestRecord(index=i, scheduled_s=scheduled_s, input_tokens=8, status=status,
                         latency_s=latency_s, warmup=warmup)


def test_one_burst_sets_the_tail() -> None:
    # 200 fast requests over 100 s, then 5 slow ones arriving within one second
    rs = [rec(i, i * 0.5, 0.01) for i in range(200)] + [rec(200 + k, 50.2 + k * 0.1, 1.0) for k in range(5)]
    assert tail_seconds(rs) == (5, 1)


def test_a_spread_tail_counts_every_second() -> None:
    rs = [rec(i, float(i), 0.01) for i in range(300)] + [rec(300 + k, 10.0 * k + 0.5, 1.0) for k in range(6)]
    assert tail_seconds(rs) == (6, 6)


def test_failed_and_warmup_requests_are_left_out() -> None:
    rs = [rec(i, float(i), 0.01 + i * 1e-4) for i in range(100)]
    rs += [rec(100, 5.0, 9.0, status=503), rec(101, 6.0, 9.0, warmup=True)]
    assert tail_seconds(rs) == (1, 1)  # request 99, the slowest that was answered and measured
    assert tail_seconds([]) == (0, 0)


@given(st.lists(st.tuples(st.floats(0, 1000), st.floats(1e-4, 10)), min_size=1, max_size=300))
def test_bounds(rows: list[tuple[float, float]]) -> None:
    rs = [rec(i, t, lat) for i, (t, lat) in enumerate(rows)]
    n, seconds = tail_seconds(rs)
    assert 1 <= seconds <= n <= len(rs)
    assert n >= len(rs) // 100  # at least the top 1%


def test_a_repeat_reports_each_replay_s_tail() -> None:
    from batchpilot.bench.fidelity import Measurement, repeat_rows
    from batchpilot.bench.records import summarize

    def measured(rs: list[RequestRecord]) -> Measurement:
        for r in rs:
            r.sent_s, r.done_s = r.scheduled_s, r.scheduled_s + r.latency_s
        return Measurement(summarize(rs), rs, None)

    fast = [rec(i, i * 0.5, 0.01) for i in range(200)]
    burst = fast + [rec(200 + k, 50.2 + k * 0.1, 1.0) for k in range(5)]
    spread = [rec(i, i * 0.5, 0.01) for i in range(200)] + [rec(200 + k, 10.0 * k, 1.0) for k in range(5)]
    rows = repeat_rows(0.5, measured(burst), measured(spread), (0.01, -0.02))
    assert rows[-1] == ["50%", "slowest 1%: requests / seconds", "5 / 1", "5 / 5", "", ""]
    assert rows[-2][1] == "speed vs profile"
    scored = {r[1]: r[5] for r in rows[:-2]}  # the again run scored against the first
    assert scored["throughput req/s"] == scored["rejected"] == "yes" and scored["mean batch size"] == "-"
    assert scored["P99 ms"] == "yes"  # the same five slow requests, from one burst or spread out
    quiet = repeat_rows(0.5, measured(burst), measured([rec(i, i * 0.5, 0.01) for i in range(205)]))
    assert {r[1]: r[5] for r in quiet[:-2]}["P99 ms"] == "no"  # without them the P99 is 10 ms, not 1 s
