"""The simulator's front-end stage (``sim.service``): Lindley's recursion for the serial stage, the
fit from one-at-a-time measurements, and what it does to a simulated run."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchpilot.core.config import PolicyConfig, SchedulerConfig
from batchpilot.core.costmodel import CostModel
from batchpilot.sim.metrics import summarize
from batchpilot.sim.service import (
    BUSY_EDGES,
    BUSY_WINDOW_S,
    MIN_WINDOW_BATCHES,
    WANDER_WINDOW_S,
    BatchNoise,
    BusyWindow,
    FrontEnd,
    busy_factor,
    busy_shares,
    served_seconds,
    split_wander,
)
from batchpilot.sim.target import DONE, simulate_encoder
from batchpilot.sim.traces import Workload


def _brute_force(arrivals: list[float], service: list[float]) -> list[float]:
    """A single FIFO server, one event at a time: start when both the server and the request are there."""
    out, free = [], 0.0
    for i, (a, c) in enumerate(zip(arrivals, service, strict=True)):
        start = a if i == 0 else max(a, free)
        free = start + c
        out.append(free)
    return out


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 5), st.integers(1, 512)), min_size=1, max_size=60),
       st.floats(0, 0.05), st.floats(0, 1e-4))
def test_serial_stage_is_a_fifo_single_server(rows: list[tuple[float, int]], const: float,
                                              per_tok: float) -> None:
    rows.sort()
    arr = np.array([a for a, _ in rows])
    tok = np.array([n for _, n in rows])
    fe = FrontEnd(serial_const_s=const, serial_per_token_s=per_tok)
    got = fe.batcher_arrivals(arr, tok)
    want = _brute_force(arr.tolist(), (const + per_tok * tok).tolist())
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-9)
    assert (np.diff(got) >= -1e-12).all()  # the engine needs sorted arrivals
    assert (got >= arr + const + per_tok * tok - 1e-12).all()


def test_fit_recovers_both_stages_from_noisy_sequential_requests() -> None:
    rng = np.random.default_rng(0)
    tok = rng.integers(4, 400, size=200).astype(float)
    tokenize = 0.4e-3 + 2e-6 * tok + rng.normal(0, 2e-5, tok.size)
    batcher = 0.01 + 1e-4 * tok
    rest = 3e-3 + 5e-6 * tok + rng.normal(0, 5e-5, tok.size)
    rest[::40] += 0.05  # scheduler hiccups: the trimmed fit must ignore them
    fe = FrontEnd.fit(tok, tokenize + batcher + rest, tokenize, batcher)
    assert fe.serial_const_s == pytest.approx(0.4e-3, rel=0.1)
    assert fe.serial_per_token_s == pytest.approx(2e-6, rel=0.1)
    assert fe.delay_const_s == pytest.approx(3e-3, rel=0.1)
    assert fe.delay_per_token_s == pytest.approx(5e-6, rel=0.1)


def test_fit_clamps_noise_to_non_negative_and_refuses_missing_timing() -> None:
    tok = np.array([10.0, 100.0, 200.0, 300.0])
    falling = np.array([4e-3, 3e-3, 2e-3, 1e-3])  # a negative slope is noise: median, flat
    fe = FrontEnd.fit(tok, falling + 0.01, np.zeros(4), np.full(4, 0.01))
    assert fe.delay_per_token_s == 0.0 and fe.delay_const_s == pytest.approx(2.5e-3)
    with pytest.raises(ValueError, match="Server-Timing"):
        FrontEnd.fit(tok, tok, np.full(4, math.nan), tok)
    with pytest.raises(ValueError, match="serial_const_s"):
        FrontEnd(serial_const_s=-1.0)
    assert FrontEnd.from_dict(fe.to_dict()) == fe


def _workload(arrivals: list[float], tokens: list[int]) -> Workload:
    return Workload.from_columns("t", arrivals, tokens)


def test_delay_adds_to_latency_and_leaves_the_batcher_alone() -> None:
    wl = _workload([0.0, 0.5, 1.0, 1.5], [32, 64, 128, 256])
    cfg = SchedulerConfig(policy=PolicyConfig(name="static", max_batch_size=1))
    cm = CostModel(latency_coef=(0.1, 0.0, 0.0, 0.0))
    base = simulate_encoder(wl, cfg, cm)
    fe = FrontEnd(delay_const_s=0.002, delay_per_token_s=1e-5)
    run = simulate_encoder(wl, cfg, cm, frontend=fe)
    np.testing.assert_allclose(np.array(run.record.finish_s) - np.array(base.record.finish_s),
                               fe.delay(wl.input_tokens, wl.arrival_s))
    assert run.record.dispatch_s == base.record.dispatch_s
    assert summarize(run).queue["mean"] == pytest.approx(summarize(base).queue["mean"])


def test_the_delay_under_load_grows_with_the_arrival_rate_before_each_request() -> None:
    from batchpilot.sim.service import rates_at

    arrivals = np.array([0.0, 0.2, 0.4, 0.6, 1.5, 3.0])
    np.testing.assert_allclose(rates_at(arrivals), [0, 1, 2, 3, 1, 0])  # the others in the second before
    tok = np.full(6, 10)
    fe = FrontEnd(delay_const_s=0.002, delay_loaded_s=0.001, delay_rate_coef_s=0.0005)
    np.testing.assert_allclose(fe.delay(tok), 0.002)  # no arrivals: the lone requests' line
    np.testing.assert_allclose(fe.delay(tok, arrivals), 0.003 + 0.0005 * rates_at(arrivals))
    wl = _workload(arrivals.tolist(), tok.tolist())
    cfg = SchedulerConfig(policy=PolicyConfig(name="static", max_batch_size=1))
    cm = CostModel(latency_coef=(0.01, 0.0, 0.0, 0.0))
    base = simulate_encoder(wl, cfg, cm, frontend=FrontEnd(delay_const_s=0.002))
    run = simulate_encoder(wl, cfg, cm, frontend=fe)  # the simulator adds it to every finish
    np.testing.assert_allclose(np.array(run.record.finish_s) - np.array(base.record.finish_s),
                               0.001 + 0.0005 * rates_at(arrivals))
    assert FrontEnd.from_dict(fe.to_dict()) == fe


def test_serial_stage_spreads_a_burst_before_the_batcher() -> None:
    # 4 requests at once, 10 ms each in the tokenizer thread: they reach the batcher 10 ms apart, so a
    # batch-of-4 window policy that would have taken them together now waits for the last one
    wl = _workload([0.0] * 4, [16] * 4)
    cfg = SchedulerConfig(policy=PolicyConfig(name="window", max_batch_size=4, max_wait_s=0.1,
                                              wait_only_if_it_pays=False))
    cm = CostModel(latency_coef=(0.05, 0.0, 0.0, 0.0))
    run = simulate_encoder(wl, cfg, cm, frontend=FrontEnd(serial_const_s=0.01))
    assert run.batcher_arrival_s is not None
    np.testing.assert_allclose(run.batcher_arrival_s, [0.01, 0.02, 0.03, 0.04])
    assert all(s == DONE for s in run.record.status)
    assert run.record.dispatch_s == pytest.approx([0.04] * 4)  # full batch once the fourth is through
    rep = summarize(run)
    assert rep.latency["mean"] == pytest.approx(0.04 + 0.05)  # from the client's arrival
    assert rep.queue["mean"] == pytest.approx(np.mean([0.03, 0.02, 0.01, 0.0]))  # from the batcher's


def test_driver_fields_are_validated_and_default_when_absent() -> None:
    fe = FrontEnd(serial_const_s=1e-3, batch_overhead_s=2e-4, serial_busy_factor=1.5)
    assert FrontEnd.from_dict(fe.to_dict()) == fe
    old = {"serial_const_s": 1e-3, "serial_per_token_s": 0.0, "delay_const_s": 0.0, "delay_per_token_s": 0.0}
    back = FrontEnd.from_dict(old)  # a dict written before the driver fields existed
    assert (back.batch_overhead_s, back.serial_busy_factor) == (0.0, 1.0)
    with pytest.raises(ValueError, match="batch_overhead_s"):
        FrontEnd(batch_overhead_s=-1e-3)
    with pytest.raises(ValueError, match="serial_busy_factor"):
        FrontEnd(serial_busy_factor=0.9)
    with pytest.raises(ValueError, match="serial_busy_factor"):
        FrontEnd(serial_busy_factor=math.inf)
    tok = np.array([10.0, 100.0, 200.0, 300.0])
    fitted = FrontEnd.fit(tok, np.full(4, 0.02), np.full(4, 1e-3), np.full(4, 0.01))
    assert (fitted.batch_overhead_s, fitted.serial_busy_factor) == (0.0, 1.0)


def test_from_profile_reads_the_frontend_entry(tmp_path: Path) -> None:
    fe = FrontEnd(serial_const_s=1e-3, delay_const_s=2e-3, batch_overhead_s=3e-4, serial_busy_factor=1.2)
    with_fe = tmp_path / "with.json"
    with_fe.write_text(json.dumps({"cost_model": {}, "frontend": fe.to_dict()}))
    assert FrontEnd.from_profile(with_fe) == fe
    without = tmp_path / "without.json"
    without.write_text(json.dumps({"cost_model": {}, "points": []}))
    assert FrontEnd.from_profile(str(without)) is None


def test_busy_factor_scales_the_serial_service_time() -> None:
    arr = np.array([0.0, 0.0, 0.0, 1.0])
    tok = np.array([100, 100, 100, 100])
    base = FrontEnd(serial_const_s=0.01, serial_per_token_s=1e-4)
    busy = FrontEnd(serial_const_s=0.01, serial_per_token_s=1e-4, serial_busy_factor=2.0)
    np.testing.assert_allclose(base.batcher_arrivals(arr, tok), [0.02, 0.04, 0.06, 1.02])
    np.testing.assert_allclose(busy.batcher_arrivals(arr, tok), [0.04, 0.08, 0.12, 1.04])
    np.testing.assert_allclose(busy.delay(tok), base.delay(tok))  # the delay stage is not the tokenizer


def test_loaded_residuals_round_trip_and_set_the_simulated_spread() -> None:
    from batchpilot.core.config import PolicyConfig, SchedulerConfig
    from batchpilot.core.costmodel import CostModel
    from batchpilot.sim.target import simulate_encoder
    from batchpilot.sim.traces import Workload

    fe = FrontEnd(loaded_alpha=2.0, loaded_const_s=0.001, loaded_residuals=(0.5, -0.5, 0.0))
    assert fe.loaded_residuals == (-0.5, 0.0, 0.5)
    assert FrontEnd.from_dict(fe.to_dict()) == fe
    assert fe.batch_seconds(0.01) == pytest.approx(0.021)
    with pytest.raises(ValueError, match="loaded_residuals"):
        FrontEnd(loaded_residuals=(-1.5,))
    # every simulated batch: (alpha x cost model + const) x (1 + a drawn residual), seeded
    cm = CostModel(latency_coef=(0.01, 0.0, 0.0, 0.0))
    wl = Workload.from_columns("r", [i * 1.0 for i in range(40)], [8] * 40)
    cfg = SchedulerConfig(policy=PolicyConfig(name="window", max_batch_size=1, max_wait_s=0.0))
    run = simulate_encoder(wl, cfg, cm, frontend=fe, seed=3)
    durations = sorted(set(round(d, 6) for d in run.record.b_duration))
    assert durations == pytest.approx([0.0105, 0.021, 0.0315])
    again = simulate_encoder(wl, cfg, cm, frontend=fe, seed=3)
    assert again.record.b_duration == run.record.b_duration


def test_a_batch_longer_than_the_residuals_reference_varies_less_relative_to_its_length() -> None:
    # the same residuals in the units of a 10.5 ms batch: a 21 ms batch draws them times sqrt(1/2)
    fe = FrontEnd(loaded_alpha=2.0, loaded_residuals=(0.5, -0.5, 0.0), loaded_residual_ref_s=0.0105)
    assert FrontEnd.from_dict(fe.to_dict()) == fe
    cm = CostModel(latency_coef=(0.0105, 0.0, 0.0, 0.0))
    wl = Workload.from_columns("r", [i * 1.0 for i in range(40)], [8] * 40)
    cfg = SchedulerConfig(policy=PolicyConfig(name="window", max_batch_size=1, max_wait_s=0.0))
    durations = sorted(set(round(d, 6) for d in simulate_encoder(wl, cfg, cm, frontend=fe, seed=3)
                           .record.b_duration))
    half = 0.5 * math.sqrt(0.5)
    assert durations == pytest.approx([0.021 * (1 - half), 0.021, 0.021 * (1 + half)], abs=1e-6)
    # a batch no longer than the reference keeps its relative spread
    short = FrontEnd(loaded_residuals=(0.5, -0.5, 0.0), loaded_residual_ref_s=0.1)
    durations = sorted(set(round(d, 6) for d in simulate_encoder(wl, cfg, cm, frontend=short, seed=3)
                           .record.b_duration))
    assert durations == pytest.approx([0.00525, 0.0105, 0.01575])


@settings(max_examples=200, deadline=None)
@given(rel=st.floats(-0.9, 3.0), line=st.floats(1e-4, 2.0), ref=st.floats(1e-4, 0.5))
def test_the_profile_s_residual_units_and_the_simulator_s_scale_are_inverse(rel: float, line: float,
                                                                            ref: float) -> None:
    from batchpilot.sim.service import residual_scale, residual_units

    z = float(residual_units(np.array([rel]), np.array([line]), ref)[0])
    back = z * residual_scale(line, ref)
    assert back >= -0.99 and math.isfinite(back)
    if z > -0.99:  # not clipped: the simulator draws exactly the measured relative residual
        assert back == pytest.approx(rel, rel=1e-9, abs=1e-12)


def test_two_tokenizer_threads_halve_a_burst_s_queue() -> None:
    burst = np.zeros(4)
    one = FrontEnd(serial_const_s=0.01).batcher_arrivals(burst, np.ones(4))
    two = FrontEnd(serial_const_s=0.01, serial_servers=2).batcher_arrivals(burst, np.ones(4))
    np.testing.assert_allclose(one, [0.01, 0.02, 0.03, 0.04])
    np.testing.assert_allclose(two, [0.01, 0.01, 0.02, 0.02])
    with pytest.raises(ValueError, match="serial_servers"):
        FrontEnd(serial_servers=0)


def test_several_tokenizer_servers_may_hand_rows_to_the_batcher_out_of_order() -> None:
    # a long row then a short one, two servers: the short one reaches the batcher first
    wl = Workload.from_columns("two", [0.0, 0.001], [512, 4])
    fe = FrontEnd(serial_servers=2, serial_per_token_s=1e-4)
    at = fe.batcher_arrivals(wl.arrival_s, wl.input_tokens)
    assert at[1] < at[0]
    run = simulate_encoder(wl, SchedulerConfig(policy=PolicyConfig(max_batch_size=1)),
                           CostModel(latency_coef=(0.01, 0.0, 0.0, 0.0)), frontend=fe)
    assert list(run.record.status) == [DONE, DONE]
    assert run.record.dispatch_s[1] < run.record.dispatch_s[0]  # the batcher saw the short one first


def test_a_frontend_with_unknown_fields_is_refused_with_what_to_do() -> None:
    with pytest.raises(ValueError, match="unknown fields cold_s.*run `batchpilot profile` again"):
        FrontEnd.from_dict({"loaded_alpha": 1.2, "cold_s": 0.001})


def test_idle_factors_price_a_batch_by_the_idle_time_before_it() -> None:
    from batchpilot.core.config import PolicyConfig, SchedulerConfig
    from batchpilot.sim.service import IDLE_EDGES_S, idle_factor, idle_times
    from batchpilot.sim.target import simulate_encoder

    factors = (0.9, 0.95, 1.0, 1.05, 1.1, 1.3)
    assert [idle_factor(factors, t) for t in (0.0, 0.0019, 0.002, 0.05, 0.29, 0.3, math.inf)] == \
        [0.9, 0.9, 0.95, 1.05, 1.1, 1.3, 1.3]
    assert idle_factor((), 5.0) == 1.0 and len(factors) == len(IDLE_EDGES_S) + 1
    assert idle_times([0.0, 0.01, 0.5], [0.02, 0.02, 0.01]) == [math.inf, 0.0, pytest.approx(0.47)]
    fe = FrontEnd(loaded_idle_factors=factors)
    assert FrontEnd.from_dict(fe.to_dict()) == fe and FrontEnd.from_dict({}).loaded_idle_factors == ()
    assert fe.batch_seconds(0.01, 0.0, 1.0) == pytest.approx(0.013)
    assert fe.batch_seconds(0.01, 0.0, 0.0) == pytest.approx(0.009)
    for bad in ((1.0,) * 3, (1.0, 1.0, 1.0, 1.0, 1.0, 0.0)):
        with pytest.raises(ValueError, match="loaded_idle_factors"):
            FrontEnd(loaded_idle_factors=bad)
    # lone requests a second apart: every batch after an idle server; a burst of 5: the first batch
    # after idle, the next four right behind it
    cm = CostModel(latency_coef=(0.01, 0.0, 0.0, 0.0))
    cfg = SchedulerConfig(policy=PolicyConfig(name="window", max_batch_size=1, max_wait_s=0.0))
    lone = simulate_encoder(_workload([float(i) for i in range(5)], [8] * 5), cfg, cm, frontend=fe)
    assert lone.record.b_duration == pytest.approx([0.013] * 5)
    burst = simulate_encoder(_workload([0.0] * 5, [8] * 5), cfg, cm, frontend=fe)
    assert burst.record.b_duration == pytest.approx([0.013, 0.009, 0.009, 0.009, 0.009])


def test_token_factors_price_a_batch_by_the_thread_plan_step_of_its_tokens() -> None:
    from batchpilot.core.config import PolicyConfig, SchedulerConfig
    from batchpilot.sim.service import step_factor
    from batchpilot.sim.target import simulate_encoder

    steps = ((0, 0.9), (320, 1.3))
    assert [step_factor(steps, t) for t in (0, 319, 320, 5000)] == [0.9, 0.9, 1.3, 1.3]
    assert step_factor((), 100) == 1.0
    fe = FrontEnd(loaded_token_factors=steps)
    assert FrontEnd.from_dict(fe.to_dict()) == fe and FrontEnd.from_dict({}).loaded_token_factors == ()
    assert fe.batch_seconds(0.01, 0.0, 0.0, 100) == pytest.approx(0.009)
    assert fe.batch_seconds(0.01, 0.0, 0.0, 400) == pytest.approx(0.013)
    for bad in (((10, 1.0),), ((0, 1.0), (0, 1.2)), ((0, 1.0), (320, 0.0))):
        with pytest.raises(ValueError, match="loaded_token_factors"):
            FrontEnd(loaded_token_factors=bad)
    cm = CostModel(latency_coef=(0.01, 0.0, 0.0, 0.0))
    cfg = SchedulerConfig(policy=PolicyConfig(name="window", max_batch_size=1, max_wait_s=0.0))
    run = simulate_encoder(_workload([0.0, 1.0, 2.0], [100, 400, 319]), cfg, cm, frontend=fe)
    assert run.record.b_duration == pytest.approx([0.009, 0.013, 0.009])


def test_with_two_slots_a_batch_finds_no_idle_time_while_the_other_slot_runs() -> None:
    from batchpilot.core.config import PolicyConfig, SchedulerConfig
    from batchpilot.sim.target import simulate_encoder

    fe = FrontEnd(loaded_idle_factors=(0.5, 1.0, 1.0, 1.0, 1.0, 2.0))
    cm = CostModel(latency_coef=(0.01, 0.0, 0.0, 0.0))
    cfg = SchedulerConfig(num_slots=2, policy=PolicyConfig(name="window", max_batch_size=1, max_wait_s=0.0))
    # two at once: the first after an idle server (2x), the second beside it on the other slot (0.5x);
    # a third 1 s later, after both are done: idle again
    run = simulate_encoder(_workload([0.0, 0.0, 1.0], [8] * 3), cfg, cm, frontend=fe)
    assert sorted(run.record.b_duration[:2]) == pytest.approx([0.005, 0.02])
    assert run.record.b_duration[2] == pytest.approx(0.02)


# What ran before a batch (``sim.service``): the busy share, its factors, and that the simulator
# and the batch-log pricing compute it alike.

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


# The batch-time noise: the wander split off the loaded residuals, and drawn per window of simulated time.

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
