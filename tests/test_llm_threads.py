"""Each thread that runs the LLM sets its own torch thread count (models.device.bind_threads).

torch takes a thread's intra-op count at its first op from the last process-wide set_num_threads and keeps
it; in a server the encoder's thread plan sets 1 for short batches, and an engine thread that started
after such a batch ran on one thread for its whole life. These tests leave the process-wide count at 1
(what that plan leaves) before the model's thread starts, and read the count on that thread."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from batchpilot.core.llm.sequence import SamplingParams
from batchpilot.models.device import bind_threads
from batchpilot.runtime.llm.build import build_fallback, build_llm_engine

SMALL = dict(num_hidden_layers=1, hidden_size=128, intermediate_size=256, num_attention_heads=4,
             num_key_value_heads=2, num_kv_blocks=64, block_size=16, max_num_batched_tokens=128,
             max_model_len=128, max_num_seqs=4, max_waiting_seqs=8, model_name="m", tokenizer_threads=1)


@pytest.fixture
def restore_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _in_new_thread(fn: Any) -> Any:
    out: list[Any] = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join()
    return out[0]


def test_a_thread_keeps_the_count_it_found_unless_it_binds_its_own(restore_threads: None) -> None:
    torch.set_num_threads(1)  # what another model's thread plan left process-wide
    assert _in_new_thread(torch.get_num_threads) == 1  # the trap: a new thread inherits it

    def bound() -> tuple[int | None, int]:
        return bind_threads("cpu", 2), torch.get_num_threads()

    assert _in_new_thread(bound) == (2, 2)
    assert _in_new_thread(lambda: bind_threads("cuda:0", 2)) is None  # not a CPU: nothing set
    assert _in_new_thread(lambda: bind_threads(None, 2)) is None


async def _drain(engine: Any, prompt: str) -> None:
    ids = engine.tokenizer.encode(prompt)
    for req in engine.submit([ids], SamplingParams(max_tokens=3, temperature=0.0)):
        async for _ in req:
            pass


def test_the_engine_and_fallback_threads_run_at_the_runner_s_count(restore_threads: None) -> None:
    engine = build_llm_engine(None, threads=2, start=False, **SMALL)
    assert engine.runner.threads == 2
    seen: list[int] = []
    engine.step_observers.append(lambda record: seen.append(torch.get_num_threads()))  # engine thread
    torch.set_num_threads(1)  # left at 1 before the engine thread's first op
    engine.start()
    fallback = build_fallback(engine, max_batch_size=2)
    fell: list[int] = []
    fallback.step_observers.append(lambda record: fell.append(torch.get_num_threads()))
    try:
        asyncio.run(_drain(engine, "hello world"))
        asyncio.run(_drain(fallback, "hello world"))
    finally:
        fallback.shutdown()
        engine.shutdown()
    assert seen and set(seen) == {2}
    assert fell and set(fell) == {2}
    assert torch.get_num_threads() == 1  # the caller's own count is its own
