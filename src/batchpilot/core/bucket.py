"""A token bucket on the caller's clock: ``rate`` units per second up to ``burst``, full at the start.

Admission's request-rate limit (one unit per request, ``core/admission.py``) and each tenant's token
quota (one unit per input token, ``core/tenants.py``) are the same mechanism. Over any window of
``w`` seconds a bucket gives out at most ``burst + rate * w`` units: it never lends.
"""

from __future__ import annotations


class TokenBucket:
    """``rate`` units per second up to ``burst``; starts full. Time is the caller's clock."""

    __slots__ = ("rate", "burst", "_tokens", "_last")

    def __init__(self, rate: float, burst: float) -> None:
        if not rate > 0 or not burst > 0:
            raise ValueError(f"a token bucket needs rate > 0 and burst > 0, got rate {rate}, burst {burst}")
        self.rate = float(rate)
        self.burst = float(burst)
        self._tokens = float(burst)
        self._last: float | None = None

    def _refill(self, now: float) -> None:
        if self._last is not None and now > self._last:
            self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate)
        if self._last is None or now > self._last:
            self._last = now

    def level(self, now: float) -> float:
        """Units available at ``now``."""
        self._refill(now)
        return self._tokens

    def wait_s(self, now: float, cost: float = 1.0) -> float:
        """Seconds until ``cost`` units are available (0.0: now; ``inf``: never, ``cost`` is over
        ``burst``). Takes nothing."""
        self._refill(now)
        if self._tokens >= cost:
            return 0.0
        if cost > self.burst:
            return float("inf")
        return (cost - self._tokens) / self.rate

    def take(self, now: float, cost: float = 1.0) -> None:
        """Take ``cost`` units that ``wait_s`` said are there."""
        self._refill(now)
        self._tokens -= cost

    def try_take(self, now: float, cost: float = 1.0) -> float:
        """Take ``cost`` units: 0.0 on success, else the seconds until they are available (nothing taken)."""
        wait = self.wait_s(now, cost)
        if wait == 0.0:
            self._tokens -= cost
        return wait

    def reshape(self, rate: float, burst: float, now: float) -> None:
        """New rate and burst (a reloaded quota): what is in the bucket stays, up to the new burst."""
        self._refill(now)
        if not rate > 0 or not burst > 0:
            raise ValueError(f"a token bucket needs rate > 0 and burst > 0, got rate {rate}, burst {burst}")
        self.rate, self.burst = float(rate), float(burst)
        self._tokens = min(self._tokens, self.burst)
