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
from batchpilot.sim.service import FrontEnd
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
