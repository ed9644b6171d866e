"""The encoder Batcher's watchdog: a slot whose batch has run past the stall bound is a stall.

The bound is the stall rule of ``core.stall`` over the Batcher's own measured batch times (each
batch's slot seconds, from ``batch_observers``), or a fixed ``timeout_s``. ``check`` runs on the event
loop (slot state is the loop's): while a slot runs a batch past the bound ``stuck`` is true (the
server's ``/health`` answers 503 ``degraded``; ``batchpilot_executor_stalled`` reads 1), and each
stuck batch counts one stall (``num_stalls``); ``stuck`` clears when no slot is past the bound. It
is its own flag, apart from the Batcher's health (a crash's ``degraded``): a batch finishing on
another slot does not clear a stall, and a stall ending does not clear a crash. The
requests of a stuck batch wait for it (their deadline still ends them): a thread cannot be taken back
from a model call, so nothing is re-run behind its back. ``start`` checks every ``poll_s``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from batchpilot.core.stall import StallRule, StallWatch

log = logging.getLogger("batchpilot.runtime")


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
