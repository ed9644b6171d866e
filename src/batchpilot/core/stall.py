"""When a busy engine counts as stalled: the stall rule, from the engine's own measured step times.

A step may take ``max(floor_s, multiple x the quantile of recent step times)`` before it counts as
stalled; until ``min_samples`` steps are measured the bound is ``cold_s`` (the first steps pay for lazy
initialisation, kernels being compiled, caches being filled). A fixed ``timeout_s`` (``serve
--llm-stall-timeout-s``) replaces the measured rule. ``StallWatch`` keeps the recent step times and
says whether the step under way has run past the bound; the driver stamps when that step began.

Pure: nothing here reads a clock; every call takes ``now``. Not thread-safe: a driver that records
steps on one thread and checks on another holds its own lock around both.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class StallRule:
    multiple: float = 10.0  # x the quantile of recent step times
    quantile: float = 0.99
    floor_s: float = 5.0  # never less than this: a loaded machine's slow step is not a stall
    cold_s: float = 60.0  # the bound until ``min_samples`` steps are measured
    min_samples: int = 16
    window: int = 512  # recent step times kept
    timeout_s: float | None = None  # fixed bound: replaces the measured rule

    def __post_init__(self) -> None:
        if self.multiple < 1.0:
            raise ValueError(f"stall.multiple must be >= 1, got {self.multiple}")
        if not 0.0 < self.quantile <= 1.0:
            raise ValueError(f"stall.quantile must be in (0, 1], got {self.quantile}")
        for name in ("floor_s", "cold_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"stall.{name} must be > 0 seconds, got {getattr(self, name)}")
        if self.min_samples < 1 or self.window < self.min_samples:
            raise ValueError(f"stall: need 1 <= min_samples ({self.min_samples}) <= window ({self.window})")
        if self.timeout_s is not None and not self.timeout_s > 0:
            raise ValueError(f"stall.timeout_s must be > 0 s (or unset: measured), got {self.timeout_s}")


def quantile(values: Sequence[float], q: float) -> float:
    """The nearest-rank ``q`` quantile (the smallest value with at least ``q`` of them at or below it)."""
    if not values:
        raise ValueError("quantile of no values")
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def stall_timeout(step_seconds: Sequence[float], rule: StallRule) -> float:
    """How long one step may run before it counts as stalled, given recent step times."""
    if rule.timeout_s is not None:
        return rule.timeout_s
    if len(step_seconds) < rule.min_samples:
        return rule.cold_s
    return max(rule.floor_s, rule.multiple * quantile(step_seconds, rule.quantile))


class StallWatch:
    """Recent step times, and whether the step that began at ``busy_since`` has run past the bound."""

    def __init__(self, rule: StallRule | None = None) -> None:
        self.rule = rule or StallRule()
        self._steps: deque[float] = deque(maxlen=self.rule.window)

    def record(self, step_s: float) -> None:
        if step_s >= 0 and math.isfinite(step_s):
            self._steps.append(step_s)

    @property
    def num_samples(self) -> int:
        return len(self._steps)

    def timeout_s(self) -> float:
        return stall_timeout(list(self._steps), self.rule)

    def overdue_s(self, busy_since: float | None, now: float) -> float | None:
        """Seconds past the bound of the step under way (None: no step under way, or within it)."""
        if busy_since is None:
            return None
        over = (now - busy_since) - self.timeout_s()
        return over if over > 0 else None
