"""Waiting requests in dispatch order: FCFS, priority-then-arrival, or earliest-deadline-first.

One binary heap per order key with *lazy deletion*: cancelling or dispatching a request only drops it
from ``_live``; stale heap entries are skipped when they surface and the heaps are rebuilt once stale
entries outnumber live ones (amortised O(1)). So push is O(log n), remove O(1) + amortised cleanup,
and the policy's aggregates (count, tokens, oldest arrival, earliest deadline, longest length) are
cached or read off a heap top — a decision never scans the queue. The arrival and deadline orders
are heaps of the same kind (``time_heap``).

The planner looks at the first ``lookahead × cap`` requests and dispatches any of them, not only the
head, so removals would leave holes near the top of a heap. Those candidates therefore live in a
sorted *front* list in front of the heap::

    front (sorted, all live)      heap (lazy deletion)
    [e0 < e1 < ... < e_k]    <    every live entry in the heap

``peek(k)`` tops the front up with heap pops (O(log n) each, once per request) and slices it; a
dispatched or cancelled front entry is deleted from the list at once (bisect + O(k) memmove); a new
request whose key sorts before the front's last entry (a higher priority, an earlier deadline) is
inserted into the front, which keeps the invariant.

The time orders the queue keeps (``TimeHeap``: arrival and deadline heaps with lazy deletion) are the
file's first section.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence

from batchpilot.core.config import REQUEST_ORDERS, RequestOrder
from batchpilot.core.request import Request

# -- Time orders (arrival, deadline) ---------------------------------------------------------------
# The request queue's time orders (arrival, deadline): binary heaps of ``(time, seq, request)`` with
# lazy deletion.
#
# An entry is live while the queue's ``live`` dict maps its request's id to an entry with the same
# ``seq``; a request that left (dispatched, cancelled, expired) leaves a stale entry behind. Stale
# entries are skipped when they surface at the top (``clean_top``) and dropped in bulk once they
# outnumber live ones (``compact``), so every operation stays O(log n) amortised.

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


_INF = math.inf
# New requests go straight to the front list while the heap is empty and the front is short; past
# that, deleting from the front (a memmove) would cost more than the heap round trip it saves.
_FRONT_APPEND_MAX = 256
# Up to this many distinct waiting lengths, the longest is found with max() (see _refresh_max_len).
_MAX_LEN_SCAN = 32


MEAN_WORK_ALPHA = 1.0 / 32  # ``mean_work_s``: the last ~32 inputs pushed


class RequestQueue:
    """Bounded queue of waiting requests. ``capacity`` 0 means unbounded."""

    def __init__(self, order: RequestOrder = "fcfs", capacity: int = 0,
                 work_s: Sequence[float] | None = None) -> None:
        """``work_s[length]``: predicted seconds an input of that length adds to draining the queue
        (``AdmissionController.work_s``); without it ``num_work_s`` stays 0."""
        if order not in REQUEST_ORDERS:  # "fair" is a queue of these: core/fair.py
            raise ValueError(f"queue order {order!r}; choose one of {', '.join(REQUEST_ORDERS)}")
        if capacity < 0:
            raise ValueError(f"queue capacity must be >= 0 (0 = unbounded), got {capacity}")
        self.order: RequestOrder = order
        self.capacity = capacity
        self._front: list[Entry] = []
        self._heap: list[Entry] = []
        # FCFS order *is* arrival order, so the main order doubles as the arrival order.
        self._arrivals: list[TimeEntry] = []
        self._deadlines: list[TimeEntry] = []
        self._live: dict[int, Entry] = {}  # id -> its entry in the front or the heap
        self._seq = 0
        self._tokens = 0
        self._work_table = work_s
        self._work = 0.0
        self._mean_work = -1.0  # no input pushed yet
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

    @property
    def num_work_s(self) -> float:
        """Predicted seconds of work waiting (the sum of ``work_s`` over the waiting inputs)."""
        return self._work

    @property
    def mean_work_s(self) -> float:
        """A moving average of ``work_s`` over the inputs pushed (the last ~``1 / MEAN_WORK_ALPHA``; 0.0
        before the first): what an input arriving next is expected to add to the queue's work."""
        return max(self._mean_work, 0.0)

    def is_full(self) -> bool:
        return self.capacity > 0 and len(self._live) >= self.capacity

    def head(self) -> Request | None:
        """The first request in dispatch order."""
        if not self._front:
            self._fill(1)
        return self._front[0][3] if self._front else None

    def oldest(self) -> Request | None:
        """The earliest-arrived waiting request (the one a wait window is measured from)."""
        if self.order == "fcfs":
            return self.head()
        clean_top(self._arrivals, self._live)
        return self._arrivals[0][2] if self._arrivals else None

    def aggregates(self) -> tuple[int, int, float, float, int]:
        """(count, tokens, oldest arrival, earliest deadline, longest length) in one call: what a
        dispatch policy sees. inf stands for "none"."""
        if self.order == "fcfs":
            front = self._front
            if not front:
                self._fill(1)
            oldest = front[0][0] if front else _INF  # the FCFS key is the arrival
        else:
            clean_top(self._arrivals, self._live)
            oldest = self._arrivals[0][0] if self._arrivals else _INF
        deadline = _INF
        if self._deadlines:
            clean_top(self._deadlines, self._live)
            if self._deadlines:
                deadline = self._deadlines[0][0]
        if self._max_len_dirty:
            self._refresh_max_len()
        return len(self._live), self._tokens, oldest, deadline, self._max_len

    def has_deadlines(self) -> bool:
        """Whether any waiting request may have a deadline (cheap; may be stale-true, never stale-false)."""
        return bool(self._deadlines)

    def most_urgent(self) -> Request | None:
        """The waiting request with the earliest deadline (None if no request has one)."""
        clean_top(self._deadlines, self._live)
        return self._deadlines[0][2] if self._deadlines else None

    def max_length(self) -> int:
        """Longest waiting request in tokens (0 when empty)."""
        if self._max_len_dirty:
            self._refresh_max_len()
        return self._max_len

    # -- mutation ----------------------------------------------------------------------------
    def push(self, req: Request) -> bool:
        """Add a request; False (and nothing changes) when the queue is at capacity."""
        if self.capacity and len(self._live) >= self.capacity:
            return False
        if req.id in self._live:
            raise ValueError(f"request id {req.id} is already waiting; ids must be unique")
        seq = self._seq
        self._seq = seq + 1
        order = self.order
        if order == "fcfs":
            entry: Entry = (req.arrival, 0.0, seq, req)
        else:
            key0 = float(req.priority) if order == "priority" else (
                _INF if req.deadline is None else req.deadline)
            entry = (key0, req.arrival, seq, req)
            heapq.heappush(self._arrivals, (req.arrival, seq, req))
        self._live[req.id] = entry
        front = self._front
        if front and entry < front[-1]:
            bisect.insort(front, entry)
        elif not self._heap and len(front) < _FRONT_APPEND_MAX:
            front.append(entry)  # sorts last (in-order arrivals): skip the heap round trip
        else:
            heapq.heappush(self._heap, entry)
        if req.deadline is not None:
            heapq.heappush(self._deadlines, (req.deadline, seq, req))
        self._tokens += req.length
        length = req.length
        if self._work_table is not None:
            w = self._work_table[min(length, len(self._work_table) - 1)]
            self._work += w
            mean = self._mean_work
            self._mean_work = w if mean < 0.0 else mean + MEAN_WORK_ALPHA * (w - mean)
        self._len_count[length] = self._len_count.get(length, 0) + 1
        if length > self._max_len:
            self._max_len = length
        return True

    def remove(self, request_id: int) -> Request | None:
        """Take one request out (cancel); returns it, or None if it is not waiting."""
        entry = self._live.get(request_id)
        if entry is None:
            return None
        self._drop(entry)
        self._maybe_compact()
        return entry[3]

    def take(self, reqs: Iterable[Request]) -> None:
        """Remove requests that were just dispatched (they must be waiting)."""
        live = self._live
        for req in reqs:
            self._drop(live[req.id])
        self._maybe_compact()

    def expire(self, now: float) -> list[Request]:
        """Remove and return every request whose deadline is at or before ``now``.

        ``<=`` on purpose: a driver woken exactly at a deadline must see the request gone, or it
        would be handed the same ``wake_at`` again.
        """
        out: list[Request] = []
        heap = self._deadlines
        live = self._live
        while heap:
            deadline, seq, req = heap[0]
            entry = live.get(req.id)
            if entry is None or entry[2] != seq:
                heapq.heappop(heap)
                continue
            if deadline > now:
                break
            heapq.heappop(heap)
            self._drop(entry)
            out.append(req)
        if out:
            self._maybe_compact()
        return out

    def due_before(self, t: float) -> list[Request]:
        """Waiting requests with a deadline before ``t``, earliest first (read-only)."""
        return before(self._deadlines, self._live, t)

    # -- ordered reads -----------------------------------------------------------------------
    def peek(self, k: int) -> list[Request]:
        """The first ``k`` waiting requests in dispatch order, without removing them."""
        if len(self._front) < k and self._heap:  # short queues live in the front alone: no call
            self._fill(k)
        return [e[3] for e in self._front[:k]]

    def __iter__(self) -> Iterator[Request]:
        live = self._live
        rest = [e for e in self._heap if live.get(e[3].id) is e]
        return iter([e[3] for e in self._front + sorted(rest)])

    # -- internals ---------------------------------------------------------------------------
    def _fill(self, k: int) -> None:
        front, heap, live = self._front, self._heap, self._live
        pop = heapq.heappop
        while len(front) < k and heap:
            entry = pop(heap)
            if live.get(entry[3].id) is entry:
                front.append(entry)  # the heap minimum is >= every front entry: stays sorted

    def _drop(self, entry: Entry) -> None:
        req = entry[3]
        del self._live[req.id]
        front = self._front
        if front and entry <= front[-1]:
            i = bisect.bisect_left(front, entry)
            del front[i]
        self._tokens -= req.length
        length = req.length
        if self._work_table is not None:  # back to exactly 0 when empty: no float drift over millions
            self._work = self._work - self._work_table[min(length, len(self._work_table) - 1)] \
                if self._live else 0.0
        count = self._len_count[length] - 1
        if count:
            self._len_count[length] = count
        else:
            del self._len_count[length]
            if not self._len_count:
                self._max_len = 0  # the queue emptied (the common case at light load): nothing to find
            elif length == self._max_len:
                self._max_len_dirty = True

    def _refresh_max_len(self) -> None:
        # Few distinct lengths waiting (the common case: the queue is short): max() over them in C.
        # Many: walk down from the old maximum, as the new one is then usually a few tokens below it
        # (lengths are small ints), which beats max() over hundreds of keys. A walk from the old
        # maximum down to a short queue's far-away new maximum cost ~6% of a simulation.
        counts, m = self._len_count, self._max_len
        if len(counts) <= _MAX_LEN_SCAN:
            m = max(counts) if counts else 0
        else:
            while m not in counts:
                m -= 1
        self._max_len = m
        self._max_len_dirty = False

    def _maybe_compact(self) -> None:
        # Rebuild a heap once its stale entries outnumber live ones: O(n) every Θ(n) removals.
        # In place: the scheduler holds references to these lists.
        live = self._live
        in_heap = len(live) - len(self._front)
        if len(self._heap) > 2 * in_heap + 64:
            self._heap[:] = [e for e in self._heap if live.get(e[3].id) is e]
            heapq.heapify(self._heap)
        compact(self._arrivals, live)
        compact(self._deadlines, live)
