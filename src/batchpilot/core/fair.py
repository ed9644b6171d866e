"""The ``fair`` queue order: among tenants with waiting work, serve the one that has received the least
weighted service (Virtual Token Counter, Sheng et al., "Fairness in Serving Large Language Models",
OSDI 2024).

Each tenant ``t`` has a counter ``c_t``: the input tokens of its requests dispatched so far divided by its
weight (``TenantSpec.weight``). The queue's dispatch order is the order in which serving one request at
a time from the tenant with the least counter would take them::

    tenants with waiting work (each its own queue, in ``tenant_order``: fcfs, priority or edf)
        a: c=120  [a1 a2 a3]          peek(k): repeatedly take the head of the tenant with the least
        b: c=100  [b1]                counter, adding that head's tokens / weight to a copy of it
        c: c=300  [c1 c2]             -> b1 a1 a2 ... (ties: the earlier head, then the name)

So priorities and deadlines order work *within* a tenant, the planner still forms batches by length
from the first ``lookahead x cap`` of that order, and a tenant alone is served in its own order, exactly
as the plain queue of that order serves it (work-conserving: a lone tenant gets the whole machine).
Counters are charged when requests are dispatched (``take``), never when they are cancelled or expire.

**The lift.** A tenant that becomes backlogged again (its queue was empty) has its counter lifted to
the least counter of the tenants backlogged now (or, with none, to the counter the last one left
with): service it did not ask for while idle is not owed to it later. Counters only grow, and so does
the lift; a counter at or below the lift is forgotten, which changes nothing.

**The quantum.** A batch cannot be preempted: a request of a light tenant that arrives while a flood's
batch runs waits for it, however little service the tenant had. So while the queue is *contended* (more
than one tenant active: with waiting work, or a request arrived within ``ACTIVE_S``), the scheduler
trims a batch to ``SchedulerConfig.fair_quantum_s`` of predicted time (``BatchPlanner.trim``; its head
always goes), and a batch led by a tenant in its burst keeps only the requests of tenants in theirs
(``BatchScheduler._fair_cut``). What a tenant's new request waits behind is then one quantum, and its
own batch (it is at the head of fair order) holds its own work, not a flood's fill. A tenant alone is
never contended: its batches are untouched.

Every aggregate the dispatch policy and admission read (count, tokens, work, oldest arrival, earliest
deadline, longest input) is the base ``RequestQueue``'s, which holds every waiting request in arrival
order. ``work_ahead_s`` is what admission prices a tenant's new request behind: only the part of the
other tenants' queues that fair order serves before it.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterable, Iterator, Sequence

from batchpilot.core.config import QueueOrder, RequestOrder
from batchpilot.core.queue import Entry, RequestQueue
from batchpilot.core.request import Request

WeightOf = Callable[[str], float]
# A tenant that sent a request this recently is active (``FairQueue.contended``): it is likely to send
# the next one soon, and bounding the batch it would wait behind only helps if the bound is already in
# force when it arrives.
ACTIVE_S = 5.0


def _unit_weight(_: str) -> float:
    return 1.0


class VirtualCounters:
    """The tenants' virtual token counters, the lift and the burst (module docstring), for any queue
    that says when a tenant becomes backlogged (``activate``) and stops being so (``deactivate``): the
    encoder's ``FairQueue`` and the LLM scheduler's waiting queue (``core/llm/scheduler.py``)."""

    def __init__(self) -> None:
        self.counters: dict[str, float] = {}
        self.backlogged: set[str] = set()  # tenants with waiting work
        self.burst_until: dict[str, float] = {}  # backlogged tenants in a burst -> where it ends
        self._floor = 0.0  # the lift when no tenant is backlogged: the counter the last one left with

    def lift(self) -> float:
        """What a tenant becoming backlogged now is lifted to."""
        counters = self.counters
        return min((counters[t] for t in self.backlogged), default=self._floor)

    def counter(self, tenant: str) -> float:
        """The tenant's counter, or for one not backlogged what it would be lifted to."""
        if tenant in self.backlogged:
            return self.counters[tenant]
        return max(self.counters.get(tenant, 0.0), self.lift())

    def all_counters(self) -> dict[str, float]:
        """``counter`` of every tenant with a counter, the lift computed once (for views of the order)."""
        low, backlogged = self.lift(), self.backlogged
        return {t: c if t in backlogged else max(c, low) for t, c in self.counters.items()}

    def key(self, tenant: str, counter: float) -> tuple[int, float]:
        """What orders the backlogged tenants, at ``counter``: those in a burst first, then by counter."""
        return (0 if counter < self.burst_until.get(tenant, -math.inf) else 1, counter)

    def activate(self, tenant: str, allowance: float = 0.0) -> None:
        """``tenant`` has waiting work (again): lifted to the least backlogged counter, and in a burst
        until its counter is ``allowance`` above that (less what it still owes from its last burst)."""
        if tenant in self.backlogged:
            return
        low = self.lift()
        c = self.counters[tenant] = max(self.counters.get(tenant, low), low)
        self.backlogged.add(tenant)
        if c < low + allowance:
            self.burst_until[tenant] = low + allowance

    def deactivate(self, tenant: str) -> None:
        """``tenant`` has no waiting work left."""
        self.backlogged.discard(tenant)
        self.burst_until.pop(tenant, None)
        if not self.backlogged:
            self._floor = max(self._floor, self.counters.get(tenant, 0.0))
        if len(self.counters) > 2 * len(self.backlogged) + 256:  # a counter at or below the lift: no
            low = self.lift()                                  # different from one never seen
            self.counters = {t: c for t, c in self.counters.items() if t in self.backlogged or c > low}

    def charge(self, tenant: str, amount: float) -> None:
        """``tenant`` was served ``amount`` (weighted) more."""
        counters = self.counters
        counters[tenant] = counters.get(tenant, self.lift()) + amount


class FairQueue(RequestQueue):
    """Waiting requests in fair order (module docstring). ``tenant_order`` orders one tenant's requests;
    ``weight_of(tenant)`` is its weight, read when it is charged (a reloaded table applies at once)."""

    def __init__(self, tenant_order: RequestOrder = "fcfs", work_s: Sequence[float] | None = None,
                 weight_of: WeightOf = _unit_weight, burst_tokens: float = 0.0) -> None:
        super().__init__("fcfs", 0, work_s)  # every waiting request, in arrival order: the aggregates
        if tenant_order not in ("fcfs", "priority", "edf"):
            raise ValueError(f"tenant_order {tenant_order!r}; choose one of fcfs, priority, edf")
        self.tenant_order: RequestOrder = tenant_order
        self.weight_of = weight_of
        self.burst_tokens = burst_tokens  # a returning tenant's burst, in its own tokens
        self.vtc = VirtualCounters()
        self._queues: dict[str, RequestQueue] = {}  # tenants with waiting work -> their requests
        self._work_s = work_s
        self._last_arrival: dict[str, float] = {}  # tenant -> its latest request's arrival

    # -- counters ----------------------------------------------------------------------------
    @property
    def counters(self) -> dict[str, float]:
        return self.vtc.counters

    @property
    def backlogged(self) -> list[str]:
        """Tenants with waiting work."""
        return sorted(self._queues)

    def lift(self) -> float:
        """What a tenant becoming backlogged now is lifted to."""
        return self.vtc.lift()

    def counter(self, tenant: str) -> float:
        """The tenant's counter (weighted tokens dispatched), or what it would be lifted to."""
        return self.vtc.counter(tenant)

    def num_waiting_of(self, tenant: str) -> int:
        q = self._queues.get(tenant)
        return len(q) if q is not None else 0

    # -- mutation ----------------------------------------------------------------------------
    def push(self, req: Request) -> bool:
        tenant = req.tenant
        q = self._queues.get(tenant)
        if q is None:  # becomes backlogged: lifted to the least backlogged counter
            self.vtc.activate(tenant, self.burst_tokens / self.weight_of(tenant))
            q = self._queues[tenant] = RequestQueue(self.tenant_order, 0, self._work_s)
        super().push(req)
        q.push(req)
        last = self._last_arrival
        if req.arrival > last.get(tenant, -math.inf):
            last[tenant] = req.arrival
        if len(last) > 2 * len(self._queues) + 256:  # forget those not active any more
            since = req.arrival - ACTIVE_S
            self._last_arrival = {t: a for t, a in last.items() if a >= since}
        return True

    def take(self, reqs: Iterable[Request]) -> None:
        """Dispatched: each request's tokens / its tenant's weight go to its tenant's counter."""
        reqs = list(reqs)
        charge, weight_of = self.vtc.charge, self.weight_of
        for r in reqs:
            charge(r.tenant, r.length / weight_of(r.tenant))
        super().take(reqs)

    def _drop(self, entry: Entry) -> None:
        super()._drop(entry)
        req = entry[3]
        q = self._queues[req.tenant]
        q.remove(req.id)
        if not q:
            del self._queues[req.tenant]
            self.vtc.deactivate(req.tenant)

    # -- ordered reads -----------------------------------------------------------------------
    def head(self) -> Request | None:
        first = self.peek(1)
        return first[0] if first else None

    def oldest(self) -> Request | None:
        return super().head()  # the base queue is in arrival order

    def peek(self, k: int) -> list[Request]:
        """The first ``k`` waiting requests in fair order (module docstring)."""
        queues = self._queues
        if k <= 0 or not queues:
            return []
        if len(queues) == 1:
            return next(iter(queues.values())).peek(k)
        vtc, weight_of = self.vtc, self.weight_of
        counters, key = vtc.counters, vtc.key
        runs: dict[str, list[Request]] = {}
        heap: list[tuple[int, float, float, str, int]] = []
        for tenant, q in queues.items():
            run = runs[tenant] = q.peek(k)
            heap.append((*key(tenant, counters[tenant]), run[0].arrival, tenant, 0))
        heapq.heapify(heap)
        out: list[Request] = []
        while heap and len(out) < k:
            _, c, _, tenant, i = heapq.heappop(heap)
            run = runs[tenant]
            r = run[i]
            out.append(r)
            if i + 1 < len(run):
                c += r.length / weight_of(tenant)
                heapq.heappush(heap, (*key(tenant, c), run[i + 1].arrival, tenant, i + 1))
        return out

    def __iter__(self) -> Iterator[Request]:
        return iter(self.peek(len(self)))

    def in_burst(self, tenant: str) -> bool:
        """The tenant has waiting work and is in its burst (module docstring)."""
        until = self.vtc.burst_until.get(tenant)
        return until is not None and self.vtc.counters[tenant] < until

    def contended(self, now: float) -> bool:
        """More than one tenant is active: has waiting work, or sent a request in the last ``ACTIVE_S``
        seconds (the quantum's condition, module docstring)."""
        queues = self._queues
        if len(queues) > 1:
            return True
        since = now - ACTIVE_S
        return sum(1 for t, a in self._last_arrival.items() if a >= since or t in queues) > 1

    # -- what admission reads ----------------------------------------------------------------
    def work_ahead_s(self, tenant: str, tokens: int) -> float:
        """Predicted seconds of waiting work fair order serves before a new request of ``tokens`` tokens
        from ``tenant`` is done (the work table's seconds; the caller scales them): the tenant's own
        queue, and from each other backlogged tenant ``u`` the share of its queue's work that brings its
        counter up to where the new request leaves the tenant's (``(end - c_u) * w_u`` of its tokens)."""
        own = self._queues.get(tenant)
        queued = own.num_tokens if own is not None else 0
        end = self.counter(tenant) + (queued + tokens) / self.weight_of(tenant)
        ahead = own.num_work_s if own is not None else 0.0
        for u, q in self._queues.items():
            if u == tenant or not q.num_tokens:
                continue
            served = (end - self.vtc.counters[u]) * self.weight_of(u)
            if served > 0.0:
                ahead += q.num_work_s * min(1.0, served / q.num_tokens)
        return ahead


def make_queue(order: QueueOrder, tenant_order: RequestOrder = "fcfs", work_s: Sequence[float] | None = None,
               weight_of: WeightOf | None = None, burst_tokens: float = 0.0) -> RequestQueue:
    """The queue of a scheduler config's ``queue_order`` (``fair``: a ``FairQueue`` whose tenants' own
    requests go in ``tenant_order``, weighted by ``weight_of``, default all 1, and a returning tenant's
    burst of ``burst_tokens``)."""
    if order == "fair":
        return FairQueue(tenant_order, work_s, weight_of or _unit_weight, burst_tokens)
    if order == "fcfs" or order == "priority" or order == "edf":
        return RequestQueue(order, 0, work_s)
    raise ValueError(f"queue order {order!r}; choose one of fcfs, priority, edf, fair")
