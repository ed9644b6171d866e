"""An executor slot: a two-stage pipeline (prepare, run) with its own worker threads.

    batch N   : [prepare]──[========= run =========]
    batch N+1 :                       [prepare]────[========= run =========]
                                      ^ accepts() turns true here: expected end of N minus the lead

Collation of the next batch (``executor.prepare``) runs on the slot's prepare thread while the current
batch runs on the run thread, so collation is off the critical path. The slot only asks the scheduler
for its next batch shortly before the current one is expected to finish (``lead_s`` ahead), not as soon
as it starts: forming the next batch early would cut it off from the requests that arrive meanwhile,
and batching gains come from exactly those. The expected end is the cost model's prediction corrected
by the running ratio of measured to predicted time, so a miscalibrated profile does not form batches
early; if the prediction is late the slot simply becomes free when the run ends (no overlap, no harm).
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from ..core.scheduler import Batch

_EWMA = 0.2
_MIN_LEAD_S = 0.0005  # covers the thread hand-off even when prepare is nearly free


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
        self.expected_end = 0.0
        self.prepare_s = 0.0  # EWMA of prepare wall time
        self.ratio = 1.0  # EWMA of measured / predicted run time
        self.run_s = 0.0  # EWMA of run time, used when the batch carries no prediction
        self._run_lock: asyncio.Lock | None = None

    @property
    def run_lock(self) -> asyncio.Lock:
        if self._run_lock is None:  # created lazily: it binds to the running loop
            self._run_lock = asyncio.Lock()
        return self._run_lock

    @property
    def lead_s(self) -> float:
        return max(2.0 * self.prepare_s, _MIN_LEAD_S)

    @property
    def is_idle(self) -> bool:
        return self.running is None and self.next is None

    def accepts(self, now: float) -> bool:
        """Can the scheduler hand this slot a batch now?"""
        if self.next is not None:
            return False
        if self.running is None:
            return True
        return self.pipeline and now >= self.expected_end - self.lead_s

    def accept_time(self) -> float | None:
        """When a busy slot will start accepting (a wake-up time for the driver), else None."""
        if not self.pipeline or self.running is None or self.next is not None:
            return None
        return self.expected_end - self.lead_s

    def on_prepared(self, seconds: float) -> None:
        self.prepare_s = seconds if self.prepare_s == 0.0 else (1 - _EWMA) * self.prepare_s + _EWMA * seconds

    def on_run_start(self, batch: Batch, now: float) -> None:
        self.next = None
        self.running = batch
        self.run_started = now
        expected = batch.predicted_s * self.ratio if batch.predicted_s > 0 else self.run_s
        self.expected_end = now + expected

    def on_run_end(self, batch: Batch, now: float) -> float:
        took = now - self.run_started
        if batch.predicted_s > 0:
            self.ratio = (1 - _EWMA) * self.ratio + _EWMA * (took / batch.predicted_s)
        self.run_s = took if self.run_s == 0.0 else (1 - _EWMA) * self.run_s + _EWMA * took
        self.running = None
        return took

    def close(self) -> None:
        self.prepare_pool.shutdown(wait=False, cancel_futures=True)
        self.run_pool.shutdown(wait=False, cancel_futures=True)
