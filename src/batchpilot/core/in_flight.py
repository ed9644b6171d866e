"""Batches dispatched and not yet done, and the work scale: what the scheduler's predicted backlog is
made of.

The work scale is a moving average of reported / predicted batch seconds. Under load the HTTP layer
and tokenising take CPU from the model, and a shared machine's speed moves: admission and the
pipelining lead price the work ahead at the speed batches are running now.
"""

from __future__ import annotations

WORK_SCALE_ALPHA = 0.1  # moving average of reported / predicted batch seconds (the last ~10 batches)
WORK_SCALE_MIN, WORK_SCALE_MAX = 0.25, 4.0  # one odd batch (a GC pause, a cold start) moves it little


class InFlight:
    """Batch id -> (formed at, predicted seconds) of every batch in flight, and the work scale."""

    __slots__ = ("batches", "scale", "_num_slots")

    def __init__(self, num_slots: int) -> None:
        self.batches: dict[int, tuple[float, float]] = {}
        self.scale = 1.0  # 1.0 until a batch is done
        self._num_slots = max(num_slots, 1)

    def __len__(self) -> int:
        return len(self.batches)

    def add(self, batch_id: int, formed_at: float, predicted_s: float) -> None:
        self.batches[batch_id] = (formed_at, predicted_s)

    def done(self, batch_id: int, latency_s: float | None) -> bool:
        """Batch ``batch_id`` is done after ``latency_s`` seconds (None: it never ran, which moves the
        scale not at all); whether it was in flight."""
        entry = self.batches.pop(batch_id, None)
        if entry is None:
            return False
        predicted = entry[1]
        if latency_s is not None and predicted and latency_s > 0.0:
            ratio = min(max(latency_s / predicted, WORK_SCALE_MIN), WORK_SCALE_MAX)
            self.scale += WORK_SCALE_ALPHA * (ratio - self.scale)
        return True

    def backlog_s(self, now: float, queued_work_s: float) -> float:
        """Predicted seconds per slot until everything dispatched and ``queued_work_s`` of waiting work
        have run: what is left of each batch in flight (predicted time times the scale, less the time
        since it was formed) plus the queued work times the scale."""
        scale = self.scale
        left = 0.0
        for formed, predicted in self.batches.values():
            rest = predicted * scale - (now - formed)
            if rest > 0.0:
                left += rest
        return queued_work_s * scale + left / self._num_slots
