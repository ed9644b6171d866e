"""The encoder scheduler's running counters: what drivers export as metrics."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass(slots=True)
class SchedulerStats:
    """Running counters for drivers' metrics (cheap: updated per request / per batch)."""

    submitted: int = 0
    admitted: int = 0
    rejected: Counter[str] = field(default_factory=Counter)  # by RejectReason.value, incl. drops
    cancelled: int = 0
    batches: int = 0
    dispatched: int = 0
    useful_tokens: int = 0
    computed_tokens: int = 0
    completed_batches: int = 0

    @property
    def padding_efficiency(self) -> float:
        """Useful / computed tokens over every dispatched batch (1.0 before any)."""
        return self.useful_tokens / self.computed_tokens if self.computed_tokens else 1.0
