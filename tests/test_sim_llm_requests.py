"""What a simulated LLM request asks beyond its tokens: ``n`` samples (one group, sharing the prompt's
KV blocks as the engine runs it) and a grammar (each of its steps priced by the profile's
``structured_s_per_seq``); and the profile's measurement of that price on a real runner."""

from __future__ import annotations

import math

import numpy as np
import pytest

from batchpilot.core.llm.config import LLMSchedulerConfig
from batchpilot.profile.structured import decode_step_seconds, measure_structured_cost
from batchpilot.sim.llm import LLMRequests, LLMServiceModel, simulate_llm
from batchpilot.sim.traces import Workload

CONFIG = LLMSchedulerConfig(num_kv_blocks=400, block_size=16, max_num_seqs=64, max_num_batched_tokens=512,
                            max_model_len=1024)


def burst(n: int, prompt: int = 200, output: int = 20) -> Workload:
    return Workload.from_columns("burst", [0.0] * n, [prompt] * n, [output] * n)


def test_n_samples_make_n_times_the_tokens_and_share_the_prompts_blocks() -> None:
    one = simulate_llm(burst(4), CONFIG, requests=LLMRequests(samples=1))
    four = simulate_llm(burst(4), CONFIG, requests=LLMRequests(samples=4))
    alone = simulate_llm(burst(16), CONFIG)
    assert sum(four.record.num_output) == 4 * sum(one.record.num_output) == 16 * 20
    # a group computes its prompt once: the 16 samples prefill far fewer tokens than 16 requests
    assert sum(four.record.step_tokens) < sum(alone.record.step_tokens) - 10 * 150
    rep = four.report()
    assert rep.num_finished == 4 and math.isclose(rep.tpot_p50, four.report().tpot_p50)
    assert rep.tpot_p50 > 0  # per sample, not per request's total


def test_the_structured_share_is_priced_per_structured_sequence_in_each_step() -> None:
    service = LLMServiceModel(structured_s_per_seq=0.002)
    base = simulate_llm(burst(8), CONFIG, service=service)
    requests = LLMRequests(structured_share=0.5)
    half = simulate_llm(burst(8), CONFIG, service=service, requests=requests)
    extra = np.asarray(half.record.step_duration).sum() - np.asarray(base.record.step_duration).sum()
    structured = sum(requests.is_structured(i) for i in range(8))
    assert 3 <= structured <= 5 and extra == pytest.approx(0.002 * structured * 20, rel=1e-6)
    shares = [LLMRequests(structured_share=f) for f in (0.0, 0.25, 1.0)]
    assert [sum(r.is_structured(i) for i in range(400)) for r in shares] == [0, 100, 400]
    with pytest.raises(ValueError, match="samples"):
        LLMRequests(samples=0)


@pytest.fixture(scope="module")
def engine() -> object:
    from batchpilot.runtime.llm.build import BuildOptions, build_llm_engine

    return build_llm_engine(None, options=BuildOptions(start=False), num_hidden_layers=2, hidden_size=128,
                            intermediate_size=344, num_attention_heads=4, num_key_value_heads=2,
                            num_kv_blocks=64, block_size=16, max_model_len=256)


def test_the_profile_measures_a_structured_steps_cost_on_the_engines_runner(engine: object) -> None:
    assert decode_step_seconds(engine, 4, 0.5, steps=4) > 0
    per_seq, details = measure_structured_cost(engine, seqs=4, steps=4, rounds=1)
    assert per_seq >= 0 and details["structured_step_s"] > 0 and details["plain_step_s"] > 0
