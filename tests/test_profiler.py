"""The profiler against the real MiniLM on tiny grids, the CPU memory measurement, and the CLI.

No wall-clock assertions (the machine is shared): only shapes, counts, signs and orderings that hold
however slow the cores are.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
import statistics
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from batchpilot import cli
from batchpilot.core.costmodel import BatchShape, CostModel
from batchpilot.models.device import peak_memory_bytes
from batchpilot.models.encoder import PROBE_SHAPES, EncoderConfig, EncoderExecutor, ThreadPlan
from batchpilot.models.profiler import (
    MIX_SPREAD,
    Measurement,
    grid_lengths,
    leave_one_out,
    profile_encoder,
    profile_grid,
)
from batchpilot.sim.service import ServiceModel


@pytest.fixture(scope="module")
def ex() -> EncoderExecutor:
    return EncoderExecutor(EncoderConfig(device="cpu"))


def test_profile_encoder_fits_a_cost_model(ex: EncoderExecutor) -> None:
    model, points = profile_encoder(ex, batch_sizes=(1, 2), lengths=(8, 32), repeats=1, progress=False)
    assert len(points) == 4
    # the grid's lengths, drawn as the profile draws them (seed 0: lengths from random.Random(1)),
    # cheapest shape first; padded to the longest
    rng = random.Random(1)
    widths = [(n, max(grid_lengths(n, L, ex.max_length, rng))) for n, L in ((1, 8), (2, 8), (1, 32), (2, 32))]
    assert sorted((p.features["n"], p.features["tokens"]) for p in points) == sorted(
        (n, n * w) for n, w in widths)
    assert all(p.latency_s > 0 for p in points)
    assert all(c >= 0 and math.isfinite(c) for c in model.latency_coef)
    assert model.latency(BatchShape.padded([20, 30], 30)) > 0
    by_tokens = {p.features["tokens"]: p.memory_bytes for p in points}
    assert 0 < by_tokens[min(by_tokens)] < by_tokens[max(by_tokens)]  # activations grow with the tokens
    assert model.meta["model"] == "all-MiniLM-L6-v2" and model.meta["padding"] == "dynamic"


@given(st.integers(1, 64), st.integers(3, 600), st.integers(0, 2**32))
def test_grid_lengths_draw_within_the_spread(n: int, length: int, seed: int) -> None:
    limit = 512
    length = min(length, limit)
    lens = grid_lengths(n, length, limit, random.Random(seed))
    assert len(lens) == n and lens == sorted(lens) and all(3 <= x <= limit for x in lens)
    assert min(lens) >= min(max(round(length * (1 - MIX_SPREAD)), 3), limit)
    assert max(lens) <= max(round(length * (1 + MIX_SPREAD)), 3)
    assert grid_lengths(n, length, limit, random.Random(seed)) == lens  # seeded: the same grid again


def test_padding_free_profile_uses_ragged_features(ex: EncoderExecutor) -> None:
    _, points = profile_grid(ex, (1, 2), (8, 16), 1, None, "none", False, False, 0)
    assert [m.padding for m in points] == ["none"] * 4
    assert all(m.features == BatchShape.ragged(m.lengths).features() for m in points)
    assert all(m.lengths == sorted(m.lengths) for m in points)
    assert [m.lengths for m in points if m.n == 2] != [[8, 8], [16, 16]]  # drawn: live lengths differ
    assert all(m.memory_bytes == 0 for m in points)  # memory=False skips the profiled run


def test_budget_keeps_the_minimum_and_skips_the_rest(ex: EncoderExecutor) -> None:
    _, points = profile_encoder(ex, batch_sizes=(1, 2, 3), lengths=(8, 16), repeats=1, budget_s=0.0,
                                memory=False, progress=False)
    # four points are the minimum to fit four coefficients; cheapest (fewest tokens) first
    # 1x8, 1x16, 2x8, 3x8: the shapes of the fewest tokens n x L (each padded to its longest drawn input)
    assert sorted(p.features["n"] for p in points) == [1, 1, 2, 3]
    assert sorted(p.features["tokens"] for p in points if p.features["n"] == 1)[1] >= 12  # the 1x16
    _, capped = profile_grid(ex, (1, 2, 3), (8, 16), 1, None, "dynamic", False, False, 0, max_batch_tokens=24)
    assert sorted(m.n for m in capped) == [1, 1, 2, 3]  # 2x16 and 3x16 (over 24 tokens) left out


def test_bad_arguments_say_what_to_change(ex: EncoderExecutor) -> None:
    with pytest.raises(ValueError, match="repeats must be >= 1"):
        profile_encoder(ex, (1, 2), (8, 16), repeats=0)
    with pytest.raises(ValueError, match="give at least 4"):
        profile_encoder(ex, (1,), (8, 16), repeats=1)


def test_cpu_peak_memory_counts_live_tensor_bytes() -> None:
    def work() -> None:
        a = torch.empty(1_000_000, dtype=torch.uint8)
        b = torch.empty(2_000_000, dtype=torch.uint8)  # peak here: 3 MB live
        del a, b
        c = torch.empty(500_000, dtype=torch.uint8)
        del c

    peak = peak_memory_bytes(work, torch.device("cpu"))
    assert 3_000_000 <= peak < 3_100_000


def test_leave_one_out_is_exact_on_linear_data() -> None:
    truth = CostModel(latency_coef=(0.02, 0.001, 2e-4, 1e-7))
    pts = []
    for n in (1, 4, 16):
        for length in (16, 128, 512):
            shape = BatchShape.padded([length] * n, length)
            pts.append(Measurement(n, [length] * n, length, "dynamic", truth.latency(shape), 0.0, [], 0.0,
                                   shape.features()))
    assert max(abs(e) for e in leave_one_out([m.point() for m in pts])) < 1e-6
    pts[0].latency_s *= 2  # one bad point shows up in its own held-out error
    assert abs(leave_one_out([m.point() for m in pts])[0]) > 0.3


def test_cli_writes_a_profile_the_server_can_load(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "profile.json"
    rc = cli.main(["profile", "-o", str(out), "--device", "cpu", "--batch-sizes", "1", "2", "--lengths", "8",
                   "16", "24", "--repeats", "1", "--holdout", "2", "--serving-requests", "3",
                   "--loaded-requests", "30"])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert set(doc) == {"cost_model", "points", "holdout", "meta", "service", "serving_path"}
    assert len(doc["points"]) == 6 and len(doc["holdout"]) == 2
    service = ServiceModel.from_profile(out)  # the serving path, measured on the real app in-process
    assert service is not None and service.request.delay_const_s > 0
    assert all(math.isfinite(v) and v >= 0 for v in dataclasses.asdict(service.request).values())
    assert all(r > -1 for r in service.noise.residuals)
    batch = service.batch
    assert batch.alpha > 0 and batch.token_factors and all(f > 0 for _, f in batch.token_factors)
    assert doc["serving_path"]["requests"] == 2 * 3 and doc["serving_path"]["padding"] == "dynamic"
    prepare = doc["cost_model"]["meta"]["prepare_s"]  # the median collation time of the grid's batches
    assert prepare == pytest.approx(statistics.median(p["prepare_s"] for p in doc["points"]))
    assert all(p["memory_bytes"] > 0 for p in doc["points"])
    meta = doc["meta"]
    assert meta["model"] == "all-MiniLM-L6-v2" and meta["torch"] == torch.__version__
    assert meta["threads"] >= 1 and meta["date"].startswith("20")
    plan = ThreadPlan.from_json(doc["cost_model"]["meta"]["thread_plan"])  # what `serve --profile` runs
    assert 1 <= plan.max_threads <= meta["threads"]
    assert meta["threads"] == 1 or len(plan.measured) == len(PROBE_SHAPES)
    assert {"leave-one-out max |err|", "held-out max |err|"} <= set(meta["error"])
    # the precision profiled is the one `serve --profile` will serve (docs/profiler.md)
    assert meta["precision"]["requested"] == "auto"
    assert doc["cost_model"]["meta"]["dtype"] == meta["precision"]["chosen"]
    assert doc["cost_model"]["meta"]["backend"] == "torch"
    assert meta["precision"]["min_cosine"] >= meta["precision"]["threshold"]
    model = CostModel.load(out)
    assert model.latency(BatchShape.padded([8], 8)) > 0
    printed = capsys.readouterr().out
    assert "prediction error" in printed and "held-out" in printed


class _DriftingExecutor:
    """Batches cost exactly ``3 ms + 0.1 ms per token`` on a fake clock, and the CPU turns 1.5x slower
    after ``step_after`` calls: a speed step in the middle of a profile, as this machine shows."""

    model_name, device, max_length, vocab_size, num_special_tokens = "fake", "cpu", 512, 30522, 0

    def __init__(self, step_after: int) -> None:
        self.now, self.calls, self.step_after = 0.0, 0, step_after

    def tokenize_ids(self, ids: list[list[int]], truncate: bool = False) -> list[list[int]]:
        return ids

    def prepare(self, batch: object) -> object:
        return batch

    def run(self, batch: object) -> list[None]:
        self.calls += 1
        speed = 1.0 if self.calls <= self.step_after else 1.5
        self.now += speed * (0.003 + 1e-4 * batch.shape.tokens)  # type: ignore[attr-defined]
        return []


def test_a_speed_step_during_the_profile_scales_every_shape_alike(monkeypatch: pytest.MonkeyPatch) -> None:
    """Timed round-robin, a step in the CPU's speed moves every shape's median alike (a speed, which the
    live fit corrects); timed shape after shape it would bend the model's shape."""
    import batchpilot.models.profiler as profiler

    fake = _DriftingExecutor(step_after=10 + 6)  # 6 shapes: 6 warm-ups, then 5 rounds; step in round 2
    monkeypatch.setattr(profiler.time, "perf_counter", lambda: fake.now)
    _, points = profile_grid(fake, (1, 2), (16, 64, 128), 5, None, "none", False, False, 0)
    ratios = [m.latency_s / (0.003 + 1e-4 * m.features["tokens"]) for m in points]
    assert ratios == pytest.approx([1.5] * 6)
