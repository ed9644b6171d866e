"""Waiting requests in dispatch order: FCFS, priority-then-arrival, or earliest-deadline-first.

One binary heap per order key with *lazy deletion*: cancelling or dispatching a request only drops it
from ``_live``; stale heap entries are skipped when they surface and the heaps are rebuilt once stale
entries outnumber live ones (amortised O(1)). So push is O(log n), remove O(1) + amortised cleanup,
and the policy's aggregates (count, tokens, oldest arrival, earliest deadline, longest length) are
cached or read off a heap top — a decision never scans the queue.

``peek(k)`` lists the first k live requests in order without mutating anything: a best-first walk
of the heap array (the k smallest of a binary heap live in its top, so the walk costs O(k log k)).

    heap array        walk frontier (smallest first)
       0              [0] -> pop 0, push 1,2 -> pop min(1,2), push its children ...
     1   2
    3 4 5 6
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from .config import QUEUE_ORDERS, QueueOrder
from .request import Request

_INF = math.inf
# An entry: (key0, key1, seq, request); seq is unique so requests are never compared.
_Entry = tuple[float, float, int, Request]
_TimeEntry = tuple[float, int, Request]


class RequestQueue:
    """Bounded queue of waiting requests. ``capacity`` 0 means unbounded."""

    def __init__(self, order: QueueOrder = "fcfs", capacity: int = 0) -> None:
        if order not in QUEUE_ORDERS:
            raise ValueError(f"queue order {order!r}; choose one of {', '.join(QUEUE_ORDERS)}")
        if capacity < 0:
            raise ValueError(f"queue capacity must be >= 0 (0 = unbounded), got {capacity}")
        self.order: QueueOrder = order
        self.capacity = capacity
        self._heap: list[_Entry] = []
        # FCFS order *is* arrival order, so the main heap doubles as the arrival heap.
        self._arrivals: list[_TimeEntry] = []
        self._deadlines: list[_TimeEntry] = []
        self._live: dict[int, tuple[int, Request]] = {}  # id -> (seq, request)
        self._seq = 0
        self._tokens = 0
        self._len_count: dict[int, int] = {}
        self._max_len = 0
        self._max_len_dirty = False

    # -- size and aggregates (all O(1) or a heap top) ----------------------------------------
    def __len__(self) -> int:
        return len(self._live)

    def __bool__(self) -> bool:
        return bool(self._live)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._live

    @property
    def num_tokens(self) -> int:
        return self._tokens

    def is_full(self) -> bool:
        return self.capacity > 0 and len(self._live) >= self.capacity

    def head(self) -> Request | None:
        """The first request in dispatch order."""
        self._clean(self._heap)
        return self._heap[0][3] if self._heap else None

    def oldest(self) -> Request | None:
        """The earliest-arrived waiting request (the one a wait window is measured from)."""
        if self.order == "fcfs":
            return self.head()
        self._clean_times(self._arrivals)
        return self._arrivals[0][2] if self._arrivals else None

    def most_urgent(self) -> Request | None:
        """The waiting request with the earliest deadline (None if no request has one)."""
        self._clean_times(self._deadlines)
        return self._deadlines[0][2] if self._deadlines else None

    def max_length(self) -> int:
        """Longest waiting request in tokens (0 when empty)."""
        if self._max_len_dirty:
            self._max_len = max(self._len_count, default=0)
            self._max_len_dirty = False
        return self._max_len

    # -- mutation ----------------------------------------------------------------------------
    def push(self, req: Request) -> bool:
        """Add a request; False (and nothing changes) when the queue is at capacity."""
        if self.is_full():
            return False
        if req.id in self._live:
            raise ValueError(f"request id {req.id} is already waiting; ids must be unique")
        seq = self._seq
        self._seq = seq + 1
        self._live[req.id] = (seq, req)
        deadline = _INF if req.deadline is None else req.deadline
        if self.order == "fcfs":
            heapq.heappush(self._heap, (req.arrival, 0.0, seq, req))
        else:
            key0 = float(req.priority) if self.order == "priority" else deadline
            heapq.heappush(self._heap, (key0, req.arrival, seq, req))
            heapq.heappush(self._arrivals, (req.arrival, seq, req))
        if req.deadline is not None:
            heapq.heappush(self._deadlines, (deadline, seq, req))
        self._tokens += req.length
        length = req.length
        self._len_count[length] = self._len_count.get(length, 0) + 1
        if length > self._max_len:
            self._max_len = length
        return True

    def remove(self, request_id: int) -> Request | None:
        """Take one request out (cancel); returns it, or None if it is not waiting."""
        rec = self._live.get(request_id)
        if rec is None:
            return None
        self._drop(rec[1])
        self._maybe_compact()
        return rec[1]

    def take(self, reqs: Iterable[Request]) -> None:
        """Remove requests that were just dispatched (they must be waiting)."""
        for req in reqs:
            self._drop(req)
        self._clean(self._heap)
        self._maybe_compact()

    def expire(self, now: float) -> list[Request]:
        """Remove and return every request whose deadline is at or before ``now``.

        ``<=`` on purpose: a driver woken exactly at a deadline must see the request gone, or it
        would be handed the same ``wake_at`` again.
        """
        out: list[Request] = []
        heap = self._deadlines
        while heap:
            deadline, seq, req = heap[0]
            rec = self._live.get(req.id)
            if rec is None or rec[0] != seq:
                heapq.heappop(heap)
                continue
            if deadline > now:
                break
            heapq.heappop(heap)
            self._drop(req)
            out.append(req)
        if out:
            self._maybe_compact()
        return out

    def due_before(self, t: float) -> list[Request]:
        """Waiting requests with a deadline before ``t``, earliest first (read-only walk)."""
        return [e[2] for e in self._walk(self._deadlines, _INF, t)]

    # -- ordered reads -----------------------------------------------------------------------
    def peek(self, k: int) -> list[Request]:
        """The first ``k`` waiting requests in dispatch order, without removing them."""
        if k >= len(self._live) and self.order == "fcfs" and len(self._heap) == len(self._live):
            return [e[3] for e in sorted(self._heap)]
        return [e[3] for e in self._walk(self._heap, k)]

    def __iter__(self) -> Iterator[Request]:
        return iter([e[3] for e in sorted(self._heap) if self._is_live(e[2], e[3])])

    # -- internals ---------------------------------------------------------------------------
    def _is_live(self, seq: int, req: Request) -> bool:
        rec = self._live.get(req.id)
        return rec is not None and rec[0] == seq

    def _walk(self, heap: Sequence[tuple[Any, ...]], k: float, stop: float = _INF) -> list[tuple[Any, ...]]:
        """Best-first walk of a heap array: up to k live entries in order, stopping at key >= stop."""
        out: list[tuple[Any, ...]] = []
        n = len(heap)
        if not n or k <= 0:
            return out
        live = self._live
        frontier: list[tuple[tuple[Any, ...], int]] = [(heap[0], 0)]
        pop, push = heapq.heappop, heapq.heappush
        while frontier and len(out) < k:
            entry, i = pop(frontier)
            if entry[0] >= stop:
                break
            req = entry[-1]
            rec = live.get(req.id)
            if rec is not None and rec[0] == entry[-2]:
                out.append(entry)
            c = 2 * i + 1
            if c < n:
                push(frontier, (heap[c], c))
                if c + 1 < n:
                    push(frontier, (heap[c + 1], c + 1))
        return out

    def _drop(self, req: Request) -> None:
        del self._live[req.id]
        self._tokens -= req.length
        length = req.length
        count = self._len_count[length] - 1
        if count:
            self._len_count[length] = count
        else:
            del self._len_count[length]
            if length == self._max_len:
                self._max_len_dirty = True

    def _clean(self, heap: list[_Entry]) -> None:
        live = self._live
        while heap:
            _, _, seq, req = heap[0]
            rec = live.get(req.id)
            if rec is not None and rec[0] == seq:
                return
            heapq.heappop(heap)

    def _clean_times(self, heap: list[_TimeEntry]) -> None:
        live = self._live
        while heap:
            _, seq, req = heap[0]
            rec = live.get(req.id)
            if rec is not None and rec[0] == seq:
                return
            heapq.heappop(heap)

    def _maybe_compact(self) -> None:
        # Rebuild once stale entries outnumber live ones: O(n) every Θ(n) removals.
        if len(self._heap) > 2 * len(self._live) + 64:
            self._heap = [e for e in self._heap if self._is_live(e[2], e[3])]
            heapq.heapify(self._heap)
            self._arrivals = [e for e in self._arrivals if self._is_live(e[1], e[2])]
            heapq.heapify(self._arrivals)
        if len(self._deadlines) > 2 * len(self._live) + 64:
            self._deadlines = [e for e in self._deadlines if self._is_live(e[1], e[2])]
            heapq.heapify(self._deadlines)
