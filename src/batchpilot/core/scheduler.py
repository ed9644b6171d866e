"""The encoder scheduling core: a state machine with two calls, driven by any clock.

    submit_group(requests, now)   -> None (all admitted) | Rejection (none admitted)
    submit(request, now)          -> submit_group([request], now)
    schedule(now, free_slots)     -> SchedulerOutput(batches, dropped, wake_at)
    next_batch_at(batch, started) -> when the slot running ``batch`` takes its next one (pipelining)
    on_batch_done(batch, now, s)  -> None  (feeds adaptive policies; every dispatched batch, once)
    cancel(request_id, now)       -> bool

The live driver (runtime/), the simulator (sim/) and the tests call exactly these. Drivers call
``schedule`` whenever a request arrives, a batch finishes, or ``wake_at`` passes; they never decide
anything themselves. Nothing here reads a clock, awaits, or imports torch.

Inside, the pieces are composed in this order::

    submit:   admission.check_group ─▶ queue.push (each input) ─▶ policy.on_arrival, bucketer.observe
    schedule: queue.expire (+ timeout, infeasible sweep) ─▶ while a slot is free:
                  policy.decide(now, QueueState) ─▶ Wait: stop  |  Dispatch:
                  planner.plan(queue.peek(lookahead × cap)) ─▶ queue.take ─▶ Batch
    done:     scheduler.done (the work scale behind the predicted backlog) ─▶ policy.on_batch_done

Sections: the batches in flight (``InFlight``, the work scale and the predicted backlog), the
counters drivers export (``SchedulerStats``), then ``BatchScheduler``.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from batchpilot.core.admission import AdmissionController, LoadState, Rejection, RejectReason
from batchpilot.core.batch import Batch, SchedulerOutput
from batchpilot.core.bucketing import Bucketer
from batchpilot.core.config import SchedulerConfig
from batchpilot.core.costmodel import CostModel
from batchpilot.core.fair import FairQueue, make_queue
from batchpilot.core.planner import BatchPlanner, Plan
from batchpilot.core.policy import Dispatch, Policy, QueueState, Wait, make_policy
from batchpilot.core.queue import RequestQueue
from batchpilot.core.request import Request
from batchpilot.core.tenants import TenantLedger, TenantTable, TenantUsage

# -- Batches in flight -----------------------------------------------------------------------------
# Batches dispatched and not yet done, and the work scale: what the scheduler's predicted backlog is
# made of.
#
# The work scale is a moving average of reported / predicted batch seconds. Under load the HTTP layer
# and tokenising take CPU from the model, and a shared machine's speed moves: admission and the
# pipelining lead price the work ahead at the speed batches are running now.

WORK_SCALE_ALPHA = 0.1  # moving average of reported / predicted batch seconds (the last ~10 batches)
WORK_SCALE_MIN, WORK_SCALE_MAX = 0.25, 4.0  # one odd batch (a GC pause, a cold start) moves it little


class InFlight:
    """Batch id -> (formed at, predicted seconds) of every batch in flight, and the work scale."""

    __slots__ = ("batches", "scale", "_num_slots")

    def __init__(self, num_slots: int) -> None:
        self.batches: dict[int, tuple[float, float]] = {}
        self.scale = 1.0  # 1.0 until a batch is done
        self._num_slots = max(num_slots, 1)

    def __len__(self) -> int:
        return len(self.batches)

    def add(self, batch_id: int, formed_at: float, predicted_s: float) -> None:
        self.batches[batch_id] = (formed_at, predicted_s)

    def done(self, batch_id: int, latency_s: float | None) -> bool:
        """Batch ``batch_id`` is done after ``latency_s`` seconds (None: it never ran, which moves the
        scale not at all); whether it was in flight."""
        entry = self.batches.pop(batch_id, None)
        if entry is None:
            return False
        predicted = entry[1]
        if latency_s is not None and predicted and latency_s > 0.0:
            ratio = min(max(latency_s / predicted, WORK_SCALE_MIN), WORK_SCALE_MAX)
            self.scale += WORK_SCALE_ALPHA * (ratio - self.scale)
        return True

    def backlog_s(self, now: float, queued_work_s: float) -> float:
        """Predicted seconds per slot until everything dispatched and ``queued_work_s`` of waiting work
        have run: what is left of each batch in flight (predicted time times the scale, less the time
        since it was formed) plus the queued work times the scale."""
        scale = self.scale
        left = 0.0
        for formed, predicted in self.batches.values():
            rest = predicted * scale - (now - formed)
            if rest > 0.0:
                left += rest
        return queued_work_s * scale + left / self._num_slots


# -- Counters --------------------------------------------------------------------------------------
# The encoder scheduler's running counters: what drivers export as metrics.

@dataclass(slots=True)
class SchedulerStats:
    """Running counters for drivers' metrics (cheap: updated per request / per batch)."""

    submitted: int = 0
    admitted: int = 0
    rejected: Counter[str] = field(default_factory=Counter)  # by RejectReason.value, incl. drops
    cancelled: int = 0
    batches: int = 0
    dispatched: int = 0
    useful_tokens: int = 0
    computed_tokens: int = 0
    completed_batches: int = 0

    @property
    def padding_efficiency(self) -> float:
        """Useful / computed tokens over every dispatched batch (1.0 before any)."""
        return self.useful_tokens / self.computed_tokens if self.computed_tokens else 1.0




class BatchScheduler:
    """Admission, queue, dispatch policy, batch planner and bucketing behind four calls."""

    def __init__(self, config: SchedulerConfig | None = None, cost_model: CostModel | None = None,
                 tenants: TenantTable | None = None) -> None:
        """``tenants``: the tenants' weights and quotas (``core/tenants.py``); with it, or under the
        ``fair`` order, the scheduler keeps a ledger per tenant (quotas, usage). Without either, a
        request's ``tenant`` is not looked at."""
        self.config = config = config or SchedulerConfig()
        self.cost_model = cost_model = cost_model or CostModel.default_cpu_minilm()
        plan = config.planner
        self.bucketer = (Bucketer(config.bucketing, cost_model, plan.max_len)
                         if plan.grouping == "bucket" or plan.padding == "bucket" else None)
        self.policy: Policy = make_policy(config.policy, cost_model, plan)
        self.planner = BatchPlanner(plan, cost_model, self.bucketer)
        self._fair = config.queue_order == "fair"
        self.admission = AdmissionController(config.admission, plan, cost_model, config.policy.max_batch_size,
                                             config.num_slots, self._fair)
        self.stats = SchedulerStats()
        self.tenants = TenantLedger(tenants) if tenants is not None or self._fair else None
        # admission alone bounds the queue (a request is admitted whole): the queue itself is unbounded
        self._queue: RequestQueue = make_queue(config.queue_order, config.tenant_order, self.admission.work_s,
                                               self.tenants.weight if self.tenants is not None else None,
                                               config.fair_burst_tokens)
        # The queue's id -> entry dict and deadline heap (never rebound): truth-testing them directly
        # saves Python-level calls on the hot path, which runs ~3 times per request in the simulator.
        self._live = self._queue._live
        self._deadlines = self._queue._deadlines
        self._in_flight = InFlight(config.num_slots)  # dispatched, not yet done, and the work scale
        adm = config.admission
        self._reads_backlog = adm.max_backlog_s > 0 or adm.latency_sla_s > 0
        self._timeout_s = adm.timeout_s
        self._lead_s = config.pipeline_lead_s
        self._pipeline = config.pipeline != "off"
        # requests in progress: singles count 1 until their input is done; a group's inputs share one
        # entry of ``_group_left`` (group id -> inputs not yet done)
        self._num_requests = 0
        self._group_left: dict[int, int] = {}
        self._next_batch_id = 0  # deterministic batch ids (a counter, as IdCounter, without the call)
        self._lookahead = 1 if plan.grouping == "fifo" else plan.lookahead
        self._padding = plan.padding
        self._drop_infeasible = config.policy.on_infeasible == "drop"
        self._max_alone_q = self.admission.alone_latency_q(self.admission.max_length)
        # the fair order's quantum (core/fair.py): 0 until the deployment derives it means no bound
        self._fair_queue = self._queue if isinstance(self._queue, FairQueue) else None
        self._quantum_s = config.fair_quantum_s or math.inf

    # -- what drivers read for metrics -------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        # len(self._queue) without RequestQueue.__len__'s frame: the simulator reads this on every
        # event (2.5M times per 1M requests)
        return len(self._live)

    @property
    def num_waiting_tokens(self) -> int:
        return self._queue.num_tokens

    @property
    def num_requests(self) -> int:
        """Requests (groups of inputs) admitted and not finished: what ``max_concurrent_requests`` bounds."""
        return self._num_requests

    def predicted_backlog_s(self, now: float) -> float:
        """Predicted seconds until everything dispatched and waiting has run, per slot: what is left of
        the batches in flight (predicted time times ``work_scale``, less the time since they were
        formed) plus the queue's work (``AdmissionController.work_s`` summed, times ``work_scale``).
        What ``admission.max_backlog_s`` bounds and the latency SLA is checked against."""
        return self._in_flight.backlog_s(now, self._queue.num_work_s)

    @property
    def work_scale(self) -> float:
        """How much longer batches have been running than the cost model predicts (a moving average of
        reported / predicted seconds, 1.0 until a batch is done). Under load the HTTP layer and
        tokenising take CPU from the model, and a shared machine's speed moves: admission and the
        pipelining lead price the work ahead at the speed batches are running now."""
        return self._in_flight.scale

    @property
    def num_in_flight(self) -> int:
        """Batches dispatched and not yet reported done (``on_batch_done``)."""
        return len(self._in_flight)

    @property
    def queue(self) -> RequestQueue:
        return self._queue

    def waiting_requests(self) -> list[Request]:
        """Every waiting request in dispatch order (O(n log n): for shutdown and tests, not per call)."""
        return list(self._queue)

    # -- the four calls ----------------------------------------------------------------------
    def submit(self, request: Request, now: float) -> Rejection | None:
        """One request of one input: ``submit_group([request], now)``."""
        return self.submit_group((request,), now)

    def submit_group(self, requests: Sequence[Request], now: float) -> Rejection | None:
        """Admit every input of one request, or none (``AdmissionController.check_group``). The inputs
        may be split across batches; the request counts as in progress until its last input is done,
        dropped or cancelled."""
        n = len(requests)
        if n == 0:
            raise ValueError("submit_group: a request needs at least one input")
        self.stats.submitted += n
        q = self._queue
        first = requests[0]
        backlog = self._backlog_ahead_s(first.tenant, requests, now) \
            if (self._reads_backlog or first.deadline is not None) else 0.0  # hot path in the simulator
        scale = self._in_flight.scale
        state = LoadState(self._num_requests, len(self._live), q.num_tokens, backlog, scale,
                          q.mean_work_s * scale if backlog else 0.0)
        rejection = self.admission.check_group(requests, now, state, self.tenants)
        if rejection is not None:
            self.stats.rejected[rejection.reason.value] += n
            if self.tenants is not None:
                self.tenants.refused(first.tenant, rejection.reason.value, now)
            return rejection
        if n > 1:
            group = first.id
            self._group_left[group] = n
            for r in requests:
                r.group = group
                r.tenant = first.tenant  # one request, one tenant
        for r in requests:
            q.push(r)
        self._num_requests += 1
        self.stats.admitted += n
        policy, bucketer = self.policy, self.bucketer
        for r in requests:
            policy.on_arrival(now)
            if bucketer is not None:
                bucketer.observe(r.length, now)
        return None

    # -- tenants -----------------------------------------------------------------------------
    def check_tenant(self, tenant: str, tokens: int, now: float) -> Rejection | None:
        """The tenant's quotas for a request of at least ``tokens`` tokens, charging nothing: what a
        server asks before it tokenises a request (``submit_group`` checks them again, exactly)."""
        if self.tenants is None:
            return None
        probe = Request(-1, now, max(tokens, 1), tenant=tenant)
        state = LoadState(self._num_requests, len(self._live), self._queue.num_tokens, 0.0)
        rejection = self.admission.check_quota(probe, probe.length, now, state, self.tenants)
        if rejection is not None:
            self.stats.rejected[rejection.reason.value] += 1
            self.tenants.refused(tenant, rejection.reason.value, now)
        return rejection

    def set_tenants(self, table: TenantTable, now: float) -> None:
        """New weights and quotas (a reloaded keys file), applied from now on."""
        if self.tenants is None:
            self.tenants = TenantLedger(table)
        else:
            self.tenants.set_table(table, now)

    def tenant_usage(self, now: float) -> list[TenantUsage]:
        """Every tenant the scheduler tracks, by name (empty without a ledger)."""
        if self.tenants is None:
            return []
        q = self._queue
        fair = q if isinstance(q, FairQueue) else None
        return [TenantUsage.of(name, st, now, fair.counter(name) if fair is not None else None,
                               fair.num_waiting_of(name) if fair is not None else 0)
                for name, st in self.tenants]

    def cancel(self, request_id: int, now: float) -> bool:
        req = self._queue.remove(request_id)
        if req is None:
            return False
        self.stats.cancelled += 1
        self._leave(req)
        return True

    def next_batch_at(self, batch: Batch, started_at: float) -> float:
        """When the slot that started ``batch`` at ``started_at`` takes its next batch: its predicted end
        (``predicted_s`` times ``work_scale``) less ``pipeline_lead_s``, so the next batch is collated
        while this one runs. Not earlier: a batch formed early is cut off from the requests that arrive
        meanwhile, and batching gains come from exactly those. With ``pipeline: off`` (as the deployment
        resolves "auto" where collation is too cheap to pay), never: ``inf``. The live slot and the
        simulator's slot both ask this."""
        if not self._pipeline:
            return math.inf  # the slot takes its next batch once it is free
        return started_at + batch.predicted_s * self._in_flight.scale - self._lead_s

    def schedule(self, now: float, free_slots: int) -> SchedulerOutput:
        out = SchedulerOutput()
        q = self._queue
        live = self._live  # the queue's id -> entry dict: len() of it skips two Python-level calls
        if not live:
            return out
        if self._deadlines:
            self._drop_expired(now, out)
        if self._timeout_s:
            self._drop_timed_out(now, out)
            if not live:
                return out
        wake: float | None = None
        policy, planner, stats = self.policy, self.planner, self.stats
        while free_slots > 0 and live:
            decision = policy.decide(now, QueueState(*q.aggregates(), free_slots))
            if isinstance(decision, Wait):
                if decision.until is None or decision.until > now:
                    wake = decision.until
                    break
                # A wake-up that is already due is due now; waiting on it would stall a virtual clock.
                decision = Dispatch(policy.batch_cap, True, "due")
            cap = decision.max_size
            plan = planner.plan(q.peek(cap * self._lookahead), cap, decision.urgent)
            fq = self._fair_queue
            if fq is not None and len(plan.requests) > 1 and fq.contended(now):
                plan = self._fair_cut(plan, fq)
            q.take(plan.requests)
            shape = plan.shape
            batch_id = self._next_batch_id
            self._next_batch_id = batch_id + 1
            out.batches.append(Batch(batch_id, plan.requests, plan.padded_len, shape, self._padding, now,
                                     plan.predicted_s))
            self._in_flight.add(batch_id, now, plan.predicted_s)
            stats.batches += 1
            stats.dispatched += shape.n
            stats.useful_tokens += shape.useful_tokens
            stats.computed_tokens += shape.tokens
            free_slots -= 1
        if live and self._deadlines:
            # Wake at the earliest deadline too, so an expired request is reported when it expires.
            urgent = q.most_urgent()
            if urgent is not None and urgent.deadline is not None:
                wake = urgent.deadline if wake is None else min(wake, urgent.deadline)
        if live and self._timeout_s:
            oldest = q.oldest()
            if oldest is not None:
                due = oldest.arrival + self._timeout_s
                wake = due if wake is None else min(wake, due)
        out.wake_at = wake
        return out

    def _fair_cut(self, plan: Plan, fq: FairQueue) -> Plan:
        """A contended batch under the fair order (``core/fair.py``): one led by a tenant in its burst
        holds only tenants in theirs (what it waits behind is then its own burst, not a flood's fill);
        any batch is cut to the quantum."""
        burst = fq.in_burst
        return self.planner.trim(plan, self._quantum_s,
                                 (lambda r: burst(r.tenant)) if burst(plan.requests[0].tenant) else None)

    def on_batch_done(self, batch: Batch, now: float, latency_s: float, ran: bool = True) -> None:
        """Every dispatched batch must be reported exactly once, also one that never ran (``ran=False``:
        everyone in it left first), or the backlog keeps counting it."""
        if self._in_flight.done(batch.id, latency_s if ran else None):
            for r in batch.requests:
                self._leave(r)
        if not ran:
            return
        self.stats.completed_batches += 1
        self.policy.on_batch_done(batch.size, now, latency_s)

    # -- internals ---------------------------------------------------------------------------
    def _leave(self, req: Request) -> None:
        """One input is done, dropped or cancelled: its request leaves with its last input."""
        group = req.group
        if group >= 0:
            left = self._group_left.get(group)
            if left is None:
                return
            if left > 1:
                self._group_left[group] = left - 1
                return
            del self._group_left[group]
        self._num_requests -= 1
        if self.tenants is not None:
            self.tenants.leave(req.tenant)

    def _drop(self, req: Request, out: SchedulerOutput, reason: RejectReason, message: str) -> None:
        out.dropped.append(Rejection(req, reason, message))
        self.stats.rejected[reason.value] += 1
        if self.tenants is not None:
            self.tenants.refused(req.tenant, reason.value)
        self._leave(req)

    def _backlog_ahead_s(self, tenant: str, requests: Sequence[Request], now: float) -> float:
        """The predicted work ahead of a new request: ``predicted_backlog_s``, or under the fair order
        the batches in flight and the part of the queue fair order serves before it
        (``FairQueue.work_ahead_s``)."""
        q = self._queue
        if not isinstance(q, FairQueue):
            return self.predicted_backlog_s(now)
        return self._in_flight.backlog_s(now, q.work_ahead_s(tenant, sum(r.length for r in requests)))

    def _drop_timed_out(self, now: float, out: SchedulerOutput) -> None:
        q, timeout = self._queue, self._timeout_s
        oldest = q.oldest()
        while oldest is not None and now - oldest.arrival >= timeout:
            q.remove(oldest.id)
            self._drop(oldest, out, RejectReason.DEADLINE_EXPIRED,
                       f"not started within the request timeout of {timeout:g} s")
            oldest = q.oldest()

    def _drop_expired(self, now: float, out: SchedulerOutput) -> None:
        q = self._queue
        for r in q.expire(now):
            late = now - (r.deadline if r.deadline is not None else now)
            self._drop(r, out, RejectReason.DEADLINE_EXPIRED,
                       f"deadline passed {late * 1e3:.1f} ms ago while waiting")
        if not self._drop_infeasible:
            return
        urgent = q.most_urgent()
        if urgent is None or urgent.deadline is None or urgent.deadline >= now + self._max_alone_q:
            return
        alone = self.admission.alone_latency_q
        for r in q.due_before(now + self._max_alone_q):
            need = alone(r.length)
            if r.deadline is not None and now + need > r.deadline:
                q.remove(r.id)
                self._drop(r, out, RejectReason.INFEASIBLE_DEADLINE,
                           f"dropped: {(r.deadline - now) * 1e3:.1f} ms left but it alone is predicted to "
                           f"take {need * 1e3:.1f} ms")
