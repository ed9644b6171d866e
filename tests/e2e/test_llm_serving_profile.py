"""The LLM serving path in the profile: the client's first token against the engine's, measured in-process."""

from __future__ import annotations

import math

from inproc import small_llm_engine

from batchpilot.server.llm_serving_profile import measure_first_token_delay


def test_first_token_delay_is_measured_on_lone_streams() -> None:
    engine = small_llm_engine()
    delay, details = measure_first_token_delay(engine, requests=4)
    assert details["requests"] == 4 and details["ok"] == 4
    assert math.isfinite(delay) and delay >= 0.0 and delay == details["median_s"]
    assert details["p10_s"] <= details["p90_s"]


def test_the_simulator_adds_the_delay_to_every_token() -> None:
    from batchpilot.sim.llm import simulate_llm
    from batchpilot.sim.workloads import load_workload

    wl = load_workload("conv-llm", start=0, count=20)
    plain = simulate_llm(wl).report()
    later = simulate_llm(wl, first_token_delay_s=0.05).report()
    assert math.isclose(later.ttft_p50, plain.ttft_p50 + 0.05, rel_tol=1e-9)
    assert math.isclose(later.tpot_p50, plain.tpot_p50, rel_tol=1e-9)
