"""How the Batcher runs a dispatched batch on its slot: prepare, run, bisect on failure, recover.

    busy slot (a batch runs):  prepare on the slot's prepare thread ──▶ wait for the run stage ──▶ run
    idle slot:                 prepare + run in one call on the run thread (one hand-off, not two)

Pipelining buys overlap only while another batch runs: then the next batch's collation happens on
the prepare thread meanwhile. On an idle slot there is nothing to overlap with, so the batch takes a
single thread hop (what a request at light load pays). ``StageTimes`` records, per request, when its
(last) batch was dispatched and ran, for the server's ``Server-Timing`` header.

A mixin of ``Batcher`` (``runtime/batcher.py``): it uses the Batcher's pending map, observer and
scheduler, and answers callers through ``_finish`` / ``_deliver``.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from batchpilot.core.costmodel import BatchShape, CostModel
from batchpilot.core.request import Request
from batchpilot.core.scheduler import Batch, BatchScheduler
from batchpilot.runtime.errors import ExecutionError, ExecutorCrashed
from batchpilot.runtime.executor import Executor
from batchpilot.runtime.observer import BatcherObserver
from batchpilot.runtime.pipeline import Slot

log = logging.getLogger("batchpilot.runtime")

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


class BatchExecution:
    """The execution half of ``Batcher``."""

    executor: Executor
    scheduler: BatchScheduler
    cost_model: CostModel
    observer: BatcherObserver
    batch_observers: list[Callable[[Batch, float, float], None]]
    clock: Callable[[], float]
    health: str
    _pending: dict[int, Any]
    _run_is_async: bool
    _wake: asyncio.Event

    def _finish(self, rid: int, result: Any = None, exc: BaseException | None = None) -> None:
        raise NotImplementedError

    def _deliver(self, batch: Batch, results: list[Any]) -> None:
        raise NotImplementedError

    def _set_health(self, state: str) -> None:
        raise NotImplementedError

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
