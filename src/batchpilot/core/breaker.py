"""A circuit breaker: whether traffic may go to an engine that has failed, and when to probe it.

    CLOSED ──(failure_threshold consecutive failures)──▶ OPEN ──(probe interval passed)──▶ HALF_OPEN
       ▲                                                  ▲                                   │
       └────────────────(the probe succeeded)─────────────┼───────────(the probe failed)───────┘

While CLOSED the engine takes traffic and a success resets the failure count. OPEN sends traffic
elsewhere (the fallback) until ``probe_at``; then ``take_probe(now)`` moves to HALF_OPEN once, and the
driver tries the engine with one probe of its own. A probe that succeeds closes the breaker; one that
fails opens it again with the interval multiplied by ``backoff`` (at most ``max_probe_interval_s``),
so an engine that keeps failing is probed less and less often.

Pure: nothing here reads a clock; every call takes ``now``. The driver serialises calls.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class BreakerState(str, enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


@dataclass(frozen=True)
class BreakerConfig:
    failure_threshold: int = 1  # consecutive failures that open the breaker
    probe_interval_s: float = 5.0  # first wait between opening and the probe
    backoff: float = 2.0  # each failed probe multiplies the wait
    max_probe_interval_s: float = 60.0

    def __post_init__(self) -> None:
        if self.failure_threshold < 1:
            raise ValueError(f"breaker.failure_threshold must be >= 1, got {self.failure_threshold}")
        if not 0 < self.probe_interval_s <= self.max_probe_interval_s:
            raise ValueError(f"breaker: need 0 < probe_interval_s ({self.probe_interval_s}) <= "
                             f"max_probe_interval_s ({self.max_probe_interval_s})")
        if self.backoff < 1.0:
            raise ValueError(f"breaker.backoff must be >= 1, got {self.backoff}")


class CircuitBreaker:
    def __init__(self, config: BreakerConfig | None = None) -> None:
        self.config = config or BreakerConfig()
        self.state = BreakerState.CLOSED
        self.failures = 0  # consecutive, while closed
        self.interval_s = self.config.probe_interval_s
        self.probe_at: float | None = None  # while open: when the next probe is due
        self.num_opened = 0
        self.num_closed = 0  # returns to the engine after a successful probe

    @property
    def allows(self) -> bool:
        """The engine may take traffic (closed)."""
        return self.state is BreakerState.CLOSED

    def record_success(self, now: float) -> bool:
        """A request or probe succeeded on the engine. True if this closed the breaker."""
        if self.state is BreakerState.CLOSED:
            self.failures = 0
            return False
        if self.state is BreakerState.HALF_OPEN:
            self.state, self.failures, self.probe_at = BreakerState.CLOSED, 0, None
            self.interval_s = self.config.probe_interval_s
            self.num_closed += 1
            return True
        return False  # open: a late success of work sent before it opened changes nothing

    def record_failure(self, now: float) -> bool:
        """A failure on the engine. True if this opened the breaker."""
        if self.state is BreakerState.OPEN:
            return False
        if self.state is BreakerState.HALF_OPEN:
            self.interval_s = min(self.interval_s * self.config.backoff, self.config.max_probe_interval_s)
            self._open(now)
            return True
        self.failures += 1
        if self.failures >= self.config.failure_threshold:
            self._open(now)
            return True
        return False

    def take_probe(self, now: float) -> bool:
        """True (once, moving to HALF_OPEN) when the breaker is open and its probe is due."""
        if self.state is BreakerState.OPEN and self.probe_at is not None and now >= self.probe_at:
            self.state = BreakerState.HALF_OPEN
            return True
        return False

    def _open(self, now: float) -> None:
        self.state, self.failures = BreakerState.OPEN, 0
        self.probe_at = now + self.interval_s
        self.num_opened += 1
