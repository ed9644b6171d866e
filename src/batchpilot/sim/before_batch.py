"""What ran just before a batch: how long no batch ran (its idle time) and how busy the last second was.

Both move a batch's time under serving load off its price, and both are known when it starts, to
the simulator as to a batch log, so the profile fits a factor per bin of each (``FrontEnd``'s
``loaded_idle_factors`` and ``loaded_busy_factors``) and ``served_seconds`` applies them:

* the idle time (``idle_times``, bins ``IDLE_EDGES_S``): a batch right behind another finds the
  model's weights and the CPU warm, one after the server sat idle does not;
* the busy share (``BusyWindow``, bins ``BUSY_EDGES``): the share of the last ``BUSY_WINDOW_S`` in
  which a batch ran. Unpinned on cores the model shares with the rest of the server, a batch after
  a second of back-to-back batches runs faster than one after a second of sparse short ones, at the
  same idle time right before it; pinned to one core hardly (``benchmarks/rate_slope.py --by busy``).

The simulator and the batch-log pricing (``bench.run_speed``) compute both with these functions:
the one definition on both paths.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Sequence

# upper edges of the bins of the idle time before a batch (no batch running); the last bin is >= 0.3 s
IDLE_EDGES_S = (0.002, 0.01, 0.03, 0.1, 0.3)
BUSY_WINDOW_S = 1.0  # a batch's busy share: the part of this window before it in which a batch ran
# upper edges of the busy-share bins; the last bin is >= 0.4. Two bins: the profile's loaded phase
# holds ~200 batches, and finer bins' factors moved by 10 points between profiles of one machine
BUSY_EDGES = (0.4,)


class BusyWindow:
    """The union of the batches' run spans, pruned to the last ``BUSY_WINDOW_S``.

    ``add(start, end)`` records a batch's span (starts non-decreasing, spans may overlap: several
    slots); ``share(now)`` is the time in ``[now - BUSY_WINDOW_S, now]`` covered by some span, over
    ``BUSY_WINDOW_S``, in [0, 1]. A span still running at ``now`` counts up to ``now``."""

    def __init__(self) -> None:
        self._spans: deque[list[float]] = deque()  # merged [start, end], ascending, disjoint

    def add(self, start: float, end: float) -> None:
        spans = self._spans
        if spans and start <= spans[-1][1]:
            spans[-1][1] = max(spans[-1][1], end)
        else:
            spans.append([start, end])

    def share(self, now: float) -> float:
        lo = now - BUSY_WINDOW_S
        spans = self._spans
        while spans and spans[0][1] <= lo:
            spans.popleft()
        covered = 0.0
        for start, end in spans:
            if start >= now:
                break
            covered += min(end, now) - max(start, lo)
        return min(max(covered / BUSY_WINDOW_S, 0.0), 1.0)


def busy_shares(starts: Sequence[float], slot_s: Sequence[float]) -> list[float]:
    """Per batch (in start order), ``BusyWindow.share`` at its start over the batches before it."""
    window, out = BusyWindow(), []
    for start, took in zip(starts, slot_s, strict=True):
        out.append(window.share(start))
        window.add(start, start + took)
    return out


def busy_factor(factors: Sequence[float], share: float) -> float:
    """The factor of ``factors`` (one per ``BUSY_EDGES`` bin) for a busy share; 1 without factors."""
    return factors[bisect.bisect_right(BUSY_EDGES, share)] if factors else 1.0


def idle_factor(factors: Sequence[float], idle_s: float) -> float:
    """The factor of ``factors`` (one per ``IDLE_EDGES_S`` bin) for a batch after ``idle_s`` seconds
    with no batch running (``inf``: the first); 1 without factors."""
    return factors[bisect.bisect_right(IDLE_EDGES_S, idle_s)] if factors else 1.0


def idle_times(starts: Sequence[float], slot_s: Sequence[float]) -> list[float]:
    """Per batch (in start order), how long no batch ran before it started: ``inf`` for the first."""
    out, busy_until = [], -math.inf
    for start, took in zip(starts, slot_s, strict=True):
        out.append(max(start - busy_until, 0.0))
        busy_until = max(busy_until, start + took)
    return out
