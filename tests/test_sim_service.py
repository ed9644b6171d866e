"""The simulator's service model (``sim.service``): the fits, the request cost (its line and its fit from
one-at-a-time measurements), the batch cost, the noise, the ablation's terms, and what they do to a
simulated run."""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from batchpilot.core.config import PolicyConfig, SchedulerConfig
from batchpilot.core.costmodel import CostModel
from batchpilot.sim.metrics import summarize
from batchpilot.sim.service import (
    POOL,
    BatchCost,
    BatchNoise,
    Noise,
    RequestCost,
    ServiceModel,
    binned_factors,
    fit_line,
    step_factor,
)
from batchpilot.sim.target import draws_batch_times, simulate_encoder
from batchpilot.sim.traces import Workload


def _workload(arrivals: list[float], tokens: list[int]) -> Workload:
    return Workload.from_columns("t", arrivals, tokens)


def _one_at_a_time(**policy: Any) -> SchedulerConfig:
    return SchedulerConfig(policy=PolicyConfig(name="window", max_batch_size=1, max_wait_s=0.0, **policy))


# -- The fits --------------------------------------------------------------------------------------

def test_fit_line_recovers_a_line_and_falls_back_on_a_negative_term() -> None:
    x = np.arange(1.0, 11.0)
    assert fit_line(x, 2.0 + 3.0 * x) == pytest.approx((2.0, 3.0))
    falling = 20.0 - x  # a negative slope is noise: flat at the median (trimmed) or the mean
    assert fit_line(x, falling) == (pytest.approx(float(np.median(falling))), 0.0)
    assert fit_line(x, falling, trim=False) == (pytest.approx(float(np.mean(falling))), 0.0)
    # a negative intercept: through the origin instead
    assert fit_line(x, -1.0 + 2.0 * x) == (0.0, pytest.approx(float(np.dot(x, 2 * x - 1) / np.dot(x, x))))
    assert fit_line(np.full(5, 3.0), np.arange(5.0)) == (2.0, 0.0)  # one x: no slope to see
    with_hiccup = 2.0 + 3.0 * x
    with_hiccup[4] += 50.0  # the trimmed fit leaves the worst residual out
    assert fit_line(x, with_hiccup) == pytest.approx((2.0, 3.0))


def test_binned_factors_shrink_toward_one_and_keep_the_line_s_total() -> None:
    index = np.array([0, 0, 1])
    took, line = np.array([2.0, 2.0, 1.0]), np.array([1.0, 1.0, 1.0])
    factors, counts = binned_factors(index, 3, took, line, prior=1.0)
    assert counts == [2, 1, 0]
    # before normalising: (4 + 1) / (2 + 1), (1 + 1) / (1 + 1) and the empty bin's exact 1
    assert factors[0] / factors[1] == pytest.approx(5 / 3) and factors[2] == factors[1]
    assert float(np.sum(line * np.asarray(factors)[index])) == pytest.approx(float(line.sum()))


def test_step_factor_is_the_factor_of_the_last_step_not_above() -> None:
    steps = ((0, 0.9), (320, 1.3))
    assert [step_factor(steps, t) for t in (0, 319, 320, 5000)] == [0.9, 0.9, 1.3, 1.3]
    assert step_factor((), 100) == 1.0


# -- RequestCost -----------------------------------------------------------------------------------

def test_fit_recovers_the_delay_from_noisy_sequential_requests() -> None:
    rng = np.random.default_rng(0)
    tok = rng.integers(4, 400, size=200).astype(float)
    tokenize = 0.4e-3 + 2e-6 * tok + rng.normal(0, 2e-5, tok.size)  # inside the delay
    batcher = 0.01 + 1e-4 * tok
    rest = 3e-3 + 5e-6 * tok + rng.normal(0, 5e-5, tok.size)
    rest[::40] += 0.05  # scheduler hiccups: the trimmed fit must ignore them
    request = RequestCost.fit(tok, tokenize + batcher + rest, batcher)
    assert request.delay_const_s == pytest.approx(3.4e-3, rel=0.1)
    assert request.delay_per_token_s == pytest.approx(7e-6, rel=0.1)
    np.testing.assert_allclose(request.delay(tok), request.delay_const_s + request.delay_per_token_s * tok)
    assert request.mean_s(tok) == pytest.approx(float(np.mean(request.delay(tok))))
    assert request.mean_s(np.array([])) == 0.0


def test_fit_clamps_noise_to_non_negative_and_refuses_missing_timing() -> None:
    tok = np.array([10.0, 100.0, 200.0, 300.0])
    falling = np.array([4e-3, 3e-3, 2e-3, 1e-3])  # a negative slope is noise: median, flat
    request = RequestCost.fit(tok, falling + 0.01, np.full(4, 0.01))
    assert request.delay_per_token_s == 0.0 and request.delay_const_s == pytest.approx(2.5e-3)
    with pytest.raises(ValueError, match="Server-Timing"):
        RequestCost.fit(tok, tok, np.full(4, math.nan))
    nan_rows = RequestCost.fit(np.append(tok, math.nan), np.append(falling + 0.01, 1.0), np.full(5, 0.01))
    assert nan_rows == request  # a row with a NaN is skipped
    for name in ("delay_const_s", "delay_per_token_s"):
        for bad in (-1.0, math.inf, math.nan):
            with pytest.raises(ValueError, match=name):
                RequestCost(**{name: bad})
    assert ServiceModel.from_dict(ServiceModel(request=request).to_dict()).request == request


def test_delay_adds_to_latency_and_leaves_the_batcher_alone() -> None:
    wl = _workload([0.0, 0.5, 1.0, 1.5], [32, 64, 128, 256])
    cfg = SchedulerConfig(policy=PolicyConfig(name="static", max_batch_size=1))
    cm = CostModel(latency_coef=(0.1, 0.0, 0.0, 0.0))
    base = simulate_encoder(wl, cfg, cm)
    request = RequestCost(delay_const_s=0.002, delay_per_token_s=1e-5)
    run = simulate_encoder(wl, cfg, cm, service=ServiceModel(request=request))
    np.testing.assert_allclose(np.array(run.record.finish_s) - np.array(base.record.finish_s),
                               request.delay(wl.input_tokens))
    assert run.record.dispatch_s == base.record.dispatch_s
    assert run.record.b_duration == base.record.b_duration
    assert summarize(run).queue["mean"] == pytest.approx(summarize(base).queue["mean"])


# -- BatchCost -------------------------------------------------------------------------------------

def test_batch_fields_are_validated_and_default_when_absent() -> None:
    service = ServiceModel(RequestCost(delay_const_s=1e-3),
                           BatchCost(alpha=1.2, const_s=1e-4, overhead_s=2e-4))
    assert ServiceModel.from_dict(service.to_dict()) == service
    back = ServiceModel.from_dict({"request": {"delay_const_s": 1e-3}})  # a dict without the batch part
    assert back.batch == BatchCost() and back.noise == Noise()
    assert back.request == RequestCost(delay_const_s=1e-3)
    assert ServiceModel.from_dict({}) == ServiceModel()
    for name in ("alpha", "const_s", "overhead_s"):
        for bad in (-1e-3, math.inf, math.nan):
            with pytest.raises(ValueError, match=name):
                BatchCost(**{name: bad})


def test_the_batch_line_is_price_times_alpha_and_token_factor_plus_const() -> None:
    batch = BatchCost(alpha=2.0, const_s=0.001, token_factors=((0, 0.9), (320, 1.3)), overhead_s=0.5)
    assert batch.seconds(0.01) == pytest.approx(0.01 * 2.0 * 0.9 + 0.001)  # no tokens: the first step
    assert batch.seconds(0.01, 400) == pytest.approx(0.01 * 2.0 * 1.3 + 0.001)  # the overhead is not in it
    assert BatchCost().seconds(0.01, 400) == 0.01


def test_token_factors_price_a_batch_by_the_step_of_its_tokens() -> None:
    steps = ((0, 0.9), (320, 1.3))
    service = ServiceModel(batch=BatchCost(token_factors=steps))
    assert ServiceModel.from_dict(service.to_dict()) == service
    assert ServiceModel.from_dict({}).batch.token_factors == ()
    assert service.batch.seconds(0.01, 100) == pytest.approx(0.009)
    assert service.batch.seconds(0.01, 400) == pytest.approx(0.013)
    for bad in (((10, 1.0),), ((0, 1.0), (0, 1.2)), ((0, 1.0), (320, 0.0)), ((0, math.nan),)):
        with pytest.raises(ValueError, match="token_factors"):
            BatchCost(token_factors=bad)
    cm = CostModel(latency_coef=(0.01, 0.0, 0.0, 0.0))
    run = simulate_encoder(_workload([0.0, 1.0, 2.0], [100, 400, 319]), _one_at_a_time(), cm, service=service)
    assert run.record.b_duration == pytest.approx([0.009, 0.013, 0.009])


@pytest.mark.parametrize("pipeline", ["off", "on"])
def test_the_simulator_adds_the_overhead_to_every_batch(pipeline: str) -> None:
    # a burst of 7 at t=0 in batches of at most 3, then one request after idling: every batch, right
    # behind another, pipelined or after an idle slot, takes its line plus the driver's overhead
    workload = Workload.from_columns("t", [0.0] * 7 + [5.0], [16] * 8)
    cm = CostModel(latency_coef=(0.010, 0.0, 0.0, 0.0))
    cfg = SchedulerConfig(policy=PolicyConfig(name="window", max_batch_size=3, max_wait_s=0.0),
                          pipeline=pipeline)  # type: ignore[arg-type]
    service = ServiceModel(batch=BatchCost(alpha=1.5, const_s=0.002, overhead_s=0.001))
    run = simulate_encoder(workload, cfg, cm, service=service)
    order = np.argsort(run.record.b_start, kind="stable")
    assert list(np.asarray(run.record.b_size)[order]) == [3, 3, 1, 1]
    assert list(np.asarray(run.record.b_duration)[order]) == pytest.approx([0.015 + 0.002 + 0.001] * 4)


# -- Noise -----------------------------------------------------------------------------------------

def test_noise_residuals_round_trip_and_set_the_simulated_spread() -> None:
    service = ServiceModel(batch=BatchCost(alpha=2.0, const_s=0.001), noise=Noise(residuals=(0.5, -0.5, 0.0)))
    assert service.noise.residuals == (-0.5, 0.0, 0.5)
    assert ServiceModel.from_dict(service.to_dict()) == service
    assert service.batch.seconds(0.01) == pytest.approx(0.021)
    for bad in ((-1.5,), (-1.0,), (math.nan,), (math.inf,)):
        with pytest.raises(ValueError, match="residuals"):
            Noise(residuals=bad)
    # every simulated batch: (alpha x cost model + const) x (1 + a drawn residual), seeded
    cm = CostModel(latency_coef=(0.01, 0.0, 0.0, 0.0))
    wl = Workload.from_columns("r", [i * 1.0 for i in range(40)], [8] * 40)
    run = simulate_encoder(wl, _one_at_a_time(), cm, service=service, seed=3)
    durations = sorted(set(round(d, 6) for d in run.record.b_duration))
    assert durations == pytest.approx([0.0105, 0.021, 0.0315])
    again = simulate_encoder(wl, _one_at_a_time(), cm, service=service, seed=3)
    assert again.record.b_duration == run.record.b_duration
    # the driver's overhead is added after the draw: it does not scatter
    with_overhead = ServiceModel(batch=BatchCost(alpha=2.0, const_s=0.001, overhead_s=0.002),
                                 noise=service.noise)
    shifted = simulate_encoder(wl, _one_at_a_time(), cm, service=with_overhead, seed=3)
    assert np.asarray(shifted.record.b_duration) == pytest.approx(np.asarray(run.record.b_duration) + 0.002)


def test_batch_noise_draws_one_relative_residual_per_batch_seeded() -> None:
    res = (-0.2, 0.0, 0.3)
    noise = BatchNoise(res, seed=7)
    u = np.random.default_rng(7).random(POOL).tolist()
    for _ in range(50):
        want = 2.0 * (1.0 + res[min(int(u.pop() * 3), 2)])
        assert noise.draw(2.0) == pytest.approx(want)
    assert BatchNoise((), seed=7).draw(0.25) == 0.25  # nothing to draw: the line
    assert BatchNoise((-5.0,), seed=0).draw(1.0) == 0.0  # never below 0
    a, b = BatchNoise(res, seed=1), BatchNoise(res, seed=1)
    assert [a.draw(1.0) for _ in range(POOL + 10)] == [b.draw(1.0) for _ in range(POOL + 10)]  # refills too
    assert Noise().sampler(3) is None
    sampler = Noise(res).sampler(7)
    assert sampler is not None and sampler.draw(2.0) == BatchNoise(sorted(res), seed=7).draw(2.0)


def test_the_simulator_draws_the_service_noise_else_the_cost_model_s_own() -> None:
    cm = CostModel(latency_coef=(0.01, 0.0, 0.0, 0.0), rel_residuals=(-0.1, 0.1))
    plain = CostModel(latency_coef=(0.01, 0.0, 0.0, 0.0))
    drawn = ServiceModel(noise=Noise(residuals=(0.5,)))
    assert drawn.draws_batch_times and not ServiceModel().draws_batch_times
    assert draws_batch_times(False, drawn, plain)
    assert not draws_batch_times(False, ServiceModel(), cm) and not draws_batch_times(True, None, plain)
    assert draws_batch_times(True, ServiceModel(), cm) and draws_batch_times(True, None, cm)
    wl = Workload.from_columns("r", [i * 1.0 for i in range(20)], [8] * 20)
    # the service's residuals, not the cost model's, with or without ``noise``
    for noise in (False, True):
        run = simulate_encoder(wl, _one_at_a_time(), cm, service=drawn, noise=noise, seed=1)
        assert run.record.b_duration == pytest.approx([0.015] * 20)
    # without the service's residuals, ``noise`` draws the cost model's
    run = simulate_encoder(wl, _one_at_a_time(), cm, service=ServiceModel(), noise=True, seed=1)
    assert set(round(d, 6) for d in run.record.b_duration) == {0.009, 0.011}
    quiet = simulate_encoder(wl, _one_at_a_time(), cm, service=ServiceModel(), noise=False, seed=1)
    assert quiet.record.b_duration == pytest.approx([0.01] * 20)


# -- ServiceModel: the profile's entry, the ablation's terms ----------------------------------------

def test_from_profile_reads_the_service_entry(tmp_path: Path) -> None:
    service = ServiceModel(RequestCost(delay_const_s=2e-3, delay_per_token_s=1e-6),
                           BatchCost(alpha=1.1, token_factors=((0, 1.0), (64, 1.2)), overhead_s=3e-4),
                           Noise(residuals=(0.1, -0.05)))
    with_service = tmp_path / "with.json"
    with_service.write_text(json.dumps({"cost_model": {}, "service": service.to_dict()}))
    assert ServiceModel.from_profile(with_service) == service
    without = tmp_path / "without.json"
    without.write_text(json.dumps({"cost_model": {}, "points": []}))
    assert ServiceModel.from_profile(str(without)) is None
    old = tmp_path / "old.json"  # the flat "frontend" entry of an older version: refused, not misread
    flat = {"serial_const_s": 1e-3, "batch_overhead_s": 3e-4}
    old.write_text(json.dumps({"cost_model": {}, "frontend": flat}))
    with pytest.raises(ValueError, match="run `batchpilot profile` again"):
        ServiceModel.from_profile(old)


def test_a_service_model_with_unknown_fields_is_refused_with_what_to_do() -> None:
    with pytest.raises(ValueError, match="unknown fields batch.cold_s.*run `batchpilot profile` again"):
        ServiceModel.from_dict({"batch": {"alpha": 1.2, "cold_s": 0.001}})
    # the fields the ablation removed: a profile written before it is refused, not half read
    for part, name in (("request", "serial_const_s"), ("request", "delay_rate_coef_s"),
                       ("batch", "idle_factors"), ("batch", "gap_s"), ("noise", "wander"),
                       ("noise", "ref_s")):
        with pytest.raises(ValueError, match=f"unknown fields {part}.{name}"):
            ServiceModel.from_dict({part: {name: 0.0}})
    with pytest.raises(ValueError, match="unknown fields frontend"):
        ServiceModel.from_dict({"frontend": {}})


def _fields(model: ServiceModel) -> dict[tuple[str, str], Any]:
    return {(part, name): value for part in ("request", "batch", "noise")
            for name, value in asdict(getattr(model, part)).items()}


def test_without_a_term_changes_exactly_that_term_s_fields() -> None:
    assert list(ServiceModel.TERMS) == ["request delay", "loaded line", "token factors", "batch overhead",
                                        "residuals"]
    full = ServiceModel(RequestCost(delay_const_s=2e-3, delay_per_token_s=1e-6),
                        BatchCost(alpha=1.3, const_s=1e-3, token_factors=((0, 0.9), (320, 1.2)),
                                  overhead_s=3e-4),
                        Noise(residuals=(-0.1, 0.2)))
    before = _fields(full)
    covered: set[tuple[str, str]] = set()
    for term, (part, values) in ServiceModel.TERMS.items():
        after = _fields(full.without(term))
        changed = {key for key in before if after[key] != before[key]}
        assert changed == {(part, name) for name in values}, term
        assert all(after[(part, name)] == value for name, value in values.items()), term
        assert full.without(term).without(term) == full.without(term)
        covered |= changed
    assert covered == set(before)  # every fitted field belongs to a term
    assert not full.without("residuals").draws_batch_times
    with pytest.raises(KeyError):
        full.without("serial stage")
