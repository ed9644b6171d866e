"""The speed check (`batchpilot profile --recheck`): exact on a fake clock, and the CLI on the real model.

No wall-clock assertions: the real-model test checks what the rechecked file holds, not how fast it is.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import batchpilot.models.profiler as profiler
import batchpilot.profile.speed_check as speed_check
from batchpilot import cli
from batchpilot.core.costmodel import CostModel
from batchpilot.models.profiler import profile_grid
from batchpilot.profile.speed_check import SpeedCheck, check_speed, reference_batches, rescaled
from batchpilot.sim.service import BatchCost, ServiceModel


class _ClockedExecutor:
    """A batch takes ``speed x (3 ms + 0.1 ms per token)`` on a fake clock."""

    model_name, device, max_length, vocab_size, num_special_tokens = "fake", "cpu", 512, 30522, 0

    def __init__(self, speed: float) -> None:
        self.now, self.speed = 0.0, speed

    def tokenize_ids(self, ids: list[list[int]], truncate: bool = False) -> list[list[int]]:
        return ids

    def prepare(self, batch: object) -> object:
        return batch

    def run(self, batch: Any) -> list[None]:
        self.now += self.speed * (0.003 + 1e-4 * batch.shape.tokens)
        return []


def _profile_doc(monkeypatch: pytest.MonkeyPatch, padding: str = "none") -> dict[str, Any]:
    fake = _ClockedExecutor(1.0)
    monkeypatch.setattr(profiler.time, "perf_counter", lambda: fake.now)
    model, points = profile_grid(fake, (1, 2, 4, 16), (16, 64, 128), 3, None, padding, False, False, 0)
    return {"cost_model": model.to_dict(), "points": [m.to_dict() for m in points], "meta": {},
            "service": ServiceModel(batch=BatchCost(alpha=1.1, const_s=0.002)).to_dict()}


@pytest.mark.parametrize("padding", ["none", "dynamic"])
@pytest.mark.parametrize("speed", [0.7, 1.0, 1.5])
def test_the_check_measures_the_speed_the_batches_run_at(monkeypatch: pytest.MonkeyPatch, padding: str,
                                                         speed: float) -> None:
    doc = _profile_doc(monkeypatch, padding)
    now = _ClockedExecutor(speed)
    monkeypatch.setattr(profiler.time, "perf_counter", lambda: now.now)
    check = check_speed(now, doc, repeats=3)
    assert check.ratio == pytest.approx(speed)
    assert check.speed == pytest.approx(speed - 1.0)
    refs = reference_batches(doc)
    assert [b["lengths"] for b in check.batches] == [r["lengths"] for r in refs]  # the profile's own inputs
    assert all(sum(r["lengths"]) <= speed_check.MAX_TOKENS for r in refs) and len(refs) >= 4
    assert len(refs) < len(doc["points"])  # the largest grid batches are left out: seconds, not minutes


def test_a_rescaled_profile_prices_every_batch_at_the_checked_speed(monkeypatch: pytest.MonkeyPatch) -> None:
    doc = _profile_doc(monkeypatch)
    before = json.dumps(doc)
    out = rescaled(doc, SpeedCheck(1.25, [{"ratio": 1.2}, {"ratio": 1.3}]), "p.json")
    assert json.dumps(doc) == before  # the source is left as it was
    a, b = CostModel.from_dict(doc["cost_model"]), CostModel.from_dict(out["cost_model"])
    for p in doc["points"]:
        assert b.latency(p["features"]) == pytest.approx(1.25 * a.latency(p["features"]))
        assert b.memory(p["features"]) == pytest.approx(a.memory(p["features"]))
    fa, fb = ServiceModel.from_dict(doc["service"]), ServiceModel.from_dict(out["service"])
    assert fb.batch.seconds(1.25 * 0.02) == pytest.approx(1.25 * fa.batch.seconds(0.02))
    assert fb.request == fa.request
    assert out["speed_check"]["of"] == "p.json" and out["speed_check"]["spread"] == [1.2, 1.3]
    # rechecking a rechecked profile scales from the original, not twice
    again = rescaled(out, SpeedCheck(0.9), "p2.json")
    assert CostModel.from_dict(again["cost_model"]).latency(doc["points"][0]["features"]) == pytest.approx(
        0.9 * a.latency(doc["points"][0]["features"]))


def test_a_profile_without_points_is_refused() -> None:
    with pytest.raises(ValueError, match="no measured grid points"):
        reference_batches({"cost_model": {}, "points": []})


def test_recheck_cli_writes_a_profile_serve_and_simulate_read(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "p.json"
    assert cli.main(["profile", "-o", str(src), "--device", "cpu", "--batch-sizes", "1", "2",
                     "--lengths", "8", "16", "24", "--repeats", "1", "--holdout", "0", "--no-serving-path",
                     "--padding", "none"]) == 0
    assert cli.main(["profile", "--recheck", str(src), "-o", str(src)]) == 2  # never over its source
    assert "another --output" in capsys.readouterr().out
    out = tmp_path / "now.json"
    assert cli.main(["profile", "--recheck", str(src), "-o", str(out), "--repeats", "2"]) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    doc, now = json.loads(src.read_text()), json.loads(out.read_text())
    ratio = now["speed_check"]["ratio"]
    assert ratio > 0 and len(now["speed_check"]["batches"]) == len(doc["points"]) == 6
    assert now["points"] == doc["points"] and now["meta"] == doc["meta"]
    shape = doc["points"][0]["features"]
    assert CostModel.load(out).latency(shape) == pytest.approx(ratio * CostModel.load(src).latency(shape))
    assert cli.main(["simulate", "--workload", "conv-embed", "--requests", "50", "--profile", str(out)]) == 0


def test_an_llm_profile_rechecks_its_own_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """The LLM step profile records each step shape it timed; the recheck times the short ones again
    on a runner built as the profile's and rescales the step model and the per-step overheads."""
    from batchpilot.profile.llm import profile_llm_steps
    from batchpilot.runtime.llm.build import build_llm_engine

    engine = build_llm_engine(None, start=False, num_hidden_layers=1, hidden_size=64, intermediate_size=128)
    model = profile_llm_steps(engine.runner, prefill_lengths=(8, 16, 32, 64, 96), decode_batches=(1, 2),
                              decode_contexts=(16, 32), mixed_prefills=(8,), mixed_decodes=(1,), repeats=1)
    points = model.meta["step_points"]
    assert len(points) == 10 and all(p["latency_s"] > 0 for p in points)
    assert {(tuple(p["prefills"]), p["decodes"], p["context"]) for p in points} >= {((8,), 0, 1), ((), 2, 32),
                                                                                  ((8,), 1, 32)}
    doc = {"kind": "llm", "cost_model": model.to_dict(),
           "service": {"first_token_delay_s": 0.005, "step_alpha": 1.1, "step_const_s": 0.001,
                       "step_per_seq_s": 0.0001}}
    built: list[dict[str, Any]] = []
    real = build_llm_engine

    def build(path: str | None, **kw: Any) -> Any:  # the recheck's runner: the same small model
        built.append(kw)
        return real(path, **{**kw, "num_hidden_layers": 1, "hidden_size": 64, "intermediate_size": 128})

    monkeypatch.setattr("batchpilot.runtime.llm.build.build_llm_engine", build)
    check = speed_check.check_llm_speed(doc, repeats=2)
    assert built[0]["dtype"] == "float32" and built[0]["start"] is False
    assert check.ratio > 0 and len(check.batches) == len(points)  # every step under 50 ms here
    out = rescaled(doc, check)
    assert out["service"]["step_const_s"] == pytest.approx(0.001 * check.ratio)
    assert out["service"]["step_per_seq_s"] == pytest.approx(0.0001 * check.ratio)
    assert out["service"]["step_alpha"] == 1.1 and out["service"]["first_token_delay_s"] == 0.005
    assert out["cost_model"]["latency_coef"] == pytest.approx([c * check.ratio for c in model.latency_coef])
    # every step, the grid's own shape included (sim.llm), is priced at the checked speed
    from batchpilot.sim.llm import StepPricer, step_point_shape

    before, after = StepPricer(model), StepPricer(CostModel.from_dict(out["cost_model"]))
    for p in points:
        shape = step_point_shape(p["prefills"], p["decodes"], p["context"])
        assert after.latency(shape) == pytest.approx(check.ratio * before.latency(shape))
    with pytest.raises(ValueError, match="no step points"):
        speed_check.check_llm_speed({"kind": "llm", "cost_model": {"meta": {}}})
