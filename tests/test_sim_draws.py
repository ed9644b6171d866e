"""The simulator's prediction over service-noise draws: medians, bands and the central draw."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchpilot.cli import main
from batchpilot.core.config import SchedulerConfig
from batchpilot.core.costmodel import CostModel
from batchpilot.sim.draws import draw_reports, encoder_draws
from batchpilot.sim.metrics import summarize
from batchpilot.sim.service import Noise, ServiceModel
from batchpilot.sim.target import draws_batch_times, simulate_encoder
from batchpilot.sim.traces import Workload


def _bursty(n: int = 400) -> Workload:
    rng = np.random.default_rng(3)
    gaps = np.where(rng.random(n) < 0.2, 0.001, 0.03)  # bursts of near-simultaneous requests
    return Workload.from_columns("bursty", np.cumsum(gaps).tolist(), rng.integers(8, 300, n).tolist())


def _noisy_service() -> ServiceModel:
    return ServiceModel(noise=Noise(residuals=(-0.3, -0.1, 0.0, 0.1, 0.5, 1.5)))


def test_draws_differ_only_by_the_noise_and_are_reproducible() -> None:
    wl, cm = _bursty(), CostModel.default_cpu_minilm()
    fe = _noisy_service()
    drawn = encoder_draws(wl, SchedulerConfig(), cm, 8, seed=5, service=fe)
    p99 = drawn.values("p99")
    assert len(drawn.reports) == 8 and np.unique(p99).size > 1  # the noise moves the tail
    again = encoder_draws(wl, SchedulerConfig(), cm, 8, seed=5, service=fe)
    assert np.array_equal(p99, again.values("p99"))  # seeded: the same draws again
    # draw i is exactly the simulation with seed 5 + i
    third = summarize(simulate_encoder(wl, SchedulerConfig(), cm, seed=7, service=fe))
    assert drawn.reports[2].latency["p99"] == third.latency["p99"]
    lo, hi = drawn.band("p99")
    assert p99.min() <= lo <= drawn.median("p99") <= hi <= p99.max()
    assert drawn.central.latency["p99"] == sorted(p99)[3]  # the lower middle of 8
    # every request is served in every draw: the failures' median is 0, its band 0 .. 0
    assert drawn.median("failed") == 0.0 and drawn.band("failed") == (0.0, 0.0)


def test_draws_differ_exactly_when_the_target_draws_batch_times() -> None:
    wl, cm = _bursty(100), CostModel.default_cpu_minilm()
    bare = CostModel(latency_coef=cm.latency_coef)  # no residuals of its own
    assert draws_batch_times(False, _noisy_service(), bare) and draws_batch_times(True, None, cm)
    assert not draws_batch_times(False, ServiceModel(), cm) and not draws_batch_times(True, None, bare)
    for noise, fe, model in ((False, ServiceModel(), cm), (True, None, bare), (True, None, cm)):
        drawn = encoder_draws(wl, SchedulerConfig(), model, 4, service=fe, noise=noise)
        assert (np.unique(drawn.values("p99")).size > 1) == draws_batch_times(noise, fe, model)


def test_the_fidelity_prediction_is_the_median_of_the_draws_with_their_band() -> None:
    from batchpilot.bench.fidelity import METRICS, predicted_bands, simulate

    wl, cm, fe = _bursty(), CostModel.default_cpu_minilm(), _noisy_service()
    pred = simulate(wl, SchedulerConfig(), cm, 1.0, fe, draws=6)
    drawn = encoder_draws(wl, SchedulerConfig(), cm, 6, service=fe)
    assert len(pred.drawn.reports) == 6
    assert pred.summary.p99 == drawn.median("p99") and pred.summary.p50 == drawn.median("p50")
    bands = predicted_bands(pred)
    assert set(bands) == set(METRICS)
    assert bands["P99 ms"] == [x * 1e3 for x in drawn.band("p99")] and bands["P99 ms"][0] < bands["P99 ms"][1]
    quiet = simulate(wl, SchedulerConfig(), cm, 1.0, ServiceModel(), draws=6)
    assert len(quiet.drawn.reports) == 1  # no noise: one draw


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(0.001, 10.0), min_size=1, max_size=30))
def test_median_and_band_are_order_statistics_of_the_draws(values: list[float]) -> None:
    base = summarize(simulate_encoder(Workload.from_columns("one", [0.0], [16])))
    reports = [type(base)(**{**base.__dict__, "latency": {**base.latency, "p99": v}}) for v in values]
    drawn = draw_reports(lambda s: reports[s], len(values))
    lo, hi = drawn.band("p99")
    assert drawn.median("p99") == pytest.approx(float(np.median(values)))
    assert min(values) <= lo <= drawn.median("p99") <= hi <= max(values)
    assert drawn.central.latency["p99"] in values
    with pytest.raises(ValueError, match="draws must be >= 1"):
        draw_reports(lambda s: base, 0)


def test_a_band_over_draws_that_refused_requests_is_inf_not_nan() -> None:
    base = summarize(simulate_encoder(Workload.from_columns("one", [0.0], [16])))
    values = [0.5, float("inf"), float("inf"), 0.7]  # P99 counting refusals: inf where a draw refused
    reports = [type(base)(**{**base.__dict__, "p99_all": v}) for v in values]
    with np.errstate(invalid="raise"):
        assert draw_reports(lambda s: reports[s], len(values)).band("p99_all") == (0.5, float("inf"))
        every = draw_reports(lambda s: reports[1], 3)
        assert every.band("p99_all") == (float("inf"), float("inf"))


def test_simulate_prints_the_band_over_draws(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    profile = tmp_path / "p.json"
    CostModel.default_cpu_minilm().save(profile)
    args = ["simulate", "--workload", "poisson:rate=40", "--requests", "300", "--profile", str(profile),
            "--noise"]
    assert main([*args, "--draws", "4"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # rich wraps long titles
    assert "the prediction over 4 noise draws" in out and "(draw of seed 0)" in out
    assert main([*args, "--draws", "4", "--json", str(tmp_path / "r.json")]) == 0
    doc = json.loads((tmp_path / "r.json").read_text())["draws"]
    assert doc["draws"] == 4 and doc["p99"]["band"][0] <= doc["p99"]["median"] <= doc["p99"]["band"][1]
    capsys.readouterr()
    assert main([*args, "--draws", "1"]) == 0 and "noise draws" not in capsys.readouterr().out
    assert main([*args, "--draws", "0"]) == 2
