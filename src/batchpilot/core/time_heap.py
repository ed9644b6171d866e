"""The request queue's time orders (arrival, deadline): binary heaps of ``(time, seq, request)`` with
lazy deletion.

An entry is live while the queue's ``live`` dict maps its request's id to an entry with the same
``seq``; a request that left (dispatched, cancelled, expired) leaves a stale entry behind. Stale
entries are skipped when they surface at the top (``clean_top``) and dropped in bulk once they
outnumber live ones (``compact``), so every operation stays O(log n) amortised.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping

from batchpilot.core.request import Request

# An entry of the queue's dispatch order: (key0, key1, seq, request); seq is unique so requests are
# never compared.
Entry = tuple[float, float, int, Request]
TimeEntry = tuple[float, int, Request]


def is_live(live: Mapping[int, Entry], seq: int, req: Request) -> bool:
    entry = live.get(req.id)
    return entry is not None and entry[2] == seq


def clean_top(heap: list[TimeEntry], live: Mapping[int, Entry]) -> None:
    """Pop stale entries until the top is live (or the heap is empty)."""
    while heap:
        _, seq, req = heap[0]
        entry = live.get(req.id)
        if entry is not None and entry[2] == seq:
            return
        heapq.heappop(heap)


def compact(heap: list[TimeEntry], live: Mapping[int, Entry]) -> None:
    """Rebuild ``heap`` without its stale entries once they outnumber live ones (O(n) every Θ(n)
    removals). In place: the scheduler holds references to these lists."""
    if len(heap) > 2 * len(live) + 64:
        heap[:] = [e for e in heap if is_live(live, e[1], e[2])]
        heapq.heapify(heap)


def before(heap: list[TimeEntry], live: Mapping[int, Entry], t: float) -> list[Request]:
    """Live requests with a time before ``t``, earliest first: a read-only walk of the heap's top (the
    k smallest entries of a binary heap sit in its first k levels)."""
    out: list[Request] = []
    if not heap:
        return out
    frontier = [(heap[0], 0)]
    n = len(heap)
    while frontier:
        entry, i = heapq.heappop(frontier)
        if entry[0] >= t:
            continue
        if is_live(live, entry[1], entry[2]):
            out.append(entry[2])
        for c in (2 * i + 1, 2 * i + 2):
            if c < n:
                heapq.heappush(frontier, (heap[c], c))
    return out
