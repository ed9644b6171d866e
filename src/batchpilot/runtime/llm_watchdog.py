"""The LLM engine's watchdog: has the engine thread died, or has the step under way run past its bound?

A step observer (``on_step``) feeds each step's wall time to the stall rule (``core.stall``); ``check``
compares the engine's ``busy_since`` (stamped by the engine thread when a step begins, cleared when
it ends) with the bound the measured step times give. Work that waits for a step that never ends is
exactly "busy past the bound": an idle engine has no step under way and is never stalled. The
failover (``runtime/llm_failover.py``) calls ``check`` from its own thread on the live clock.
"""

from __future__ import annotations

import threading
from typing import Any

from batchpilot.core.stall import StallRule, StallWatch
from batchpilot.runtime.llm_records import StepRecord

DIED, STALLED, OUT_OF_MEMORY = "died", "stalled", "oom"  # the fault kinds (metrics label ``kind``)


class EngineWatchdog:
    def __init__(self, rule: StallRule | None = None) -> None:
        self._watch = StallWatch(rule)
        self._lock = threading.Lock()  # steps are recorded on the engine thread, checked on another

    def on_step(self, rec: StepRecord) -> None:
        with self._lock:
            self._watch.record(rec.wall_s)

    def timeout_s(self) -> float:
        with self._lock:
            return self._watch.timeout_s()

    def check(self, engine: Any, now: float) -> str | None:
        """``DIED`` (the loop ended by itself), ``STALLED`` (a step past the bound) or None (healthy).
        ``now`` is on ``time.monotonic``, the clock of ``engine.busy_since``."""
        if engine.failure is not None or not engine.is_alive:
            return DIED
        with self._lock:
            overdue = self._watch.overdue_s(engine.busy_since, now)
        return STALLED if overdue is not None else None
