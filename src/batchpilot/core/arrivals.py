"""How often requests come: a moving average of the gaps between them, shared by the policies (how
long until the next arrival, ``core/policy.py``) and admission (how fast a waiting request's
batch-mates are offered, ``core/admission.py``).

``GapAverage.observe(now)`` once per event. ``mean_s`` is the exponentially weighted moving average
of the gaps (weight ``alpha`` on the newest), ``inf`` until two events were seen; a gap that would be
negative (an event stamped before the last) counts as 0 and leaves ``last`` where it was. Pure: no
clock of its own, the caller passes the time.
"""

from __future__ import annotations

import math

_INF = math.inf


class GapAverage:
    __slots__ = ("alpha", "mean_s", "last")

    def __init__(self, alpha: float) -> None:
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"a moving average's weight must be in (0, 1], got {alpha}")
        self.alpha = alpha
        self.mean_s = _INF
        self.last = -_INF

    def observe(self, now: float) -> None:
        # Runs once per request: plain comparisons instead of max() calls, each exactly as max() picks.
        last = self.last
        if last != -_INF:
            gap = now - last
            if gap < 0.0:
                gap = 0.0
            mean = self.mean_s
            if mean == _INF:
                self.mean_s = gap
            else:
                a = self.alpha
                self.mean_s = a * gap + (1.0 - a) * mean
        if not last > now:
            self.last = now
