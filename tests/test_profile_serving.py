"""The serving-path measurement (``profile/serving.py``): the real app served in-process, lone
requests over HTTP, the fitted ``ServiceModel`` and what it reports.

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
    batch_and_noise,
    fit_loaded,
    loaded_plan,
    loaded_token_steps,
    log_weights,
    measure_serving_path,
    per_batch_const,
    scheduler_config,
)
from batchpilot.runtime.executor import NoopExecutor
from batchpilot.sim.service import BatchCost, Noise, ServiceModel, step_factor


def _check(service: ServiceModel, details: dict[str, Any], requests: int, rounds: int) -> None:
    entries = service.to_dict()
    assert set(entries) == {"request", "batch", "noise"}
    for part, values in entries.items():
        for name, value in values.items():
            if name == "residuals":  # relative errors around the loaded line, sorted
                assert value == sorted(value) and all(math.isfinite(r) and r > -1 for r in value)
                continue
            if name == "token_factors":  # (min tokens, factor) at the loaded token steps, or none
                assert all(f > 0 for _, f in value) and [lo for lo, _ in value[:1]] in ([], [0])
                continue
            assert math.isfinite(value) and value >= 0.0, f"{part}.{name}"
    assert ServiceModel.from_dict(entries) == service
    assert details["requests"] == requests * rounds and details["ok"] == requests * rounds
    assert details["lengths"] == requests and details["rounds"] == rounds
    assert details["warmup_requests"] == serving_profile.WARMUP_REQUESTS
    assert "residuals" not in details["loaded"]  # written once, in the service model
    for key in ("median_client_s", "median_batcher_s", "median_slot_s", "median_predicted_s"):
        assert math.isfinite(details[key]) and details[key] > 0, key
    assert math.isfinite(details["median_overhead_s"])
    assert service.batch.overhead_s == pytest.approx(max(details["median_overhead_s"], 0.0))
    assert not any(t.name == "batchpilot-serving-profile" for t in threading.enumerate())  # shut down


@pytest.fixture(scope="module")
def ex() -> EncoderExecutor:
    executor = EncoderExecutor(EncoderConfig(device="cpu"))
    executor.warmup()
    return executor


def test_real_model_serving_path(ex: EncoderExecutor) -> None:
    service, details = measure_serving_path(ex, CostModel.default_cpu_minilm(), requests=4, rounds=1,
                                            loaded_requests=40)
    _check(service, details, 4, 1)
    assert details["min_tokens"] == 4 and details["max_tokens"] == ex.max_length
    assert details["padding"] == "none"  # MiniLM has the padding-free path: what `serve` would run
    assert details["policy"] == {"name": "hybrid", "max_wait_s": 0.0}
    request = service.request
    assert request.delay_const_s + request.delay_per_token_s > 0  # HTTP and JSON are never free
    for key in ("median_client_s", "median_tokenize_s", "median_batcher_s", "median_predicted_s"):
        assert math.isfinite(details[key]) and details[key] > 0, key


def test_padding_is_passed_through(ex: EncoderExecutor) -> None:
    service, details = measure_serving_path(ex, CostModel.default_cpu_minilm(), requests=3, rounds=1,
                                            loaded_requests=0, padding="dynamic")
    assert details["padding"] == "dynamic"
    assert (service.batch.alpha, service.batch.const_s) == (1.0, 0.0)  # no loaded phase: the defaults
    assert service.batch.token_factors == () and service.noise == Noise()
    assert details["loaded"]["batches"] == 0


def test_any_executor_with_its_own_texts() -> None:
    """The no-op model: one token per word, so the texts are that many words; its cost model is its
    fixed delay, and the driver's overhead is what the batcher adds on top."""
    noop = NoopExecutor(delay_s=0.002, max_length=64)
    model = CostModel(latency_coef=(0.002, 0.0, 0.0, 0.0))
    service, details = measure_serving_path(noop, model, requests=5, rounds=2, seed=3, loaded_requests=30,
                                            texts_for_length=lambda lengths: [" ".join(["w"] * n)
                                                                              for n in lengths])
    _check(service, details, 5, 2)
    assert details["min_tokens"] == 4 and details["max_tokens"] == 64
    assert details["median_predicted_s"] == pytest.approx(0.002)
    # under load the no-op model still sleeps 2 ms a batch: its loaded time is about the profile's
    loaded = details["loaded"]
    assert loaded["batches"] >= 10 and 0.8 < loaded["slot_over_predicted"] < 3.0
    assert len(service.noise.residuals) == loaded["batches"]
    batch = service.batch
    assert batch.seconds(0.002) == pytest.approx(  # a batch of no tokens
        batch.alpha * 0.002 * step_factor(batch.token_factors, 0.0) + batch.const_s)
    assert [lo for lo, _ in batch.token_factors] == [0, 32, 64, 128, 256, 512, 1024]
    assert len(loaded["measured"]) == loaded["batches"]  # what the line was fitted on, in the file
    assert (batch.alpha, batch.const_s) == (loaded["alpha"], loaded["const_s"])


def test_fit_loaded_recovers_the_speed_of_proportional_times() -> None:
    model = CostModel(latency_coef=(0.01, 0.0, 0.001, 0.0))
    batches, alpha = [], 1.7
    for k in range(40):
        start = 1.0 + 0.1 * k
        features = {"const": 1.0, "n": 1.0, "tokens": float(10 + k), "attn": float((10 + k) ** 2)}
        batches.append(Loaded(features, model.latency(features) * alpha, start, [start - 0.01]))
    (a, const), details = fit_loaded(list(reversed(batches)), model)
    assert a == pytest.approx(alpha)
    assert const == pytest.approx(0.0, abs=1e-9)  # proportional times: no fixed cost
    assert max(abs(r) for r in details["residuals"]) < 1e-8
    assert details["token_factors"] == [] and details["slot_over_predicted"] == pytest.approx(alpha)
    assert [m["start"] for m in details["measured"]] == [b.start for b in batches]  # in start order
    assert fit_loaded(batches[:5], model)[0] == (1.0, 0.0)  # too few batches: the defaults
    assert "residuals" not in fit_loaded(batches[:5], model)[1]


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
    (alpha, const), details = fit_loaded(batches, model)
    assert const == pytest.approx(0.0015) and alpha == pytest.approx(1.0)
    assert details["const_s"] == const and max(abs(r) for r in details["residuals"]) < 1e-6
    base = np.array([0.01, 0.1] * 10)
    assert per_batch_const(base, 0.9 * base - 0.001) == 0.0  # short batches relatively faster: no constant


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
    model = CostModel(latency_coef=(0.0, 0.0, 1e-4, 0.0))
    batches, t = [], 0.0
    for k in range(120):
        tokens = 100.0 if k % 2 else 400.0
        took = 1e-4 * tokens * (1.0 if k % 2 else 1.4)
        batches.append(Loaded({"const": 1.0, "n": 1.0, "tokens": tokens, "attn": 0.0}, took, t, [t]))
        t += took
    (alpha, const), details = fit_loaded(batches, model, token_steps=(0, 320))
    steps = tuple((int(lo), f) for lo, f in details["token_factors"])
    assert [lo for lo, _ in steps] == [0, 320] and details["token_batches"] == [60, 60]
    # per step (took + 10 lines) / (its lines + 10 lines), the lines scaled to the totals (x 1.32)
    long, short = 0.04 * 1.32, 0.01 * 1.32
    expected = ((60 * 0.056 + 10 * long) / (70 * long)) / ((60 * 0.01 + 10 * short) / (70 * short))
    assert steps[1][1] / steps[0][1] == pytest.approx(expected, rel=1e-3) and 1.25 < expected < 1.4
    assert const == 0.0  # the long batches' extra is a factor, not a constant
    priced = [alpha * 1e-4 * b.features["tokens"] * step_factor(steps, b.features["tokens"]) for b in batches]
    assert sum(priced) == pytest.approx(sum(b.slot_s for b in batches), rel=1e-9)  # the totals kept
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


def test_batch_and_noise_make_the_service_model_s_batch_and_noise_of_the_loaded_fit() -> None:
    """Batches of four sizes with a fixed cost and a token factor: ``BatchCost.seconds`` of the fitted
    model times one plus the batch's residual is each batch's measured time again."""
    model = CostModel(latency_coef=(0.0, 0.0, 1e-4, 0.0))
    rng = np.random.default_rng(1)
    batches = []
    for k in range(80):
        tokens = [50.0, 100.0, 400.0, 800.0][k % 4]
        took = (1e-4 * tokens * (0.8 if tokens >= 320 else 1.0) * 1.2 + 0.003) * (1 + rng.normal(0, 0.02))
        features = {"const": 1.0, "n": 1.0, "tokens": tokens, "attn": 0.0}
        batches.append(Loaded(features, took, 0.1 * k, [0.1 * k]))
    loaded, details = fit_loaded(batches, model, token_steps=(0, 320))
    residuals = details["residuals"]
    batch, noise = batch_and_noise(loaded, details, 0.0007)
    assert "residuals" not in details  # taken out: written once, in the service model
    assert (batch.alpha, batch.const_s) == loaded and batch.overhead_s == 0.0007
    assert batch.const_s > 0 and batch.token_factors == tuple((lo, f) for lo, f in details["token_factors"])
    assert noise == Noise(residuals=tuple(residuals)) and len(noise.residuals) == 80
    again = sorted(b.slot_s / batch.seconds(model.latency(b.features), b.features["tokens"]) - 1.0
                   for b in batches)
    assert again == pytest.approx(list(noise.residuals), abs=1e-12)
    # not measured (too few batches): the driver's overhead alone
    assert batch_and_noise(*fit_loaded(batches[:3], model), 0.0007) == (BatchCost(overhead_s=0.0007), Noise())
    assert batch_and_noise((1.0, 0.0), {}, 0.0) == (BatchCost(), Noise())


def test_the_profile_serves_the_deployment_serve_resolves() -> None:
    ex = NoopExecutor()
    cheap = CostModel(latency_coef=(0.01, 0.0, 0.0, 0.0), meta={"prepare_share": 0.001})
    costly = CostModel(latency_coef=(0.01, 0.0, 0.0, 0.0), meta={"prepare_share": 0.2})
    assert scheduler_config(ex, "none", cheap).pipeline == "off"  # collation too cheap to pipeline
    on = scheduler_config(ex, "none", costly)
    assert on.pipeline == "on" and on.pipeline_lead_s > 0
    assert on.policy.max_wait_s == 0.0 and on.planner.padding == "none"
    assert on.admission.timeout_s > 0  # the server's request timeout, as serve resolves it
