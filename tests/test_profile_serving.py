"""The serving-path measurement (``profile/serving.py``): the real app served in-process, lone
requests over HTTP, the fitted ``FrontEnd`` and what it reports.

No speed assertions (the machine is shared): only that every number is finite and non-negative, the
counts add up, and the server is gone afterwards.
"""

from __future__ import annotations

import math
import threading
from typing import Any

import numpy as np
import pytest

import batchpilot.profile.serving as serving_profile
from batchpilot.core.costmodel import CostModel
from batchpilot.models.encoder import EncoderConfig, EncoderExecutor
from batchpilot.profile.serving import (
    Loaded,
    alternating_arrivals,
    competing_cpu,
    fit_loaded,
    loaded_plan,
    loaded_token_steps,
    log_weights,
    measure_serving_path,
    per_batch_const,
)
from batchpilot.runtime.executor import NoopExecutor
from batchpilot.sim.service import BUSY_EDGES, IDLE_EDGES_S, FrontEnd


@pytest.fixture(autouse=True)
def short_contention(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(serving_profile, "IDLE_S", 0.1)
    monkeypatch.setattr(serving_profile, "BUSY_S", 0.2)
    monkeypatch.setattr(serving_profile, "CYCLES", 2)


def _check(frontend: FrontEnd, details: dict[str, Any], requests: int, rounds: int) -> None:
    for name, value in frontend.to_dict().items():
        if name == "loaded_residuals":  # relative errors around the loaded line, sorted
            assert value == sorted(value) and all(math.isfinite(r) and r > -1 for r in value)
            continue
        if name == "loaded_idle_factors":  # one per idle bin, or none (too few loaded batches)
            assert len(value) in (0, len(IDLE_EDGES_S) + 1) and all(f > 0 for f in value)
            continue
        if name == "loaded_busy_factors":  # one per busy-share bin, or none
            assert len(value) in (0, len(BUSY_EDGES) + 1) and all(f > 0 for f in value)
            continue
        if name == "loaded_token_factors":  # (min tokens, factor) at the thread plan's steps, or none
            assert all(f > 0 for _, f in value) and [lo for lo, _ in value[:1]] in ([], [0])
            continue
        assert math.isfinite(value) and value >= 0.0, name
    assert frontend.serial_busy_factor >= 1.0
    assert details["requests"] == requests * rounds and details["ok"] == requests * rounds
    assert details["lengths"] == requests and details["rounds"] == rounds
    assert details["warmup_requests"] == serving_profile.WARMUP_REQUESTS
    assert details["tokenize_idle_samples"] >= 5 and details["tokenize_busy_samples"] >= 5
    fit = FrontEnd.from_dict(details["fit"])  # the bare two-stage fit
    assert (fit.batch_overhead_s, fit.serial_busy_factor) == (0.0, 1.0)
    assert (fit.serial_const_s, fit.delay_const_s) == (frontend.serial_const_s, frontend.delay_const_s)
    assert not any(t.name == "batchpilot-serving-profile" for t in threading.enumerate())  # shut down


@pytest.fixture(scope="module")
def ex() -> EncoderExecutor:
    executor = EncoderExecutor(EncoderConfig(device="cpu"))
    executor.warmup()
    return executor


def test_real_model_serving_path(ex: EncoderExecutor) -> None:
    frontend, details = measure_serving_path(ex, CostModel.default_cpu_minilm(), requests=4, rounds=1,
                                             loaded_requests=40)
    _check(frontend, details, 4, 1)
    assert details["min_tokens"] == 4 and details["max_tokens"] == ex.max_length
    assert details["padding"] == "none"  # MiniLM has the padding-free path: what `serve` would run
    assert details["policy"] == {"name": "hybrid", "max_wait_s": 0.0}
    assert frontend.delay_const_s + frontend.delay_per_token_s > 0  # HTTP and JSON are never free
    delay = details["loaded_delay"]  # the load generator's rows came back: the delay under load
    assert delay["requests"] == 40 and (delay["const_s"], delay["rate_coef_s"]) == (
        frontend.delay_loaded_s, frontend.delay_rate_coef_s)
    for key in ("median_client_s", "median_tokenize_s", "median_batcher_s", "median_predicted_s"):
        assert math.isfinite(details[key]) and details[key] > 0, key


def test_padding_is_passed_through(ex: EncoderExecutor) -> None:
    frontend, details = measure_serving_path(ex, CostModel.default_cpu_minilm(), requests=3, rounds=1,
                                             loaded_requests=0, padding="dynamic")
    assert details["padding"] == "dynamic"
    assert (frontend.loaded_alpha, frontend.loaded_const_s) == (1.0, 0.0)  # no loaded phase: the defaults


def test_any_executor_with_its_own_texts() -> None:
    """The no-op model: one token per word, so the texts are that many words; its cost model is its
    fixed delay, and the driver's overhead is what the batcher adds on top."""
    noop = NoopExecutor(delay_s=0.002, max_length=64)
    model = CostModel(latency_coef=(0.002, 0.0, 0.0, 0.0))
    frontend, details = measure_serving_path(noop, model, requests=5, rounds=2, seed=3, loaded_requests=30,
                                             texts_for_length=lambda lengths: [" ".join(["w"] * n)
                                                                               for n in lengths])
    _check(frontend, details, 5, 2)
    assert details["min_tokens"] == 4 and details["max_tokens"] == 64
    assert details["median_predicted_s"] == pytest.approx(0.002)
    # under load the no-op model still sleeps 2 ms a batch: its loaded time is about the profile's
    loaded = details["loaded"]
    assert loaded["batches"] >= 10 and 0.8 < loaded["slot_over_predicted"] < 3.0
    assert len(frontend.loaded_residuals) == loaded["batches"]
    from batchpilot.sim.service import step_factor

    assert frontend.batch_seconds(0.002) == pytest.approx(  # right behind another batch, of no tokens
        frontend.loaded_alpha * 0.002 * frontend.loaded_idle_factors[0]
        * step_factor(frontend.loaded_token_factors, 0.0) + frontend.loaded_const_s)
    assert [lo for lo, _ in frontend.loaded_token_factors] == [0, 32, 64, 128, 256, 512, 1024]
    assert len(loaded["measured"]) == loaded["batches"]  # what the line was fitted on, in the file
    # the CPU each request cost outside the model thread is accounted and reported, not a slope
    cpu = loaded["cpu"]
    assert cpu["requests"] == 30 and cpu["model_threads_cpu_s"] >= 0 and cpu["other_threads_cpu_s"] >= 0
    assert cpu["competing_cpu_s"] > 0.0
    assert frontend.loaded_rate_coef == 0.0 and loaded["competing_cpu_s"] == 0.0


def test_competing_cpu_is_every_thread_but_the_busiest_plus_a_sharing_load_generator() -> None:
    before = {1: 10.0, 2: 1.0, 3: 0.5}
    after = {1: 18.0, 2: 1.6, 3: 0.9, 4: 0.1}  # thread 4 started during the phase
    per, details = competing_cpu(before, after, child_cpu_s=2.0, child_shares_cores=False, requests=10)
    assert per == pytest.approx((0.6 + 0.4 + 0.1) / 10)
    assert details["model_threads_cpu_s"] == pytest.approx(8.0)
    two, _ = competing_cpu(before, after, 2.0, False, 10, model_threads=2)  # torch's worker is the model's
    assert two == pytest.approx((0.4 + 0.1) / 10)
    shared, _ = competing_cpu(before, after, child_cpu_s=2.0, child_shares_cores=True, requests=10)
    assert shared == pytest.approx((1.1 + 2.0) / 10)
    assert competing_cpu({}, {}, 1.0, True, 10)[0] == 0.0  # no /proc: not measured, no slope


def test_fit_loaded_recovers_the_speed_given_the_accounted_slope() -> None:
    model = CostModel(latency_coef=(0.01, 0.0, 0.001, 0.0))
    batches, c, alpha = [], 0.003, 1.7
    for k in range(40):
        start = 1.0 + 0.1 * k
        arrivals = [start - 0.05 * j for j in range(1 + k % 5)]  # 1-5 requests in the second before
        features = {"const": 1.0, "n": 1.0, "tokens": float(10 + k), "attn": float((10 + k) ** 2)}
        batches.append(Loaded(features, 0.0, start, arrivals))
    rates = []
    arr = sorted(a for b in batches for a in b.arrivals)
    for b in batches:
        rate = sum(1 for a in arr if b.start - 1.0 <= a < b.start)
        rates.append(rate)
        b.slot_s = model.latency(b.features) * alpha * (1 + c * rate)
    (a, coef, const), details = fit_loaded(batches, model, c)
    assert a == pytest.approx(alpha) and coef == pytest.approx(alpha * c)
    assert const == pytest.approx(0.0, abs=1e-9)  # proportional times: no fixed cost
    assert max(abs(r) for r in details["residuals"]) < 1e-8
    assert details["least_squares_s_per_request"] == pytest.approx(c)  # the comparison fit agrees here
    assert fit_loaded(batches[:5], model, c)[0] == (1.0, 0.0, 0.0)  # too few batches: the defaults


def test_fit_loaded_measures_a_fixed_cost_per_batch() -> None:
    """Every batch 1.5 ms beyond its price: a short batch 15% slower, a long one 1.5%; the fit finds
    the constant, not a speed between the two."""
    model = CostModel(latency_coef=(0.0, 0.0, 0.0001, 0.0))
    batches = []
    for k in range(60):
        tokens = 100.0 if k % 2 else 1000.0  # 10 ms and 100 ms by the cost model
        start = 1.0 + 0.5 * k
        batches.append(Loaded({"const": 1.0, "n": 1.0, "tokens": tokens, "attn": 0.0},
                              model.latency({"tokens": tokens}) + 0.0015, start, [start]))
    (alpha, _, const), details = fit_loaded(batches, model)
    assert const == pytest.approx(0.0015) and alpha == pytest.approx(1.0)
    assert details["const_s"] == const and max(abs(r) for r in details["residuals"]) < 1e-6
    base = np.array([0.01, 0.1] * 10)
    assert per_batch_const(base, 0.9 * base - 0.001) == 0.0  # short batches relatively faster: no constant


def test_the_delay_under_load_is_a_line_in_the_arrival_rate_through_the_segments_medians() -> None:
    """The loaded phase's requests: each segment's median excess over the lone delay against its
    median rate; 1 ms + 0.1 ms per request/s is found back, an outlier in a segment does not move it."""
    from batchpilot.profile.serving import fit_loaded_delay

    lone = FrontEnd(delay_const_s=0.002)
    rows, index, t = [], 0, 0.0
    for gap in (0.2, 0.05, 0.1, 0.2, 0.05, 0.1):  # 5, 20 and 10 requests/s
        for j in range(40):
            t += gap
            extra = 0.001 + 0.0001 / gap + (0.5 if j == 7 else 0.0)  # one request held up 0.5 s
            rows.append((float(index), t, 0.002 + 0.003 + 0.010 + extra, 0.003, 0.010, 50.0))
            index += 1
        t += 1.0
    const, coef, details = fit_loaded_delay(rows, lone, planned=240, segments=6)
    assert const == pytest.approx(0.001, abs=1e-4) and coef == pytest.approx(0.0001, rel=0.05)
    assert [s["requests"] for s in details["segments"]] == [40] * 6
    assert fit_loaded_delay(rows[:10], lone, 240, 6)[:2] == (0.0, 0.0)  # too few: not measured
    flat = [(i, t, 0.016, 0.003, 0.010, 50.0) for i, t, *_ in rows]  # 1 ms more at every rate
    assert fit_loaded_delay(flat, lone, 240, 6)[:2] == pytest.approx((0.001, 0.0))


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="requests must be >= 3"):
        measure_serving_path(NoopExecutor(), CostModel(), requests=2)
    with pytest.raises(ValueError, match="padding must be"):
        measure_serving_path(NoopExecutor(), CostModel(), padding="bucket")


def test_alternating_arrivals_switch_rates_by_segment_with_a_pause_between() -> None:
    import random

    times = alternating_arrivals(600, (0.01, 0.1), random.Random(1), segments=6, pause_s=5.0)
    assert len(times) == 600 and times == sorted(times)
    gaps = [b - a for a, b in zip([0.0, *times], times, strict=False)]
    seg = [gaps[k * 100 + 1:(k + 1) * 100] for k in range(6)]  # each segment's gaps, its first left out
    means = [sum(g) / len(g) for g in seg]
    assert all(m < 0.03 for m in means[0::2]) and all(m > 0.05 for m in means[1::2])
    assert all(gaps[k * 100] >= 5.0 for k in range(1, 6))  # the pause before every later segment
    three = alternating_arrivals(900, (0.01, 0.1, 0.03), random.Random(2), segments=6, pause_s=0.0)
    gaps = [b - a for a, b in zip([0.0, *three], three, strict=False)]
    means = [sum(gaps[k * 150:(k + 1) * 150]) / 150 for k in range(6)]
    assert [min((0.01, 0.1, 0.03), key=lambda g, m=m: abs(m - g)) for m in means] == [0.01, 0.1, 0.03] * 2


def test_fit_loaded_measures_how_much_slower_a_batch_runs_after_an_idle_server() -> None:
    from batchpilot.sim.service import idle_factor

    model = CostModel(latency_coef=(0.01, 0.0, 0.0, 0.0))
    feats = {"const": 1.0, "n": 1.0, "tokens": 8.0, "attn": 64.0}
    batches, t = [], 0.0
    for k in range(120):  # runs of 3 back-to-back batches (idle 0) after 0.5 s of idle
        t += 0.5 if k % 3 == 0 else 0.0
        took = 0.01 * (1.3 if k % 3 == 0 else 1.0) * 1.5  # alpha 1.5; 30% slower after idle
        batches.append(Loaded(feats, took, t, [t]))
        t += took
    (alpha, _, _), details = fit_loaded(batches, model)
    f = details["idle_factors"]
    assert len(f) == len(IDLE_EDGES_S) + 1 and details["idle_batches"][0] == 80
    assert details["idle_batches"][-1] == 40
    # per bin (took + 10 lines) / (its lines + 10 lines), the line the mean of 1.98 s over 120 batches:
    # 30% slower after idle, shrunk toward 1 by the 10 batches of prior
    line = 1.98 / 120
    after_idle = (40 * 0.0195 + 10 * line) / (50 * line)
    behind = (80 * 0.015 + 10 * line) / (90 * line)
    assert f[-1] / f[0] == pytest.approx(after_idle / behind) and 1.2 < f[-1] / f[0] < 1.3
    assert f[1] == f[2] == f[3] == f[4] and f[0] < f[1] < f[-1]  # empty bins: 1, before normalising
    line = [alpha * 0.01 * idle_factor(f, 0.0 if k % 3 else 1.0) for k in range(120)]
    assert sum(line) == pytest.approx(sum(b.slot_s for b in batches))  # the totals kept
    assert max(abs(r) for r in details["residuals"]) < 0.05  # without the factors: -9% and +18%


def test_a_load_generator_that_fails_is_an_error_that_says_so() -> None:
    """The child dies before it reports its CPU (here: an endpoint it does not know): a clear error."""
    from batchpilot.bench.loadgen import PlannedRequest
    from batchpilot.profile.serving import send_elsewhere

    plan = [PlannedRequest(0, 0.0, 4, 0, {"input": "x"})]
    with pytest.raises(RuntimeError, match="the load generator process exited with 1"):
        send_elsewhere("http://127.0.0.1:9", "m", plan, endpoint="no-such-endpoint")


def test_fit_loaded_prices_each_thread_count_of_the_plan_apart() -> None:
    """Batches of 2 threads (from 320 tokens) run 40% slower under load than their price, those of one
    thread at their price: one factor per step of the plan, the totals kept."""
    from batchpilot.sim.service import step_factor

    model = CostModel(latency_coef=(0.0, 0.0, 1e-4, 0.0))
    batches, t = [], 0.0
    for k in range(120):  # back to back: every batch in the same idle bin
        tokens = 100.0 if k % 2 else 400.0
        took = 1e-4 * tokens * (1.0 if k % 2 else 1.4)
        batches.append(Loaded({"const": 1.0, "n": 1.0, "tokens": tokens, "attn": 0.0}, took, t, [t]))
        t += took
    (alpha, _, _), details = fit_loaded(batches, model, token_steps=(0, 320))
    steps = tuple((int(lo), f) for lo, f in details["token_factors"])
    assert [lo for lo, _ in steps] == [0, 320] and details["token_batches"] == [60, 60]
    # per step (took + 10 lines) / (its lines + 10 lines), the lines scaled to the totals (x 1.32)
    long, short = 0.04 * 1.32, 0.01 * 1.32
    expected = ((60 * 0.056 + 10 * long) / (70 * long)) / ((60 * 0.01 + 10 * short) / (70 * short))
    assert steps[1][1] / steps[0][1] == pytest.approx(expected, rel=1e-3) and 1.25 < expected < 1.4
    priced = [alpha * 1e-4 * b.features["tokens"] * step_factor(steps, b.features["tokens"])
              * details["idle_factors"][0] for b in batches]
    # the totals kept (to the first batch, which came after idle and has the last bin's factor)
    assert sum(priced) == pytest.approx(sum(b.slot_s for b in batches), rel=1e-4)
    _, one = fit_loaded(batches, model)  # one count of threads: no token factors, a wider spread
    assert one["token_factors"] == [] and one["residual_std"] > details["residual_std"]


def test_the_loaded_token_steps_join_the_thread_plan_and_the_size_edges() -> None:
    from batchpilot.models.encoder import ThreadPlan

    class Ex:
        threads = ThreadPlan(((0, 1), (320, 2)))

    assert loaded_token_steps(Ex()) == [0, 32, 64, 128, 256, 320, 512, 1024]
    assert loaded_token_steps(object()) == [0, 32, 64, 128, 256, 512, 1024]  # no plan: the edges


def test_the_loaded_plan_spreads_its_lengths_evenly_on_a_log_scale() -> None:
    """The profile's lengths are evenly spaced (4 .. 512 tokens); picked by ``log_weights``, each doubling
    of length gets about the same share of the loaded requests, so short batches are measured too."""
    lengths = [int(round(x)) for x in np.linspace(4, 512, 24)]
    w = log_weights(lengths)
    assert sum(w) == pytest.approx(math.log(512 / 4))
    assert w[1] > w[2] > w[-2] > w[-1] > 0  # a longer length covers less of a doubling (the ends: half)
    assert log_weights([7]) == [pytest.approx(1e-3)] and log_weights([5, 5]) == [pytest.approx(1e-3)] * 2
    model = CostModel(latency_coef=(0.005, 0.0, 1e-5, 0.0))
    plan = loaded_plan([f"t{n}" for n in lengths], lengths, model, "none", 0, 7000)
    bins = [4, 8, 16, 32, 64, 128, 256, 513]
    share = np.histogram([p.input_tokens for p in plan], bins=bins)[0] / len(plan)
    # the lengths nearest each doubling: 4 alone up to ~10 tokens, then every ~22 tokens
    assert share[:2].sum() == pytest.approx(math.log(10.2 / 4) / math.log(128), abs=0.02)
    assert all(abs(s - 1 / 7) < 0.05 for s in share[4:])  # from 64 tokens on, a seventh each


def test_lone_requests_come_from_a_child_process_one_at_a_time_with_the_gap_between() -> None:
    """``profile.serving.lone_elsewhere`` against the real app on the no-op model: every request of the
    plan answered, in plan order, each sent no sooner than the gap after the previous answer."""
    from batchpilot.bench.loadgen import PlannedRequest
    from batchpilot.profile.serving import lone_elsewhere
    from batchpilot.server.app import ServedModel, create_app
    from batchpilot.server.config import ServerConfig
    from batchpilot.server.inproc_server import bound_socket, in_thread

    sock, port = bound_socket()
    app = create_app(ServerConfig(port=port), [ServedModel(NoopExecutor(delay_s=0.001, max_length=64))])
    plan = [PlannedRequest(k, 0.0, 3, 0, {"input": "a b c"}, warmup=k == 0) for k in range(6)]
    with in_thread(app, sock, "lone-test") as url:
        records = lone_elsewhere(url, app.state.service.model_name, plan, 0.05)
    assert [r.index for r in records] == list(range(6)) and all(r.ok for r in records)
    assert [r.warmup for r in records] == [True] + [False] * 5
    for before, after in zip(records, records[1:], strict=False):
        assert after.sent_s - before.done_s >= 0.05
    with pytest.raises(ValueError, match="gap between lone requests must be >= 0 s"):
        lone_elsewhere("http://127.0.0.1:9", "m", plan, -1.0)


def test_fit_loaded_measures_how_much_faster_a_batch_runs_after_a_busy_second() -> None:
    """Batches of one price, in dense stretches (back to back) and in sparse pairs 250 ms apart: a
    batch in the last busy bin runs 20% under its price, any other at it. The idle time cannot tell
    them apart (the second of a pair is right behind the first too); the busy factors, fitted with
    the idle factors, do."""
    from batchpilot.sim.service import (
        BUSY_EDGES,
        BusyWindow,
        busy_factor,
        busy_shares,
        idle_factor,
        idle_times,
    )

    model = CostModel(latency_coef=(0.01, 0.0, 0.0, 0.0))
    feats = {"const": 1.0, "n": 1.0, "tokens": 8.0, "attn": 64.0}
    batches, t, window = [], 0.0, BusyWindow()

    def run_one() -> float:
        took = 0.01 * (0.8 if window.share(t) >= BUSY_EDGES[-1] else 1.0)
        batches.append(Loaded(feats, took, t, [t]))
        window.add(t, t + took)
        return took

    for _ in range(4):
        for _ in range(20):  # sparse: pairs 250 ms apart
            t += run_one()
            t += run_one() + 0.25
        for _ in range(200):  # dense: back to back
            t += run_one()
        t += 0.25
    (alpha, _, _), details = fit_loaded(batches, model)
    f = details["busy_factors"]
    assert len(f) == len(BUSY_EDGES) + 1 and sum(details["busy_batches"]) == len(batches)
    assert details["busy_batches"][0] >= 100 and details["busy_batches"][-1] >= 400
    assert 0.78 < f[-1] / f[0] < 0.83  # 0.8, shrunk a little toward 1 by the prior
    starts, took = [b.start for b in batches], [b.slot_s for b in batches]
    line = [alpha * 0.01 * busy_factor(f, s) * idle_factor(details["idle_factors"], i)
            for s, i in zip(busy_shares(starts, took), idle_times(starts, took), strict=True)]
    assert sum(line) == pytest.approx(sum(took), rel=1e-6)  # the totals kept
    assert max(abs(r) for r in details["residuals"]) < 0.06  # without the busy factors: -20%
    _, sparse = fit_loaded(batches[:40], model)  # sparse only: every busy factor 1
    assert sparse["busy_factors"] == pytest.approx([1.0] * (len(BUSY_EDGES) + 1))


def test_the_delay_under_load_leaves_out_the_segments_past_one_slots_rate() -> None:
    """Segments at shares 0.3, 0.75 and 1.25 of one slot's rate: the two overloaded ones carry 5 ms
    more; the line goes through the other four and finds 1 ms + 0.1 ms per request/s back."""
    from batchpilot.profile.serving import fit_loaded_delay

    lone = FrontEnd(delay_const_s=0.002)
    rows, index, t = [], 0, 0.0
    for gap, over in ((0.2, 0.0), (0.05, 0.0), (0.04, 0.005)) * 2:
        for _ in range(40):
            t += gap
            rows.append((float(index), t, 0.002 + 0.013 + 0.001 + 0.0001 / gap + over, 0.003, 0.010, 50.0))
            index += 1
        t += 1.0
    const, coef, details = fit_loaded_delay(rows, lone, 240, 6, (0.3, 0.75, 1.25))
    assert const == pytest.approx(0.001, abs=1e-4) and coef == pytest.approx(0.0001, rel=0.05)
    assert [s["fitted"] for s in details["segments"]] == [True, True, False] * 2
    every = fit_loaded_delay(rows, lone, 240, 6)  # through every segment: pulled up at high rates
    assert every[0] + 20 * every[1] > 0.001 + 20 * 0.0001 + 0.001
