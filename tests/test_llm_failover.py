"""runtime/llm/failover.py without HTTP: faults, moves and returns, repeated, on a real small engine."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
import torch
from prometheus_client import CollectorRegistry

from batchpilot.core.breaker import BreakerConfig
from batchpilot.core.llm.sequence import SamplingParams
from batchpilot.core.stall import StallRule
from batchpilot.runtime.llm.build import build_fallback, build_llm_engine
from batchpilot.runtime.llm.engine import EngineBusy, EngineUnavailable
from batchpilot.runtime.llm.failover import LLMFailover
from batchpilot.server.llm.metrics import LLMMetrics

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def wait_for(predicate: Any, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def small_engine() -> Any:
    return build_llm_engine(None, num_hidden_layers=1, hidden_size=64, intermediate_size=128,
                              num_attention_heads=2, num_key_value_heads=1, num_kv_blocks=32,
                              max_model_len=128, max_num_seqs=4, max_waiting_seqs=4, model_name="m",
                              tokenizer_threads=1, initializer_range=0.06)


def failover(fallback: bool = True) -> LLMFailover:
    engine = small_engine()
    return LLMFailover(engine, build_fallback(engine) if fallback else None, StallRule(timeout_s=60.0),
                       BreakerConfig(probe_interval_s=0.05, backoff=1.0))


async def _texts(f: LLMFailover, prompts: list[list[int]], replayable: bool) -> list[list[int]]:
    out = []
    for req in f.submit(prompts, GREEDY, replayable=replayable):
        out.append([t async for item in req for t in item.token_ids])
    return out


def texts(f: LLMFailover, prompts: list[list[int]], replayable: bool = False) -> list[list[int]]:
    return asyncio.run(_texts(f, prompts, replayable))


def oom_next_step(runner: Any) -> None:
    original = runner.forward

    def forward(chunks: Any) -> Any:
        runner.forward = original  # once
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    runner.forward = forward


def test_faults_and_returns_repeat_and_every_answer_is_the_engines() -> None:
    f = failover()
    prompts = [[5, 6, 7], [8, 9], [10]]
    registry = CollectorRegistry()
    LLMMetrics(f, registry)
    try:
        reference = texts(f, prompts)
        first = f.main
        with pytest.raises(EngineBusy):
            f.check_room(f.max_admitted + 1)
        for cycle in (1, 2, 3):
            oom_next_step(f.main.runner)
            assert texts(f, prompts, replayable=cycle % 2 == 0) == reference  # moved to the fallback
            assert f.faults["oom"] == cycle
            wait_for(lambda: f.is_alive)  # the probe rebuilt the engine on the same runner
            assert f.breaker.num_closed == cycle
            assert texts(f, prompts) == reference
        assert f.main is not first and f.main.runner is first.runner
        # the refusal on the first engine is still counted, on the engine rebuilt three times
        assert registry.get_sample_value("batchpilot_llm_rejected_requests_total",
                                         {"reason": "queue_full"}) == 1.0
        assert f.fallback_requests == 3 * len(prompts)
        assert f.num_pending == 0
    finally:
        f.shutdown(5.0)


def test_without_a_fallback_a_fault_is_engine_unavailable_until_the_probe() -> None:
    f = failover(fallback=False)
    try:
        oom_next_step(f.main.runner)
        try:
            texts(f, [[5, 6]])
            raise AssertionError("expected EngineUnavailable")
        except EngineUnavailable as exc:
            assert exc.retry_after_s == f.breaker.interval_s
        wait_for(lambda: f.is_alive)
        assert len(texts(f, [[5, 6]])[0]) == GREEDY.max_tokens
    finally:
        f.shutdown(5.0)


def test_shutdown_is_not_a_fault() -> None:
    f = failover()
    f.shutdown(5.0)
    assert f.faults == {} and not f.is_alive
    try:
        texts(f, [[5]])
        raise AssertionError("expected EngineUnavailable")
    except EngineUnavailable:
        pass


def test_a_stalled_fallback_is_abandoned_with_503_and_rebuilt_once_its_step_returns() -> None:
    import threading

    engine = small_engine()
    f = LLMFailover(engine, build_fallback(engine), StallRule(timeout_s=60.0),
                    BreakerConfig(probe_interval_s=60.0), fallback_stall=StallRule(timeout_s=0.3))
    stuck = f.fallback
    gate, entered = threading.Event(), threading.Event()
    original = stuck.model.generate

    def held(**kw: Any) -> Any:
        entered.set()
        assert gate.wait(30), "the test never opened the gate"
        return original(**kw)

    stuck.model.generate = held
    try:
        oom_next_step(f.main.runner)  # the engine fails: the request moves to the fallback, which hangs
        try:
            texts(f, [[5, 6]])
            raise AssertionError("expected EngineUnavailable")
        except EngineUnavailable:
            pass
        assert entered.is_set() and f.fallback_faults["stalled"] == 1 and f.fallback is stuck
        assert not f.fallback_active
    finally:
        stuck.model.generate = original
        gate.set()
    wait_for(lambda: f.fallback is not stuck and f.fallback.is_alive)
    assert len(texts(f, [[5, 6]])[0]) == GREEDY.max_tokens  # the rebuilt fallback answers
    assert f.fallback_requests == 2
    f.shutdown(5.0)
