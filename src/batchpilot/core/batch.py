"""What one ``BatchScheduler.schedule`` call hands its driver: the batches it dispatched, the requests
it dropped, and when to call again."""

from __future__ import annotations

from dataclasses import dataclass, field

from batchpilot.core.admission import Rejection
from batchpilot.core.costmodel import BatchShape
from batchpilot.core.request import Request


@dataclass(slots=True)
class Batch:
    """A dispatched batch: plain data the executor runs and the simulator times."""

    id: int
    requests: list[Request]
    padded_len: int
    shape: BatchShape
    padding: str
    formed_at: float
    predicted_s: float = 0.0

    @property
    def size(self) -> int:
        return len(self.requests)

    @property
    def useful_tokens(self) -> int:
        return self.shape.useful_tokens

    @property
    def computed_tokens(self) -> int:
        return self.shape.tokens

    @property
    def wasted_tokens(self) -> int:
        """Padding computed for nothing (0 for padding-free batches)."""
        return self.shape.tokens - self.shape.useful_tokens


@dataclass(slots=True)
class SchedulerOutput:
    batches: list[Batch] = field(default_factory=list)
    dropped: list[Rejection] = field(default_factory=list)
    wake_at: float | None = None  # call schedule() again at this time if nothing else happens first
