"""A live run's speed against the profile: each batch priced at its own request rate, as the
simulator prices it, and the spread over the run's windows."""

from __future__ import annotations

import math
from pathlib import Path

from batchpilot.bench.fidelity import WINDOW_S, priced_seconds, speed_of
from batchpilot.core.costmodel import CostModel
from batchpilot.runtime.journal import LoggedBatch
from batchpilot.sim.service import FrontEnd, rates_before


def test_a_batch_is_priced_at_the_rate_of_the_second_before_it() -> None:
    sent = [0.1, 0.5, 0.9, 1.2, 5.0]
    assert rates_before([1.0, 1.3, 2.5, 5.0, 5.01], sent) == [3.0, 3.0, 0.0, 0.0, 1.0]
    cm = CostModel(latency_coef=(0.01, 0.0, 0.0, 0.0))
    fe = FrontEnd(loaded_alpha=1.0, loaded_rate_coef=0.1)
    b = LoggedBatch(1.0, 0.02, 1, {"const": 1.0, "n": 1.0, "tokens": 8.0, "attn": 64.0})
    # 0.01 s * (1 + 0.1 * rate): the bursty batch costs more than the lone one, as in the simulator
    assert priced_seconds([b, b], cm, fe, [3.0, 0.0]) == [0.01 * 1.3, 0.01]
    assert priced_seconds([b], cm, None, [3.0]) == [0.01]


def test_a_drift_within_the_run_shows_as_the_spread_of_its_windows() -> None:
    feats = {"const": 1.0}
    fast = [LoggedBatch(t * 0.5, 0.01, 1, feats) for t in range(60)]  # 30 s at the profile's speed
    slow = [LoggedBatch(30.0 + t * 0.5, 0.02, 1, feats) for t in range(60)]  # then 30 s twice as slow
    rs = speed_of(fast + slow, [0.01] * 120)
    assert math.isclose(rs.speed, 0.5) and rs.batches == 120
    assert len(rs.windows) == int(60 / WINDOW_S)
    assert math.isclose(min(rs.windows), 0.0, abs_tol=1e-12) and math.isclose(max(rs.windows), 1.0)
    assert rs.spread == "+0.0% .. +100.0%"
    assert math.isnan(speed_of([], []).speed)


def test_by_idle_splits_the_speed_by_the_idle_time_before_each_batch() -> None:
    from batchpilot.bench.fidelity import by_idle, idle_before

    feats = {"const": 1.0}
    behind = [LoggedBatch(k * 0.01, 0.01, 1, feats) for k in range(10)]  # back to back, at the price
    apart = [LoggedBatch(1.0 + k * 1.0, 0.015, 1, feats) for k in range(5)]  # after ~1 s idle, 50% over
    assert idle_before(behind[:2] + apart[:1]) == [math.inf, 0.0, 0.98]
    bins = {label: (n, r) for label, n, r in by_idle(behind + apart, [0.01] * 15)}
    assert bins["0-2 ms"][0] == 9 and math.isclose(bins["0-2 ms"][1], 0.0, abs_tol=1e-9)
    assert bins[">= 300 ms"][0] == 5 + 1 and bins[">= 300 ms"][1] > 0.35  # the first batch counts as idle


def test_by_size_splits_the_speed_by_the_requests_in_each_batch() -> None:
    from batchpilot.bench.fidelity import by_size

    feats = {"const": 1.0}
    batches = [LoggedBatch(k, 0.01, 1, feats) for k in range(4)] + [LoggedBatch(10 + k, 0.03, 12, feats)
                                                                    for k in range(2)]
    bins = {label: (n, r) for label, n, r in by_size(batches, [0.01] * 4 + [0.02] * 2)}
    assert set(bins) == {"1", "9+"} and bins["1"] == (4, 0.0)
    assert bins["9+"][0] == 2 and math.isclose(bins["9+"][1], 0.5)  # the big batches ran 50% over


def test_by_rate_splits_the_speed_by_the_request_rate_before_each_batch() -> None:
    from batchpilot.bench.fidelity import by_rate

    feats = {"const": 1.0}
    batches = [LoggedBatch(k, 0.012, 1, feats) for k in range(3)] + [LoggedBatch(10 + k, 0.009, 4, feats)
                                                                     for k in range(2)]
    bins = {label: (n, r) for label, n, r in by_rate(batches, [0.01] * 5, [2.0, 3.0, 4.0, 35.0, 40.0])}
    assert set(bins) == {"0-5/s", "30-45/s"}
    assert bins["0-5/s"][0] == 3 and math.isclose(bins["0-5/s"][1], 0.2)  # slow when the server is quiet
    assert bins["30-45/s"][0] == 2 and math.isclose(bins["30-45/s"][1], -0.1)  # fast when it is busy


def test_batches_are_priced_after_their_idle_time_in_start_order(tmp_path: Path) -> None:
    import json

    from batchpilot.bench.fidelity import run_speed

    cm = CostModel(latency_coef=(0.01, 0.0, 0.0, 0.0))
    fe = FrontEnd(loaded_idle_factors=(1.0, 1.0, 1.0, 1.0, 1.0, 1.5))
    feats = {"const": 1.0}
    assert priced_seconds([LoggedBatch(0.0, 0.015, 1, feats), LoggedBatch(0.015, 0.01, 1, feats)], cm, fe,
                          [0.0, 0.0]) == [0.015, 0.01]  # the first after an idle server, 1.5x
    # two slots log their batches as they finish: the later start first; priced in start order
    log = tmp_path / "b.jsonl"
    rows = [{"start": 0.005, "slot_s": 0.01, "n": 1, "features": feats},  # priced 10 ms, right behind
            {"start": 0.0, "slot_s": 0.02, "n": 1, "features": {"const": 2.0}}]  # 20 ms, 1.5x after idle
    log.write_text("".join(json.dumps(r) + "\n" for r in rows))
    rs = run_speed(log, 0, cm, fe, [0.0])
    assert rs.batches == 2 and math.isclose(rs.speed, 0.03 / (0.01 + 0.03) - 1.0)


def test_logged_rates_count_the_logged_arrivals_else_each_batch_at_its_start() -> None:
    from batchpilot.bench.fidelity import logged_rates

    with_arrivals = [LoggedBatch(1.0, 0.1, 2, {}, arrivals=(0.2, 0.9)),
                     LoggedBatch(1.5, 0.1, 1, {}, arrivals=(1.4,))]
    assert logged_rates(with_arrivals) == [2.0, 2.0]  # (0.2 and 0.9), then (0.9 and 1.4) in the second before
    old_log = [LoggedBatch(1.0, 0.1, 2, {}), LoggedBatch(1.5, 0.1, 1, {})]
    assert logged_rates(old_log) == [0.0, 2.0]  # the first batch's two requests counted at its start


def test_run_speed_counts_the_rate_from_the_logged_arrivals_when_the_log_has_them(tmp_path: Path) -> None:
    import json

    from batchpilot.bench.fidelity import run_speed

    cm = CostModel(latency_coef=(0.01, 0.0, 0.0, 0.0))
    fe = FrontEnd(loaded_rate_coef=0.1)  # 10 ms * (1 + 0.1 * rate)
    feats = {"const": 1.0}
    log = tmp_path / "b.jsonl"
    rows = [{"start": 1.0, "slot_s": 0.02, "n": 1, "features": feats, "arrivals": [0.5]},
            {"start": 1.5, "slot_s": 0.03, "n": 1, "features": feats, "arrivals": [1.4]}]
    log.write_text("".join(json.dumps(r) + "\n" for r in rows))
    # at the scheduler: 1 then 2 arrivals in the second before; the send times (none) are not used
    rs = run_speed(log, 0, cm, fe, [])
    assert rs.batches == 2 and math.isclose(rs.speed, 0.05 / (0.011 + 0.012) - 1.0)
    rows = [{k: v for k, v in r.items() if k != "arrivals"} for r in rows]  # an older log: send times
    log.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert math.isclose(run_speed(log, 0, cm, fe, [0.1, 0.2, 0.3, 1.2]).speed, 0.05 / (0.013 + 0.011) - 1.0)


def test_by_busy_splits_the_speed_by_the_busy_share_before_each_batch() -> None:
    from batchpilot.bench.fidelity import by_busy

    feats = {"const": 1.0}
    sparse = [LoggedBatch(float(k), 0.012, 1, feats) for k in range(3)]  # 1 s apart: busy share ~0.01
    dense = [LoggedBatch(5.0 + 0.01 * k, 0.009, 1, feats) for k in range(200)]  # back to back from 5 s
    bins = {label: (n, r) for label, n, r in by_busy(sparse + dense, [0.01] * 203)}
    n = bins["0-0.4"][0]  # the sparse three, slow, and the dense stretch's first few, fast
    assert 3 < n <= 60 and math.isclose(bins["0-0.4"][1], (3 * 0.012 + (n - 3) * 0.009) / (n * 0.01) - 1)
    assert bins[">= 0.4"][0] > 100 and math.isclose(bins[">= 0.4"][1], -0.1)  # fast when it is busy
