"""The LLM serving path in the profile: the client's first token against the engine's, and the engine's
steps under the profile's own open-loop load, measured in-process."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from inproc import small_llm_engine

from batchpilot.profile.llm import measure_llm_serving_path, profile_llm_steps
from batchpilot.sim.llm import LLMServiceModel


def test_first_token_delay_and_loaded_steps_are_measured() -> None:
    engine = small_llm_engine()
    model = profile_llm_steps(engine.runner, prefill_lengths=(16, 32, 64, 96, 128),
                              decode_batches=(1, 2, 4, 8), decode_contexts=(32, 128), mixed_prefills=(32,),
                              mixed_decodes=(1, 4), repeats=1)
    service, details = measure_llm_serving_path(engine, model, requests=4, loaded_requests=12)
    lone = details["first_token"]
    assert lone["requests"] == 4 and lone["ok"] == 4
    assert math.isfinite(service.first_token_delay_s) and service.first_token_delay_s == lone["median_s"]
    assert lone["p10_s"] <= lone["p90_s"]
    loaded = details["loaded"]
    assert loaded["steps"] >= 10  # 12 streams of 16-128 tokens, then the burst
    assert details["burst_streams"] == 4 and loaded["max_seqs"] == 4  # all of max_num_seqs at once
    assert 1 <= loaded["mean_seqs"] <= 4 and 1 <= loaded["p90_seqs"] <= 4 and loaded["seqs_levels"] >= 2
    assert service.step_alpha == loaded["forward_over_predicted"] > 0
    assert service.step_const_s >= 0 and service.step_per_seq_s >= 0


def test_the_simulator_adds_the_serving_path_to_every_token_and_step() -> None:
    from batchpilot.sim.llm import simulate_llm
    from batchpilot.sim.traces import load_workload

    wl = load_workload("conv-llm", start=0, count=20)
    plain = simulate_llm(wl).report()
    later = simulate_llm(wl, service=LLMServiceModel(first_token_delay_s=0.05)).report()
    assert math.isclose(later.ttft_p50, plain.ttft_p50 + 0.05, rel_tol=1e-9)
    assert math.isclose(later.tpot_p50, plain.tpot_p50, rel_tol=1e-9)
    slower = simulate_llm(wl, service=LLMServiceModel(step_alpha=1.0, step_per_seq_s=0.002)).report()
    assert slower.tpot_p50 > plain.tpot_p50 and slower.mean_step_s > plain.mean_step_s


def test_profile_llm_writes_the_serving_path_that_simulate_reads(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """``batchpilot profile --llm`` measures the serving path on a fresh engine (its memory burst stops
    the first one) and writes it where ``simulate --target llm --profile`` reads it."""
    import functools
    import json

    import batchpilot.profile.llm as llm_serving_profile
    import batchpilot.profile.llm as step_profile
    from batchpilot.cli import main

    monkeypatch.setattr(step_profile, "profile_llm_steps", functools.partial(
        profile_llm_steps, prefill_lengths=(16, 64, 128), decode_batches=(1, 4), decode_contexts=(32, 128),
        mixed_prefills=(32,), mixed_decodes=(1, 4)))
    monkeypatch.setattr(llm_serving_profile, "measure_llm_serving_path", functools.partial(
        measure_llm_serving_path, requests=4, loaded_requests=12, burst=4))
    out = tmp_path / "llm.json"
    assert main(["profile", "--llm", "--threads", "1", "--repeats", "1", "-o", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["serving_path"]["first_token"]["ok"] == 4 and doc["serving_path"]["loaded"]["steps"] >= 10
    read = LLMServiceModel.from_profile(str(out))
    assert read.to_dict() == doc["service"] and read.step_alpha > 0
    assert main(["simulate", "--target", "llm", "--workload", "conv-llm", "--requests", "10",
                 "--profile", str(out)]) == 0
    none = tmp_path / "bare.json"
    assert main(["profile", "--llm", "--threads", "1", "--repeats", "1", "--no-serving-path",
                 "-o", str(none)]) == 0
    assert "service" not in json.loads(none.read_text())
