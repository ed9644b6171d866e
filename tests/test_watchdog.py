"""The watchdogs on a fake clock: the LLM engine's (runtime/llm/failover.py) and the encoder Batcher's
(runtime/batcher.py, on a real Batcher whose run is held by a gate)."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass
from typing import Any

from batchpilot.core.batch import Batch
from batchpilot.core.config import PolicyConfig, SchedulerConfig
from batchpilot.core.stall import StallRule
from batchpilot.runtime.batcher import Batcher, BatcherWatchdog
from batchpilot.runtime.llm.engine import StepRecord
from batchpilot.runtime.llm.failover import DIED, STALLED, EngineWatchdog


@dataclass
class FakeEngine:
    busy_since: float | None = None
    is_alive: bool = True
    failure: BaseException | None = None


def step(wall_s: float) -> StepRecord:
    return StepRecord(0, 0.0, wall_s, wall_s, 1, {}, False)


def test_an_llm_step_past_the_measured_bound_is_a_stall_and_an_idle_engine_never_is() -> None:
    dog = EngineWatchdog(StallRule(multiple=10.0, floor_s=1.0, min_samples=3))
    for _ in range(3):
        dog.on_step(step(0.2))
    assert dog.timeout_s() == 2.0
    engine = FakeEngine()
    assert dog.check(engine, now=1e6) is None  # no step under way
    engine.busy_since = 100.0
    assert dog.check(engine, now=102.0) is None
    assert dog.check(engine, now=102.01) == STALLED


def test_a_dead_llm_loop_is_reported_whatever_its_steps() -> None:
    dog = EngineWatchdog(StallRule(timeout_s=5.0))
    assert dog.check(FakeEngine(is_alive=False), now=0.0) == DIED
    assert dog.check(FakeEngine(failure=OSError("disk full")), now=0.0) == DIED


class Gated:
    def __init__(self) -> None:
        self.gate, self.started = threading.Event(), threading.Event()

    def prepare(self, batch: Batch) -> list[int]:
        return [r.payload for r in batch.requests]

    def run(self, payloads: list[int]) -> list[int]:
        self.started.set()
        assert self.gate.wait(30), "the test never opened the gate"
        return [2 * p for p in payloads]


def test_an_encoder_slot_past_the_bound_is_stuck_until_its_batch_ends() -> None:
    async def scenario() -> None:
        ex = Gated()
        cfg = SchedulerConfig(policy=PolicyConfig(name="window", max_batch_size=4, max_wait_s=0.0))
        batcher = Batcher(ex, cfg)
        dog = BatcherWatchdog(batcher, StallRule(timeout_s=2.0))
        task = asyncio.ensure_future(batcher.submit(21, 4))
        assert await asyncio.get_running_loop().run_in_executor(None, ex.started.wait, 10)
        slot = next(s for s in batcher.slots if s.running is not None)
        assert dog.check(now=slot.run_started + 2.0) == [] and not dog.stuck  # at the bound
        assert dog.check(now=slot.run_started + 2.5) == [slot.index] and dog.stuck
        assert batcher.health == "ok"  # the Batcher's own health (crashes) is apart from stalls
        dog.check(now=slot.run_started + 9.0)
        assert dog.num_stalls == 1  # one stuck batch counts once
        ex.gate.set()
        assert await task == 42
        assert dog.check() == [] and not dog.stuck
        await batcher.shutdown(1.0)

    asyncio.run(asyncio.wait_for(scenario(), 60))


def test_the_encoder_bound_follows_measured_batch_times() -> None:
    batcher: Any = type("B", (), {"batch_observers": [], "slots": [], "clock": staticmethod(lambda: 0.0)})()
    dog = BatcherWatchdog(batcher, StallRule(multiple=4.0, floor_s=0.5, min_samples=2))
    assert dog.timeout_s() == StallRule().cold_s
    for seconds in (0.5, 0.5):
        batcher.batch_observers[0](None, 0.0, seconds)
    assert dog.timeout_s() == 2.0
