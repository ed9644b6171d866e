"""The encoder Batcher's watchdog: a slot whose batch has run past the stall bound makes health degraded.

The bound is the stall rule of ``core.stall`` over the Batcher's own measured batch times (each
batch's slot seconds, from ``batch_observers``), or a fixed ``timeout_s``. ``check`` runs on the event
loop (slot state is the loop's): a slot still running a batch past the bound turns the Batcher's
health ``degraded`` (so ``/health`` answers 503 and ``batchpilot_health`` reads 0.5) and counts one
stall per batch (``num_stalls``); when no slot is stuck any more, health returns to ``ok``. The
requests of a stuck batch wait for it (their deadline still ends them): a thread cannot be taken back
from a model call, so nothing is re-run behind its back. ``start`` checks every ``poll_s``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from ..core.stall import StallRule, StallWatch

log = logging.getLogger("batchpilot.runtime")


class BatcherWatchdog:
    def __init__(self, batcher: Any, rule: StallRule | None = None, poll_s: float = 0.1) -> None:
        self.batcher = batcher
        self.poll_s = poll_s
        self._watch = StallWatch(rule)
        self._counted: set[int] = set()  # stuck batches already counted
        self._degraded = False  # health is degraded because of us
        self._task: asyncio.Task[None] | None = None
        self.num_stalls = 0
        batcher.batch_observers.append(self._on_batch)

    def _on_batch(self, batch: Any, start: float, seconds: float) -> None:
        self._watch.record(seconds)

    def timeout_s(self) -> float:
        return self._watch.timeout_s()

    def check(self, now: float | None = None) -> list[int]:
        """The slots whose batch is past the bound (``now`` on the Batcher's clock); sets health."""
        b = self.batcher
        now = b.clock() if now is None else now
        stuck = [s for s in b.slots if s.running is not None and self._watch.overdue_s(s.run_started, now)]
        for slot in stuck:
            if slot.running.id not in self._counted:
                self._counted.add(slot.running.id)
                self.num_stalls += 1
                log.error("encoder slot %d: batch %d has run %.1f s, past the stall bound of %.1f s",
                          slot.index, slot.running.id, now - slot.run_started, self._watch.timeout_s())
        if stuck and b.health == "ok":
            self._degraded = True
            b._set_health("degraded")
        elif not stuck and self._degraded:
            self._degraded = False
            self._counted.clear()
            if b.health == "degraded":
                b._set_health("ok")
                log.info("encoder slots: no batch past the stall bound any more; health ok")
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
