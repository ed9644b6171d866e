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
cause it (bisection); ``shutdown`` stops admission, drains, then fails what is left.

Sections, in order: the observer hooks the Batcher calls (``BatcherObserver``), the Batcher, how it
runs a dispatched batch on its slot (prepare, run, bisect, recover), and its watchdog.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from batchpilot.core.admission import RejectReason
from batchpilot.core.batch import Batch
from batchpilot.core.config import SchedulerConfig
from batchpilot.core.costmodel import BatchShape, CostModel
from batchpilot.core.request import DEFAULT_TENANT, IdCounter, Request
from batchpilot.core.scheduler import BatchScheduler
from batchpilot.core.stall import StallRule, StallWatch
from batchpilot.runtime.errors import ExecutionError, ExecutorCrashed, RequestRejected
from batchpilot.runtime.executor import Executor
from batchpilot.runtime.pipeline import Slot

# -- Observer hooks --------------------------------------------------------------------------------
# Hooks the Batcher calls at each step of a request's life, so metrics live outside the driver.
#
# The server's Prometheus metrics subclass this; the default does nothing. Every hook runs on the event
# loop thread and must be cheap (it sits on the per-request path).

class BatcherObserver:
    def on_admit(self, request: Request) -> None:
        """The scheduler accepted the request into its queue."""

    def on_reject(self, reason: RejectReason, tenant: str = DEFAULT_TENANT) -> None:
        """Rejected at admission (a tenant's quota included), dropped from the queue (expired deadline)
        or failed at shutdown; ``tenant``: whose request it was."""

    def on_dispatch(self, batch: Batch, now: float) -> None:
        """A batch left the queue (queue time of each request is ``now - request.arrival``)."""

    def on_batch_done(self, batch: Batch, run_s: float, ok: bool) -> None:
        """An executor call finished; ``run_s`` is its wall time (bisection retries report too)."""

    def on_request_done(self, request: Request, latency_s: float, ok: bool) -> None:
        """A request's result or error was delivered; ``latency_s`` is from arrival to delivery."""

    def on_cancel(self, request: Request, queued: bool) -> None:
        """The caller gave up; ``queued``: removed before execution (else its result is discarded)."""

    def on_slot_busy(self, slot: int, busy: bool) -> None:
        """A slot started or stopped executing (for utilisation)."""

    def on_health(self, state: str) -> None:
        """The Batcher's health changed: ok, degraded, draining or stopped."""


log = logging.getLogger("batchpilot.runtime")

SHUTDOWN_RETRY_AFTER_S = 5.0


class _Pending:
    __slots__ = ("request", "future", "batch_id", "times")

    def __init__(self, request: Request, future: asyncio.Future[Any], times: StageTimes | None) -> None:
        self.request = request
        self.future = future
        self.batch_id: int | None = None  # None while queued
        self.times = times


class Batcher:
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
                            times: StageTimes | None = None, tenant: str = DEFAULT_TENANT
                            ) -> list[asyncio.Future[Any]]:
        """One request of several inputs, admitted or refused as a whole by the core
        (``BatchScheduler.submit_group``): a future per input, or ``RequestRejected`` for all of them.
        Cancelling a future withdraws its input. ``times``, if given, is filled in as the inputs go
        through (``StageTimes``). ``tenant``: who the request is for (its quotas, its fair share).
        Must be called on the event loop thread."""
        pairs = self._enqueue_group(payloads, lengths, priority, deadline, sla, times, tenant)
        for rid, future in pairs:
            future.add_done_callback(functools.partial(self._withdraw_if_cancelled, rid))
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
            self.observer.on_reject(RejectReason.SHUTTING_DOWN, pending.request.tenant)
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
    def check_tenant(self, tenant: str, tokens: int) -> None:
        """Raise ``RequestRejected`` when ``tenant`` is over a quota for a request of at least ``tokens``
        tokens (``BatchScheduler.check_tenant``: charges nothing); what a server asks before it
        tokenises."""
        rejection = self.scheduler.check_tenant(tenant, tokens, self.clock())
        if rejection is not None:
            self.observer.on_reject(rejection.reason, tenant)
            raise RequestRejected.from_rejection(rejection)

    def _enqueue_group(self, payloads: list[Any], lengths: list[int], priority: int,
                       deadline: float | None, sla: float | None,
                       times: StageTimes | None = None, tenant: str = DEFAULT_TENANT
                       ) -> list[tuple[int, asyncio.Future[Any]]]:
        if not self._accepting:
            self.observer.on_reject(RejectReason.SHUTTING_DOWN, tenant)
            raise RequestRejected(RejectReason.SHUTTING_DOWN, "the server is shutting down",
                                  SHUTDOWN_RETRY_AFTER_S)
        if self._task is None:
            self._start()
        now = self.clock()
        reqs = [Request(self._ids(), now, length, priority, deadline, sla, payload, tenant=tenant)
                for payload, length in zip(payloads, lengths, strict=True)]
        rejection = self.scheduler.submit_group(reqs, now)
        if rejection is not None:
            self.observer.on_reject(rejection.reason, tenant)
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

    def _withdraw_if_cancelled(self, rid: int, future: asyncio.Future[Any]) -> None:
        if future.cancelled():
            self._cancel(rid)

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
            self.observer.on_reject(rej.reason, rej.request.tenant)
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

    # -- execution: prepare, run, bisect on failure, recover -----------------------------------
    async def _prepare(self, pool: Any, batch: Batch) -> tuple[Any, Exception | None]:
        try:
            return await asyncio.get_running_loop().run_in_executor(pool, self.executor.prepare, batch), None
        except Exception as exc:
            return None, exc

    async def _execute(self, slot: Slot, batch: Batch) -> None:
        reported = False  # the scheduler counts a dispatched batch as backlog until it hears of it once
        try:
            if not self._run_is_async and slot.running is None and not slot.run_lock.locked():
                prepared, prep_exc = _NOT_YET, None  # idle slot: nothing to overlap, one hop
            else:
                prepared, prep_exc = await self._prepare(slot.prepare_pool, batch)
            async with slot.run_lock:
                if not any(r.id in self._pending for r in batch.requests):  # everyone left
                    slot.next = None
                    self._wake.set()
                    return
                started = self.clock()
                slot.on_run_start(batch, started, self.scheduler.next_batch_at(batch, started))
                self._mark(batch, started, "run_start")
                self.observer.on_slot_busy(slot.index, True)
                self._wake.set()
                try:
                    await self._run_isolating(slot, batch, prepared, prep_exc, may_recover=True)
                finally:
                    now = self.clock()
                    took = slot.on_run_end(batch, now)
                    self.observer.on_slot_busy(slot.index, False)
                    reported = True
                    self.scheduler.on_batch_done(batch, now, took)
                    self._wake.set()
                    for observe in self.batch_observers:
                        try:
                            observe(batch, now - took, took)
                        except Exception:  # a log that cannot be written must not stop the others
                            log.exception("batch observer %r failed", observe)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a runtime bug: answer the batch's callers, never leave them hanging
            log.exception("batch %d failed outside the executor", batch.id)
            for r in batch.requests:
                self._finish(r.id, exc=ExecutionError(f"internal error: {exc}"))
        finally:
            if not reported:
                self.scheduler.on_batch_done(batch, self.clock(), 0.0, ran=False)

    def _mark(self, batch: Batch, t: float, stage: str) -> None:
        for r in batch.requests:
            p = self._pending.get(r.id)
            if p is not None and p.times is not None:
                setattr(p.times, stage, t)

    def _prepare_then_run(self, batch: Batch) -> tuple[list[Any], float]:
        """An idle slot's single hop (on the run thread): collate, then run; returns the results and
        when the run began, so the slot's time excludes the collation as it does on the two-stage path."""
        prepared = self.executor.prepare(batch)
        began = self.clock()
        return list(self.executor.run(prepared)), began

    async def _call_run(self, slot: Slot, batch: Batch, prepared: Any) -> list[Any]:
        if self._run_is_async:
            return list(await self.executor.run(prepared))  # type: ignore[misc]
        loop = asyncio.get_running_loop()
        if prepared is _NOT_YET:
            t0 = self.clock()
            results, began = await loop.run_in_executor(slot.run_pool, self._prepare_then_run, batch)
            slot.run_started += began - t0  # the collation is not the run (the slot's busy time)
            self._mark(batch, slot.run_started, "run_start")
            return results
        return list(await loop.run_in_executor(slot.run_pool, self.executor.run, prepared))

    async def _run_isolating(self, slot: Slot, batch: Batch, prepared: Any, prep_exc: Exception | None,
                             may_recover: bool) -> None:
        """Run; on failure bisect until each failing request is alone, so only poison requests fail."""
        t0 = self.clock()
        try:
            if prep_exc is not None:
                raise prep_exc
            results = await self._call_run(slot, batch, prepared)
            if len(results) != batch.size:
                raise ValueError(f"executor returned {len(results)} results for a batch of {batch.size}")
        except ExecutorCrashed as exc:
            self.observer.on_batch_done(batch, self.clock() - t0, False)
            if may_recover and await self._recover(slot, exc):
                prepared, prep_exc = await self._prepare(slot.run_pool, batch)
                await self._run_isolating(slot, batch, prepared, prep_exc, may_recover=False)
                return
            for r in batch.requests:
                self._finish(r.id, exc=ExecutionError(f"the executor crashed: {exc}"))
            return
        except Exception as exc:
            self.observer.on_batch_done(batch, self.clock() - t0, False)
            if batch.size == 1:
                log.warning("request %d failed in the executor: %r", batch.requests[0].id, exc)
                err = ExecutionError(f"the model failed on this input: {type(exc).__name__}: {exc}")
                err.__cause__ = exc
                self._finish(batch.requests[0].id, exc=err)
                return
            live = [r for r in batch.requests if r.id in self._pending]  # cancelled ones need no answer
            mid = len(live) // 2
            for half in (live[:mid], live[mid:]) if mid else ([live] if live else []):
                sub = self._sub_batch(batch, half)
                sub_prepared, sub_exc = await self._prepare(slot.run_pool, sub)
                await self._run_isolating(slot, sub, sub_prepared, sub_exc, may_recover)
            return
        self.observer.on_batch_done(batch, self.clock() - t0, True)
        if self.health == "degraded":
            self._set_health("ok")
        self._deliver(batch, results)

    def _sub_batch(self, batch: Batch, requests: list[Request]) -> Batch:
        """A retry of part of ``batch``: same id and padded length (valid for every padding mode)."""
        lengths = [r.length for r in requests]
        if batch.padding == "none":
            shape = BatchShape.ragged(lengths)
        else:
            shape = BatchShape.padded(lengths, batch.padded_len)
        return Batch(batch.id, requests, shape.padded_len, shape, batch.padding, batch.formed_at,
                     self.cost_model.latency(shape))

    async def _recover(self, slot: Slot, exc: Exception) -> bool:
        self._set_health("degraded")
        recover = getattr(self.executor, "recover", None)
        log.error("executor crashed (%r); %s", exc, "recovering" if recover else "it has no recover()")
        if recover is None:
            return False
        try:
            await asyncio.get_running_loop().run_in_executor(slot.run_pool, recover)
        except Exception:
            log.exception("executor recovery failed; health stays degraded")
            return False
        return True



# -- Running a batch on its slot -------------------------------------------------------------------
# How the Batcher runs a dispatched batch on its slot: prepare, run, bisect on failure, recover.
#
#     busy slot (a batch runs):  prepare on the slot's prepare thread ──▶ wait for the run stage ──▶ run
#     idle slot:                 prepare + run in one call on the run thread (one hand-off, not two)
#
# Pipelining buys overlap only while another batch runs: then the next batch's collation happens on
# the prepare thread meanwhile. On an idle slot there is nothing to overlap with, so the batch takes a
# single thread hop (what a request at light load pays). ``StageTimes`` records, per request, when its
# (last) batch was dispatched and ran, for the server's ``Server-Timing`` header.
#


_NOT_YET = object()  # "prepare inside the run call" (an idle slot's single hop)


@dataclass(slots=True)
class StageTimes:
    """One request's times in the Batcher (``clock`` seconds). For a request whose inputs ran in
    several batches, the last batch's: ``dispatched`` when the core put it in a batch, ``run_start``
    and ``run_end`` around the executor's run of that batch (its collation excluded)."""

    admitted: float = math.nan
    dispatched: float = math.nan
    run_start: float = math.nan
    run_end: float = math.nan

    @property
    def queue_s(self) -> float:
        return self.dispatched - self.admitted

    @property
    def prepare_s(self) -> float:
        """Dispatch to run start: collation, thread hand-offs, and waiting for the slot's run stage."""
        return self.run_start - self.dispatched

    @property
    def run_s(self) -> float:
        return self.run_end - self.run_start




# -- The watchdog ----------------------------------------------------------------------------------
# The encoder Batcher's watchdog: a slot whose batch has run past the stall bound is a stall.
#
# The bound is the stall rule of ``core.stall`` over the Batcher's own measured batch times (each
# batch's slot seconds, from ``batch_observers``), or a fixed ``timeout_s``. ``check`` runs on the event
# loop (slot state is the loop's): while a slot runs a batch past the bound ``stuck`` is true (the
# server's ``/health`` answers 503 ``degraded``; ``batchpilot_executor_stalled`` reads 1), and each
# stuck batch counts one stall (``num_stalls``); ``stuck`` clears when no slot is past the bound. It
# is its own flag, apart from the Batcher's health (a crash's ``degraded``): a batch finishing on
# another slot does not clear a stall, and a stall ending does not clear a crash. The
# requests of a stuck batch wait for it (their deadline still ends them): a thread cannot be taken back
# from a model call, so nothing is re-run behind its back. ``start`` checks every ``poll_s``.



class BatcherWatchdog:
    def __init__(self, batcher: Any, rule: StallRule | None = None, poll_s: float = 0.1) -> None:
        self.batcher = batcher
        self.poll_s = poll_s
        self._watch = StallWatch(rule)
        self._counted: set[int] = set()  # stuck batches already counted
        self.stuck = False  # a slot is past the bound now
        self._task: asyncio.Task[None] | None = None
        self.num_stalls = 0
        batcher.batch_observers.append(self._on_batch)

    def _on_batch(self, batch: Any, start: float, seconds: float) -> None:
        self._watch.record(seconds)

    def timeout_s(self) -> float:
        return self._watch.timeout_s()

    def check(self, now: float | None = None) -> list[int]:
        """The slots whose batch is past the bound (``now`` on the Batcher's clock); sets ``stuck``."""
        b = self.batcher
        now = b.clock() if now is None else now
        stuck = [s for s in b.slots if s.running is not None and self._watch.overdue_s(s.run_started, now)]
        for slot in stuck:
            if slot.running.id not in self._counted:
                self._counted.add(slot.running.id)
                self.num_stalls += 1
                log.error("encoder slot %d: batch %d has run %.1f s, past the stall bound of %.1f s",
                          slot.index, slot.running.id, now - slot.run_started, self._watch.timeout_s())
        if not stuck and self.stuck:
            self._counted.clear()
            log.info("encoder slots: no batch past the stall bound any more")
        self.stuck = bool(stuck)
        return [s.index for s in stuck]

    def start(self) -> BatcherWatchdog:
        """Check every ``poll_s`` on the running event loop, until ``stop``."""
        async def watch() -> None:
            while True:
                await asyncio.sleep(self.poll_s)
                self.check()

        self._task = asyncio.get_running_loop().create_task(watch(), name="batchpilot-batcher-watchdog")
        return self

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
