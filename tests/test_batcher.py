"""The live driver on real asyncio with fake executors. Timing is controlled with events, never sleeps:
a gated executor blocks its run until the test opens the gate, so "what happens while a batch runs"
is deterministic."""

from __future__ import annotations

import asyncio
import random
import threading
from collections.abc import Coroutine
from typing import Any

import pytest

from batchpilot.core.admission import RejectReason
from batchpilot.core.batch import Batch
from batchpilot.core.config import AdmissionConfig, PlannerConfig, PolicyConfig, SchedulerConfig
from batchpilot.core.costmodel import CostModel
from batchpilot.runtime.batcher import Batcher, BatcherObserver
from batchpilot.runtime.errors import ExecutionError, ExecutorCrashed, RequestRejected
from batchpilot.runtime.executor import AsyncCallableExecutor, CallableExecutor

WAIT = 10.0  # generous bound for event waits on a loaded machine (a hang fails, a slow run does not)


def run(coro: Coroutine[Any, Any, Any]) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 60))


def config(max_batch_size: int = 8, max_wait_s: float = 0.0, policy: str = "window", pays: bool = True,
           **admission: Any) -> SchedulerConfig:
    pol = PolicyConfig(name=policy, max_batch_size=max_batch_size, max_wait_s=max_wait_s,  # type: ignore[arg-type]
                       wait_only_if_it_pays=pays)
    return SchedulerConfig(policy=pol, planner=PlannerConfig(grouping="fifo"),
                           admission=AdmissionConfig(**admission))


class GatedExecutor:
    """Doubles each payload. The first ``gated`` runs block until ``gate`` is set; records every call."""

    def __init__(self, gated: int = 1, poison: frozenset[int] = frozenset()) -> None:
        self.gate = threading.Event()
        self.started = threading.Event()  # a gated run has begun
        self.gated = gated
        self.poison = poison
        self.runs: list[list[int]] = []
        self.prepared: list[list[int]] = []
        self.prepared_while_blocked = threading.Event()
        self._blocked = False

    def prepare(self, batch: Batch) -> list[int]:
        payloads = [r.payload for r in batch.requests]
        self.prepared.append(payloads)
        if self._blocked:
            self.prepared_while_blocked.set()
        return payloads

    def run(self, payloads: list[int]) -> list[int]:
        self.runs.append(payloads)
        if self.gated > 0:
            self.gated -= 1
            self._blocked = True
            self.started.set()
            assert self.gate.wait(WAIT), "test never opened the gate"
            self._blocked = False
        if any(p in self.poison for p in payloads):
            raise RuntimeError(f"poison in {payloads}")
        return [2 * p for p in payloads]


async def wait_thread_event(event: threading.Event) -> None:
    assert await asyncio.get_running_loop().run_in_executor(None, event.wait, WAIT)


class Recorder(BatcherObserver):
    def __init__(self) -> None:
        self.health: list[str] = []
        self.cancels: list[bool] = []
        self.rejects: list[RejectReason] = []
        self.done: list[bool] = []

    def on_health(self, state: str) -> None:
        self.health.append(state)

    def on_cancel(self, request: Any, queued: bool) -> None:
        self.cancels.append(queued)

    def on_reject(self, reason: RejectReason, tenant: str = "default") -> None:
        self.rejects.append(reason)

    def on_request_done(self, request: Any, latency_s: float, ok: bool) -> None:
        self.done.append(ok)


def test_every_request_answered_once_in_order_and_batches_respect_the_cap() -> None:
    async def main() -> None:
        ex = CallableExecutor(lambda xs: [x * 3 for x in xs])
        sizes: list[int] = []
        orig = ex.run
        ex.run = lambda xs: (sizes.append(len(xs)), orig(xs))[1]  # type: ignore[method-assign]
        b = Batcher(ex, config(max_batch_size=16))
        rng = random.Random(0)
        out = await asyncio.gather(*(b.submit(i, rng.randint(1, 300)) for i in range(500)))
        assert out == [3 * i for i in range(500)]
        assert sum(sizes) == 500 and max(sizes) <= 16 and len(sizes) < 500
        assert b.num_pending == 0
        await b.shutdown()

    run(main())


def test_requests_arriving_during_a_run_form_the_next_batch() -> None:
    async def main() -> None:
        ex = GatedExecutor()
        b = Batcher(ex, config(max_batch_size=32), pipeline=False)
        first = asyncio.ensure_future(b.submit(0, 4))
        await wait_thread_event(ex.started)
        rest = [b.submit_nowait(i, 4) for i in range(1, 11)]
        ex.gate.set()
        assert await first == 0 and await asyncio.gather(*rest) == [2 * i for i in range(1, 11)]
        assert ex.runs == [[0], list(range(1, 11))]
        await b.shutdown()

    run(main())


def test_max_wait_window_dispatches_a_lone_request_without_another_event() -> None:
    async def main() -> None:
        b = Batcher(CallableExecutor(lambda xs: xs), config(max_batch_size=8, max_wait_s=0.02, pays=False))
        assert await b.submit("x", 3) == "x"  # only the wake_at timer can dispatch it
        await b.shutdown()

    run(main())


def test_next_batch_is_prepared_while_the_current_one_runs() -> None:
    async def main() -> None:
        ex = GatedExecutor()
        # zero-cost model: the slot expects the run to end at once, so it accepts the next batch at once
        zero = CostModel(latency_coef=(0.0, 0.0, 0.0, 0.0))
        b = Batcher(ex, config(), zero, pipeline=True)
        first = asyncio.ensure_future(b.submit(1, 4))
        await wait_thread_event(ex.started)
        second = asyncio.ensure_future(b.submit(2, 4))
        await wait_thread_event(ex.prepared_while_blocked)
        assert ex.prepared == [[1], [2]] and ex.runs == [[1]]  # prepared, not run: the run stage is busy
        ex.gate.set()
        assert (await first, await second) == (2, 4)
        assert ex.runs == [[1], [2]]
        await b.shutdown()

    run(main())


def test_an_idle_slot_prepares_and_runs_in_one_hop_a_busy_one_pipelines() -> None:
    class Threads(GatedExecutor):
        def __init__(self) -> None:
            super().__init__(gated=0)
            self.where: list[tuple[str, str]] = []

        def prepare(self, batch: Batch) -> list[int]:
            self.where.append(("prepare", threading.current_thread().name.split("-")[1]))
            return super().prepare(batch)

        def run(self, payloads: list[int]) -> list[int]:
            self.where.append(("run", threading.current_thread().name.split("-")[1]))
            return super().run(payloads)

    async def main() -> None:
        ex = Threads()
        b = Batcher(ex, config(), CostModel(latency_coef=(0.0, 0.0, 0.0, 0.0)), pipeline=True)
        assert await b.submit(1, 4) == 2  # idle: collation on the run thread, no prepare hop
        assert ex.where == [("prepare", "run"), ("run", "run")]
        ex.where.clear()
        ex.gated = 1
        first = asyncio.ensure_future(b.submit(2, 4))
        await wait_thread_event(ex.started)
        second = asyncio.ensure_future(b.submit(3, 4))  # a batch runs: the next one is collated beside it
        await wait_thread_event(ex.prepared_while_blocked)
        ex.gate.set()
        assert (await first, await second) == (4, 6)
        assert ex.where[-2:] == [("prepare", "prepare"), ("run", "run")]
        await b.shutdown()

    run(main())


def test_stage_times_follow_a_request_through_the_batcher() -> None:
    from batchpilot.runtime.batcher import StageTimes

    async def main() -> None:
        b = Batcher(CallableExecutor(lambda xs: xs), config())
        times = StageTimes()
        (fut,) = b.submit_group_nowait(["x"], [3], times=times)
        assert await fut == "x"
        assert times.admitted <= times.dispatched <= times.run_start <= times.run_end
        assert times.queue_s >= 0 and times.prepare_s >= 0 and times.run_s >= 0
        await b.shutdown()

    run(main())


def test_cancelled_while_queued_is_removed_before_execution() -> None:
    async def main() -> None:
        ex = GatedExecutor()
        rec = Recorder()
        b = Batcher(ex, config(), observer=rec, pipeline=False)
        first = asyncio.ensure_future(b.submit(1, 4))
        await wait_thread_event(ex.started)
        doomed = asyncio.ensure_future(b.submit(99, 4))
        await asyncio.sleep(0)  # let it enqueue
        assert b.scheduler.num_waiting == 1
        doomed.cancel()
        with pytest.raises(asyncio.CancelledError):
            await doomed
        assert b.scheduler.num_waiting == 0 and rec.cancels == [True]
        ex.gate.set()
        assert await first == 2
        assert await b.submit(3, 4) == 6
        assert all(99 not in r for r in ex.runs)
        assert b.num_pending == 0
        await b.shutdown()

    run(main())


def test_cancelled_while_running_discards_only_its_result() -> None:
    async def main() -> None:
        ex = GatedExecutor()
        rec = Recorder()
        b = Batcher(ex, config(), observer=rec, pipeline=False)
        tasks = [asyncio.ensure_future(b.submit(i, 4)) for i in range(3)]
        await wait_thread_event(ex.started)
        tasks[1].cancel()
        await asyncio.sleep(0)
        ex.gate.set()
        assert await tasks[0] == 0 and await tasks[2] == 4
        assert tasks[1].cancelled() and rec.cancels == [False]
        assert b.num_pending == 0
        await b.shutdown()

    run(main())


@pytest.mark.parametrize("poison", [frozenset({5}), frozenset({0, 13}), frozenset(range(16))])
def test_poison_requests_fail_alone_and_the_batcher_keeps_serving(poison: frozenset[int]) -> None:
    async def main() -> None:
        ex = GatedExecutor(gated=0, poison=poison)
        b = Batcher(ex, config(max_batch_size=16))
        out = await asyncio.gather(*(b.submit(i, 4) for i in range(16)), return_exceptions=True)
        for i, res in enumerate(out):
            if i in poison:
                assert isinstance(res, ExecutionError) and isinstance(res.__cause__, RuntimeError)
            else:
                assert res == 2 * i
        assert await b.submit(100, 4) == 200
        await b.shutdown()

    run(main())


def test_executor_crash_is_recovered_while_health_reports_degraded() -> None:
    class Crashy:
        def __init__(self) -> None:
            self.crashes = 1
            self.recovered = 0

        def prepare(self, batch: Batch) -> list[int]:
            return [r.payload for r in batch.requests]

        def run(self, xs: list[int]) -> list[int]:
            if self.crashes:
                self.crashes -= 1
                raise ExecutorCrashed("device lost")
            return xs

        def recover(self) -> None:
            self.recovered += 1

    async def main() -> None:
        ex, rec = Crashy(), Recorder()
        b = Batcher(ex, config(), observer=rec)
        assert await asyncio.gather(*(b.submit(i, 4) for i in range(4))) == [0, 1, 2, 3]
        assert ex.recovered == 1 and rec.health == ["degraded", "ok"] and b.health == "ok"
        await b.shutdown()

    run(main())


def test_rejections_are_typed_with_the_core_reason() -> None:
    async def main() -> None:
        rec = Recorder()
        b = Batcher(CallableExecutor(lambda xs: xs), config(max_length=16), observer=rec)
        with pytest.raises(RequestRejected) as err:
            await b.submit("long", 17)
        assert err.value.reason is RejectReason.TOO_LONG and rec.rejects == [RejectReason.TOO_LONG]
        await b.shutdown()

    run(main())


def test_expired_deadline_is_dropped_from_the_queue() -> None:
    async def main() -> None:
        ex = GatedExecutor()
        b = Batcher(ex, config(), pipeline=False)
        first = asyncio.ensure_future(b.submit(1, 4))
        await wait_thread_event(ex.started)
        late = asyncio.ensure_future(b.submit(2, 4, deadline=b.clock() - 1.0))  # already expired
        await asyncio.sleep(0)
        ex.gate.set()
        assert await first == 2
        with pytest.raises(RequestRejected) as err:
            await late
        assert err.value.reason in (RejectReason.DEADLINE_EXPIRED, RejectReason.INFEASIBLE_DEADLINE)
        await b.shutdown()

    run(main())


def test_shutdown_stops_admission_and_drains_accepted_work() -> None:
    async def main() -> None:
        ex = GatedExecutor()
        rec = Recorder()
        b = Batcher(ex, config(), observer=rec, pipeline=False)
        tasks = [asyncio.ensure_future(b.submit(i, 4)) for i in range(5)]
        await wait_thread_event(ex.started)
        stopping = asyncio.ensure_future(b.shutdown(drain_timeout=WAIT))
        await asyncio.sleep(0)
        assert b.health == "draining"
        with pytest.raises(RequestRejected) as err:
            await b.submit(50, 4)
        assert err.value.reason is RejectReason.SHUTTING_DOWN and err.value.retry_after_s
        ex.gate.set()
        await stopping
        assert [t.result() for t in tasks] == [0, 2, 4, 6, 8]
        assert b.health == "stopped" and rec.health == ["draining", "stopped"]

    run(main())


def test_shutdown_after_the_drain_timeout_fails_what_is_left() -> None:
    async def main() -> None:
        ex = GatedExecutor()
        b = Batcher(ex, config(), pipeline=False)
        tasks = [asyncio.ensure_future(b.submit(i, 4)) for i in range(3)]
        await wait_thread_event(ex.started)
        await b.shutdown(drain_timeout=0.01)
        for t in tasks:
            with pytest.raises(RequestRejected) as err:
                await t
            assert err.value.reason is RejectReason.SHUTTING_DOWN
        assert b.num_pending == 0 and b.scheduler.num_waiting == 0
        ex.gate.set()  # release the worker thread

    run(main())


def test_async_executor_runs_on_the_loop() -> None:
    async def double(xs: list[int]) -> list[int]:
        await asyncio.sleep(0)
        return [2 * x for x in xs]

    async def main() -> None:
        b = Batcher(AsyncCallableExecutor(double), config(max_batch_size=4))
        assert await asyncio.gather(*(b.submit(i, 1) for i in range(10))) == [2 * i for i in range(10)]
        await b.shutdown()

    run(main())


def test_wrong_result_count_fails_the_batch_not_the_batcher() -> None:
    async def main() -> None:
        calls = {"n": 0}

        def short(xs: list[int]) -> list[int]:
            calls["n"] += 1
            return xs[:-1] if len(xs) > 1 and calls["n"] == 1 else xs

        b = Batcher(CallableExecutor(short), config(max_batch_size=4))
        out = await asyncio.gather(*(b.submit_nowait(i, 1) for i in range(4)), return_exceptions=True)
        assert out == [0, 1, 2, 3]  # bisection retried the halves, which the executor got right
        await b.shutdown()

    run(main())
