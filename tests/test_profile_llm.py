"""``profile.llm``'s loaded phase, as planned: the open-loop segments, then a burst that
keeps as many sequences running as the engine batches (up to ``BURST_MAX_SEQS``)."""

from __future__ import annotations

import numpy as np
import pytest

from batchpilot.core.costmodel import CostModel, StepShape
from batchpilot.core.llm.config import LLMSchedulerConfig
from batchpilot.profile.llm import (
    BURST_MAX_SEQS,
    BURST_ROUNDS,
    LOADED_REQUESTS,
    LOADED_SEGMENTS,
    LOADED_SHARES,
    OUTPUT_RANGE,
    burst_seconds,
    burst_streams,
    loaded_workload,
)

MODEL = CostModel(feature_names=("const", "prefill_tokens", "decode_seqs", "kv_tokens", "prefill_attn",
                                 "multi_row"),
                  latency_coef=(0.01, 2e-4, 5e-4, 1e-6, 0.0, 0.0), memory_coef=(0.0,) * 6)


def most_running(arrivals: list[float], outputs: list[int], step_s: float) -> int:
    """The most streams running at once if each ran from its arrival for at least its output tokens'
    decode steps of ``step_s`` (no step is shorter: a lower bound on every stream's time)."""
    events = sorted([(a, 1) for a in arrivals] + [(a + o * step_s, -1) for a, o in zip(arrivals, outputs,
                                                                                        strict=True)],
                    key=lambda e: (e[0], e[1]))
    running = best = 0
    for _, d in events:
        running += d
        best = max(best, running)
    return best


@pytest.mark.parametrize(("config", "want"), [
    (LLMSchedulerConfig(), 64),
    (LLMSchedulerConfig(max_num_seqs=256, num_kv_blocks=4096), BURST_MAX_SEQS),
    (LLMSchedulerConfig(max_num_seqs=24), 24),
    (LLMSchedulerConfig(max_num_seqs=4, num_kv_blocks=64, max_num_batched_tokens=256, max_model_len=256), 4),
    (LLMSchedulerConfig(max_num_seqs=64, num_kv_blocks=100), 10),  # the KV pool holds 10 of them
])
def test_the_burst_keeps_as_many_sequences_running_as_the_engine_batches(config: LLMSchedulerConfig,
                                                                         want: int) -> None:
    burst = burst_streams(config)
    assert burst == want
    n = 40
    wl = loaded_workload(config, MODEL, seed=3, n=n, burst=burst)
    arrivals, prompts = wl.arrival_s.tolist(), wl.input_tokens.tolist()
    outputs = wl.output_tokens.tolist()
    assert len(arrivals) == n + BURST_ROUNDS * burst and arrivals == sorted(arrivals)
    assert all(OUTPUT_RANGE[0] <= o <= OUTPUT_RANGE[1] for o in outputs)
    assert all(p >= 16 and p + OUTPUT_RANGE[1] <= config.max_model_len for p in prompts)
    one_seq = MODEL.latency(StepShape(0, 1, 16))
    for k in range(BURST_ROUNDS):
        first, last = n + k * burst, n + (k + 1) * burst
        assert most_running(arrivals[first:last], outputs[first:last], one_seq) == burst  # all at once
        blocks = sum(-(-(p + o) // config.block_size)
                     for p, o in zip(prompts[first:last], outputs[first:last], strict=True))
        assert blocks <= config.num_kv_blocks * 9 // 10  # and the KV pool holds them all
        if k:  # the one before is served (as the step profile prices it) before this one comes
            before = n + (k - 1) * burst
            assert arrivals[first] - arrivals[first - 1] > burst_seconds(MODEL, prompts[before:first],
                                                                         outputs[before:first])
    assert most_running(arrivals[n:], outputs[n:], one_seq) == burst  # the bursts do not pile up
    open_loop = loaded_workload(config, MODEL, seed=3, n=n, burst=0)
    assert open_loop.arrival_s.tolist() == arrivals[:n]  # the open-loop segments are unchanged
    if burst >= 16:
        assert most_running(arrivals[:n], outputs[:n], one_seq) < burst // 2  # what they alone reach


def test_burst_seconds_counts_a_decode_step_per_token_of_the_streams_still_running() -> None:
    lone = MODEL.latency(StepShape(10, 0, 10, 100)) + MODEL.latency(StepShape(20, 0, 20, 400))
    steps = MODEL.latency(StepShape(0, 2, 10 + 1 + 20 + 1)) + MODEL.latency(StepShape(0, 1, 20 + 2))
    assert burst_seconds(MODEL, [10, 20], [2, 3]) == pytest.approx(lone + steps)
    assert burst_seconds(MODEL, [], []) == 0.0


def test_no_burst_when_asked_for_none() -> None:
    wl = loaded_workload(LLMSchedulerConfig(), MODEL, seed=0, n=12, burst=0)
    assert len(wl.arrival_s) == 12
    only_bursts = loaded_workload(LLMSchedulerConfig(), MODEL, seed=0, n=0, burst=5)
    assert len(only_bursts.arrival_s) == 5 * BURST_ROUNDS


def test_each_open_loop_segment_arrives_at_its_share_of_the_one_at_a_time_rate() -> None:
    n = 3000 * LOADED_SEGMENTS
    arrivals = loaded_workload(LLMSchedulerConfig(), MODEL, seed=1, n=n, burst=0).arrival_s
    per = n // LOADED_SEGMENTS
    gaps = [float(np.diff(arrivals[k * per:(k + 1) * per]).mean()) for k in range(LOADED_SEGMENTS)]
    for k, gap in enumerate(gaps):  # the segments take turns at the shares, every one of them used
        share = LOADED_SHARES[k % len(LOADED_SHARES)]
        assert gap * share == pytest.approx(gaps[0] * LOADED_SHARES[0], rel=0.1)
    assert len({LOADED_SHARES[k % len(LOADED_SHARES)] for k in range(LOADED_SEGMENTS)}) == len(LOADED_SHARES)


def test_the_loaded_phase_runs_hundreds_of_decode_steps_at_each_count_a_loaded_server_runs_most() -> None:
    """Simulated on the stated default step model, the open-loop segments and bursts give every bin of
    ``step_seq_factors`` from 4 to 31 sequences at least 200 decode-only steps (the factors' fit)."""
    from batchpilot.sim.llm import SEQ_EDGES, default_llm_cost_model, simulate_llm

    config, model = LLMSchedulerConfig(), default_llm_cost_model()
    wl = loaded_workload(config, model, seed=0, n=LOADED_REQUESTS, burst=burst_streams(config))
    record = simulate_llm(wl, config, model).record
    seqs, tokens = np.array(record.step_seqs), np.array(record.step_tokens)
    decode = tokens == seqs
    edges = [*SEQ_EDGES, 10**9]
    steps = {lo: int((decode & (seqs >= lo) & (seqs < hi)).sum())
             for lo, hi in zip(edges, edges[1:], strict=False)}
    assert all(steps[lo] >= 200 for lo in (4, 8, 16)), steps
