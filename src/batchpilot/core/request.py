"""The unit of work every scheduler sees: a request with a length, a priority and maybe a deadline.

Plain data. Times are seconds on whatever clock the driver owns (wall clock live, virtual in the
simulator, a fake in tests); core never reads a clock itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

DEFAULT_TENANT = "default"  # the tenant of a request that names none

@dataclass(slots=True, eq=False)
class Request:
    """One inference request as the scheduling core sees it.

    ``priority``: lower value is served first (0 is the default class, negative is more urgent),
    the same convention as vLLM. ``deadline`` is absolute (driver clock); ``sla`` is a relative
    latency budget from arrival. When only ``sla`` is given, ``deadline = arrival + sla``.
    ``payload`` is an opaque handle (texts, token ids, a future) that core never looks at.
    ``tenant`` is who the request is for (``core/tenants.py``): its quotas, its share under the
    ``fair`` queue order, and the usage it is counted in.
    """

    id: int
    arrival: float
    length: int
    priority: int = 0
    deadline: float | None = None
    sla: float | None = None
    payload: Any = field(default=None, repr=False)
    group: int = -1  # the scheduler's: the id of the request's first input when it has several, else -1
    tenant: str = DEFAULT_TENANT

    def __post_init__(self) -> None:
        if self.length < 1:
            raise ValueError(f"request {self.id}: length must be >= 1 token, got {self.length}")
        if self.deadline is None and self.sla is not None:
            if self.sla <= 0:
                raise ValueError(f"request {self.id}: sla must be > 0 seconds, got {self.sla}")
            self.deadline = self.arrival + self.sla

    def slack(self, now: float) -> float:
        """Seconds left before the deadline (``inf`` without one)."""
        return float("inf") if self.deadline is None else self.deadline - now


class IdCounter:
    """Deterministic ids: a counter, never ``id()`` or a uuid, so runs replay exactly."""

    def __init__(self, start: int = 0) -> None:
        self._next = start

    def __call__(self) -> int:
        value = self._next
        self._next += 1
        return value
