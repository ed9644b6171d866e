"""The live driver: an asyncio Batcher that feeds the scheduling core with the real clock.

    submit() ──▶ scheduler.submit(req, now) ──▶ future
                       │ wake
    driver task: schedule(now, free_slots) ─▶ batches ─▶ Slot: prepare (thread) ─▶ run (thread) ─▶ futures
                 sleeps until wake_at, a submit, or a slot change — never polls

One background task owns every scheduling decision; it calls ``schedule`` whenever a request arrives,
a slot changes state, or the plan's ``wake_at`` passes (a ``call_later`` that sets the wake event).
The core decides everything; this file only moves data between the core and the executor threads.

Guarantees: every accepted request's future completes exactly once (result, ``RequestRejected`` or
``ExecutionError``); a cancelled caller is removed from the queue before execution (or its result is
discarded if its batch is already running); an exception in a batch reaches only the request(s) that
cause it (bisection); ``shutdown`` stops admission, drains, then fails what is left. How a batch runs
on its slot (prepare, run, bisect, recover) is ``runtime/execution.py``.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import Callable
from typing import Any

from batchpilot.core.config import SchedulerConfig
from batchpilot.core.costmodel import CostModel
from batchpilot.core.request import IdCounter, Request
from batchpilot.core.scheduler import Batch, BatchScheduler, RejectReason
from batchpilot.runtime.errors import ExecutionError, RequestRejected
from batchpilot.runtime.execution import BatchExecution, StageTimes
from batchpilot.runtime.executor import Executor
from batchpilot.runtime.observer import BatcherObserver
from batchpilot.runtime.pipeline import Slot

log = logging.getLogger("batchpilot.runtime")

SHUTDOWN_RETRY_AFTER_S = 5.0


class _Pending:
    __slots__ = ("request", "future", "batch_id", "times")

    def __init__(self, request: Request, future: asyncio.Future[Any], times: StageTimes | None) -> None:
        self.request = request
        self.future = future
        self.batch_id: int | None = None  # None while queued
        self.times = times


class Batcher(BatchExecution):
    """``await batcher.submit(payload, length)`` returns the executor's result for that payload."""

    def __init__(self, executor: Executor, config: SchedulerConfig | None = None,
                 cost_model: CostModel | None = None, *, scheduler: Any = None,
                 observer: BatcherObserver | None = None, pipeline: bool = True,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.executor = executor
        self.config = config or SchedulerConfig()
        self.cost_model = cost_model or CostModel.default_cpu_minilm()
        self.scheduler = scheduler or BatchScheduler(self.config, self.cost_model)
        self.observer = observer or BatcherObserver()
        self._observe_admit = type(self.observer).on_admit is not BatcherObserver.on_admit  # hot path
        # called (batch, start, slot seconds) after each batch that ran, on the event loop: the slot's
        # busy time per batch, what the simulator's cost model stands for (``BatchLog`` writes it out)
        self.batch_observers: list[Callable[[Batch, float, float], None]] = []
        self.clock = clock
        self.slots = [Slot(i, pipeline) for i in range(self.config.num_slots)]
        self._run_is_async = inspect.iscoroutinefunction(executor.run)
        self._pending: dict[int, _Pending] = {}
        self._ids = IdCounter()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._work: set[asyncio.Task[None]] = set()
        self._accepting = True
        self._drained: asyncio.Event | None = None
        self.health = "ok"

    # -- public API --------------------------------------------------------------------------
    async def submit(self, payload: Any, length: int, priority: int = 0, deadline: float | None = None,
                     sla: float | None = None) -> Any:
        """Queue one input and wait for its result. ``deadline`` is absolute on ``clock`` (time.monotonic by
        default), ``sla`` relative seconds. Raises ``RequestRejected`` (with the core's reason and a
        ``retry_after_s``), or ``ExecutionError`` if the model failed on this input."""
        rid, future = self._enqueue_group([payload], [length], priority, deadline, sla)[0]
        try:
            return await future
        except asyncio.CancelledError:
            self._cancel(rid)
            raise

    def submit_nowait(self, payload: Any, length: int, priority: int = 0, deadline: float | None = None,
                      sla: float | None = None) -> asyncio.Future[Any]:
        """Like ``submit`` but returns the future at once (no task per request: for bulk producers).
        Cancelling the future withdraws the request. Must be called on the event loop thread."""
        return self.submit_group_nowait([payload], [length], priority, deadline, sla)[0]

    def submit_group_nowait(self, payloads: list[Any], lengths: list[int], priority: int = 0,
                            deadline: float | None = None, sla: float | None = None,
                            times: StageTimes | None = None) -> list[asyncio.Future[Any]]:
        """One request of several inputs, admitted or refused as a whole by the core
        (``BatchScheduler.submit_group``): a future per input, or ``RequestRejected`` for all of them.
        Cancelling a future withdraws its input. ``times``, if given, is filled in as the inputs go
        through (``StageTimes``). Must be called on the event loop thread."""
        pairs = self._enqueue_group(payloads, lengths, priority, deadline, sla, times)
        for rid, future in pairs:
            future.add_done_callback(lambda f, rid=rid: self._cancel(rid) if f.cancelled() else None)
        return [f for _, f in pairs]

    @property
    def num_pending(self) -> int:
        """Accepted and not yet answered (queued or in a batch)."""
        return len(self._pending)

    @property
    def num_running(self) -> int:
        return sum(s.running is not None for s in self.slots)

    async def shutdown(self, drain_timeout: float = 30.0) -> None:
        """Stop admission, let queued and running work finish for up to ``drain_timeout`` s, fail the rest."""
        if self.health == "stopped":
            return
        self._accepting = False
        self._set_health("draining")
        if self._pending and self._task is not None:
            self._drained = asyncio.Event()
            try:
                await asyncio.wait_for(self._drained.wait(), drain_timeout)
            except TimeoutError:
                log.warning("shutdown: %d requests still pending after %.1f s; failing them",
                            len(self._pending), drain_timeout)
        now = self.clock()
        for rid, pending in list(self._pending.items()):
            if pending.batch_id is None:
                self.scheduler.cancel(rid, now)
            self.observer.on_reject(RejectReason.SHUTTING_DOWN)
            self._finish(rid, exc=RequestRejected(RejectReason.SHUTTING_DOWN, "the server is shutting down"))
        for task in [self._task, *self._work]:
            if task is not None:
                task.cancel()
        if self._task is not None:
            await asyncio.gather(self._task, *self._work, return_exceptions=True)
        for slot in self.slots:
            slot.close()
        self._set_health("stopped")

    # -- admission ---------------------------------------------------------------------------
    def _enqueue_group(self, payloads: list[Any], lengths: list[int], priority: int,
                       deadline: float | None, sla: float | None,
                       times: StageTimes | None = None) -> list[tuple[int, asyncio.Future[Any]]]:
        if not self._accepting:
            self.observer.on_reject(RejectReason.SHUTTING_DOWN)
            raise RequestRejected(RejectReason.SHUTTING_DOWN, "the server is shutting down",
                                  SHUTDOWN_RETRY_AFTER_S)
        if self._task is None:
            self._start()
        now = self.clock()
        reqs = [Request(self._ids(), now, length, priority, deadline, sla, payload)
                for payload, length in zip(payloads, lengths, strict=True)]
        rejection = self.scheduler.submit_group(reqs, now)
        if rejection is not None:
            self.observer.on_reject(rejection.reason)
            raise RequestRejected.from_rejection(rejection)
        if times is not None:
            times.admitted = now
        out = []
        loop = self._loop
        assert loop is not None
        for req in reqs:
            future: asyncio.Future[Any] = loop.create_future()
            self._pending[req.id] = _Pending(req, future, times)
            if self._observe_admit:
                self.observer.on_admit(req)
            out.append((req.id, future))
        self._wake.set()
        return out

    def _start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._task = self._loop.create_task(self._drive(), name="batchpilot-driver")

    def _cancel(self, rid: int) -> None:
        pending = self._pending.pop(rid, None)
        if pending is None:
            return
        queued = pending.batch_id is None
        if queued:
            self.scheduler.cancel(rid, self.clock())
            self._wake.set()
        self.observer.on_cancel(pending.request, queued)
        self._check_drained()

    # -- the driver --------------------------------------------------------------------------
    async def _drive(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self._wake.clear()
            now = self.clock()
            wake_at: float | None = None
            try:
                wake_at = self._schedule_once(now)
            except Exception:  # a core bug must not hang every caller: fail the queue, keep driving
                log.exception("scheduler error; failing the queued requests")
                for rid, p in list(self._pending.items()):
                    if p.batch_id is None:
                        self.scheduler.cancel(rid, now)
                        self._finish(rid, exc=ExecutionError("internal scheduling error"))
            handle = None
            if wake_at is not None:
                handle = loop.call_later(max(wake_at - self.clock(), 0.0), self._wake.set)
            await self._wake.wait()
            if handle is not None:
                handle.cancel()

    def _schedule_once(self, now: float) -> float | None:
        free = sorted((s for s in self.slots if s.accepts(now)), key=lambda s: not s.is_idle)
        out = self.scheduler.schedule(now, len(free))
        for rej in out.dropped:
            self.observer.on_reject(rej.reason)
            self._finish(rej.request.id, exc=RequestRejected.from_rejection(rej))
        for slot, batch in zip(free, out.batches, strict=False):
            self._dispatch(slot, batch, now)
        wake_at = out.wake_at if len(free) > len(out.batches) else None
        if self.scheduler.num_waiting:
            for slot in self.slots:
                t = slot.accept_time()
                if t is not None and t > now:
                    wake_at = t if wake_at is None else min(wake_at, t)
        return wake_at

    def _dispatch(self, slot: Slot, batch: Batch, now: float) -> None:
        for r in batch.requests:
            p = self._pending.get(r.id)
            if p is not None:
                p.batch_id = batch.id
                if p.times is not None:
                    p.times.dispatched = now
        self.observer.on_dispatch(batch, now)
        slot.next = batch
        task = asyncio.get_running_loop().create_task(self._execute(slot, batch))
        self._work.add(task)
        task.add_done_callback(self._work.discard)

    # -- completion --------------------------------------------------------------------------
    def _finish(self, rid: int, result: Any = None, exc: BaseException | None = None) -> None:
        pending = self._pending.pop(rid, None)
        if pending is None:  # cancelled meanwhile: the result is discarded
            return
        if not pending.future.done():
            if exc is None:
                pending.future.set_result(result)
            else:
                pending.future.set_exception(exc)
            req = pending.request
            self.observer.on_request_done(req, self.clock() - req.arrival, exc is None)
        self._check_drained()

    def _deliver(self, batch: Batch, results: list[Any]) -> None:
        """``_finish`` for a whole successful batch (the hot path: one clock read, no per-item calls)."""
        now = self.clock()
        pending_map, done_hook = self._pending, self.observer.on_request_done
        for r, res in zip(batch.requests, results, strict=True):
            pending = pending_map.pop(r.id, None)
            if pending is not None and not pending.future.done():
                pending.future.set_result(res)
                done_hook(r, now - r.arrival, True)
                if pending.times is not None:
                    pending.times.run_end = now
        self._check_drained()

    def _check_drained(self) -> None:
        if self._drained is not None and not self._pending:
            self._drained.set()

    def _set_health(self, state: str) -> None:
        if state != self.health:
            self.health = state
            self.observer.on_health(state)
