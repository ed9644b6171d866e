"""An executor slot: a two-stage pipeline (prepare, run) with its own worker threads.

    batch N   : [prepare]──[========= run =========]
    batch N+1 :                       [prepare]────[========= run =========]
                                      ^ accepts() turns true here: BatchScheduler.next_batch_at(N)

Collation of the next batch (``executor.prepare``) runs on the slot's prepare thread while the current
batch runs on the run thread, so collation is off the critical path. *When* the slot takes its next
batch is the core's decision (``BatchScheduler.next_batch_at``: the running batch's predicted end, less
the deployment's pipeline lead), so the simulator's slots take theirs at the same moments. If the
prediction is late the slot simply becomes free when the run ends (no overlap, no harm).
"""

from __future__ import annotations

import asyncio
import math
from concurrent.futures import ThreadPoolExecutor

from batchpilot.core.batch import Batch


class Slot:
    """One model instance's pipeline. All attributes are touched only on the event loop thread."""

    def __init__(self, index: int, pipeline: bool = True) -> None:
        self.index = index
        self.pipeline = pipeline
        self.prepare_pool = ThreadPoolExecutor(1, thread_name_prefix=f"batchpilot-prepare-{index}")
        self.run_pool = ThreadPoolExecutor(1, thread_name_prefix=f"batchpilot-run-{index}")
        self.running: Batch | None = None
        self.next: Batch | None = None  # dispatched to this slot, preparing or waiting for the run stage
        self.run_started = 0.0
        self.accept_at = 0.0  # when a busy slot takes its next batch (the core's next_batch_at)
        self._run_lock: asyncio.Lock | None = None

    @property
    def run_lock(self) -> asyncio.Lock:
        if self._run_lock is None:  # created lazily: it binds to the running loop
            self._run_lock = asyncio.Lock()
        return self._run_lock

    @property
    def is_idle(self) -> bool:
        return self.running is None and self.next is None

    def accepts(self, now: float) -> bool:
        """Can the scheduler hand this slot a batch now?"""
        if self.next is not None:
            return False
        if self.running is None:
            return True
        return self.pipeline and now >= self.accept_at

    def accept_time(self) -> float | None:
        """When a busy slot will start accepting (a wake-up time for the driver), else None."""
        if not self.pipeline or self.running is None or self.next is not None or self.accept_at == math.inf:
            return None
        return self.accept_at

    def on_run_start(self, batch: Batch, now: float, accept_at: float) -> None:
        self.next = None
        self.running = batch
        self.run_started = now
        self.accept_at = accept_at

    def on_run_end(self, batch: Batch, now: float) -> float:
        took = now - self.run_started
        self.running = None
        return took

    def close(self) -> None:
        self.prepare_pool.shutdown(wait=False, cancel_futures=True)
        self.run_pool.shutdown(wait=False, cancel_futures=True)
