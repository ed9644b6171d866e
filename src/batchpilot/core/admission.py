"""What gets into the queue: one decision per request (all of its inputs, or none of them).

Rules: each input's length and deadline feasibility; the concurrency limit (requests in progress);
queue bounds in inputs, tokens and predicted work; a declared latency SLA or the inputs' own deadlines
against the predicted completion; a token-bucket rate limit. Checks run cheapest-and-most-permanent
first, so a client learns the reason that retrying will not fix (too long, infeasible) before the one
that retrying will (queue full, rate limited). The token bucket is charged only for requests that are
admitted. The server and the simulator both reach these rules through ``BatchScheduler.submit_group``:
there is no admission anywhere else.

Every ``Rejection`` carries a reason a server maps to a status (400 too long, 429 rate limited or
infeasible, 503 queue full, 504 expired), a message that says what happened in numbers, and a
``retry_after_s`` where waiting would help.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass

from batchpilot.core.arrivals import GapAverage
from batchpilot.core.bucket import TokenBucket
from batchpilot.core.config import AdmissionConfig, PlannerConfig
from batchpilot.core.costmodel import CostModel
from batchpilot.core.request import Request
from batchpilot.core.tenants import TenantLedger, admits_over_limit

OFFER_GAP_ALPHA = 1.0 / 16  # the moving average of the gaps between offered requests


class RejectReason(enum.Enum):
    """Why a request was not (or will not be) served. Servers map these to HTTP statuses."""

    QUEUE_FULL = "queue_full"  # 503 + Retry-After
    RATE_LIMITED = "rate_limited"  # 429 + Retry-After
    INFEASIBLE_DEADLINE = "infeasible_deadline"  # 429: cannot finish in time even alone, now
    TOO_LONG = "too_long"  # 400: longer than the model / budget allows
    DEADLINE_EXPIRED = "deadline_expired"  # dropped from the queue: its deadline passed (504)
    CANCELLED = "cancelled"
    SHUTTING_DOWN = "shutting_down"  # 503
    QUOTA_TOKENS = "quota_tokens"  # 429 + Retry-After: over the tenant's tokens per second
    QUOTA_CONCURRENCY = "quota_concurrency"  # 429 + Retry-After: at the tenant's concurrent requests


@dataclass(frozen=True, slots=True)
class LoadState:
    """What admission reads of the scheduler's state for one request (``BatchScheduler._load``)."""

    num_requests: int  # requests admitted and not finished
    num_waiting: int  # inputs waiting
    num_tokens: int  # tokens waiting
    backlog_s: float  # predicted seconds of work ahead, per slot (``BatchScheduler.predicted_backlog_s``)
    work_scale: float = 1.0  # measured / predicted batch seconds (``BatchScheduler.work_scale``)
    mate_s: float = 0.0  # what an input arriving next adds to the backlog (``RequestQueue.mean_work_s``
    #                      times work_scale)


def predicted_completion_s(ahead_s: float, own_s: float, mates_s: float) -> float:
    """Seconds from now until a request finishes, as admission predicts it: the work ahead of it (batches
    in flight, their remaining predicted time, and the queue), its own inputs' share of full batches,
    and its batch-mates behind it (``batch_mates_s``). Under load the queue drains in full batches in
    queue order, so a share is what each input adds to the wait of those behind it; but an input is
    done only when its whole batch is. The prediction is the simulator's too, since admission runs
    inside the core."""
    return ahead_s + own_s + mates_s


def batch_mates_s(num_waiting: int, num_inputs: int, batch_size: int, mate_s: float, own_s: float,
                  num_slots: int, arriving: float) -> float:
    """Seconds a request's last input waits for the batch-mates that join its batch after it, and for
    the part of its own work ``own_s`` (per slot) does not count, since one slot runs its whole batch.

    The request's inputs take queue places ``num_waiting .. num_waiting + num_inputs - 1``; draining in
    full batches of ``batch_size`` in queue order, its last batch has room for ``batch_size - 1 -
    (last place mod batch_size)`` inputs after it, of which only the ``arriving`` inputs expected before
    the batch starts come, each adding ``mate_s`` per slot (what recent inputs added on average)."""
    behind = min(batch_size - 1 - (num_waiting + num_inputs - 1) % batch_size, arriving)
    return (behind * mate_s + own_s) * num_slots - own_s


@dataclass(frozen=True, slots=True)
class Rejection:
    request: Request
    reason: RejectReason
    message: str
    retry_after_s: float | None = None


def work_refusal(max_backlog_s: float, num_waiting: int, backlog_s: float, added_work_s: float) -> float:
    """0.0 to admit, else how many seconds of work over the bound admitting would put the backlog (the
    Retry-After hint). An empty queue always admits: a request larger than the bound alone would
    otherwise never be served."""
    if not max_backlog_s or not num_waiting:
        return 0.0
    return max(backlog_s + added_work_s - max_backlog_s, 0.0)


def pad_length(max_len_in_batch: int, multiple: int, cap: int) -> int:
    """Round up to a multiple (tensor-core friendly shapes) without exceeding the model's limit."""
    padded = -(-max_len_in_batch // multiple) * multiple
    return min(max(padded, max_len_in_batch), max(cap, max_len_in_batch))


class AdmissionController:
    """Decides ``submit``: ``check`` returns None (admit; the bucket is charged) or a ``Rejection``."""

    def __init__(self, config: AdmissionConfig, planner: PlannerConfig, cost_model: CostModel,
                 max_batch_size: int, num_slots: int = 1, fair: bool = False) -> None:
        """``fair``: the queue order is ``fair`` (``core/fair.py``), so the request bounds are shared
        among tenants (``check_group``)."""
        self.config = config
        self.fair = fair
        self.planner = planner
        self.cost_model = cost_model
        self.max_batch_size = max_batch_size
        self.num_slots = max(num_slots, 1)
        self.max_length = min(config.max_length, planner.max_len)
        self.bucket = TokenBucket(config.rate, config.burst) if config.rate > 0 else None
        # A moving average of the gaps between offered requests, refused ones too: how fast the
        # batch-mates of a request come (``batch_mates_s``). inf until two requests were offered.
        self._offers = GapAverage(OFFER_GAP_ALPHA)
        # Per length, precomputed once: p99 alone, and whether it fits the batch budgets alone
        # (monotone in length, so one limit). ``check`` is then a few comparisons.
        self._alone_q = [self._alone_latency_q(x) for x in range(self.max_length + 1)]
        self._limit = self.max_length
        while self._limit > 0 and self._budget_problem(self._limit):
            self._limit -= 1
        self.work_s = [self._work_s(x) for x in range(self.max_length + 1)]

    def _work_s(self, length: int) -> float:
        """Seconds one input of ``length`` adds to draining a backlog: its share of the largest batch of
        such inputs the planner's budgets allow (under load the queue drains in full batches), spread
        over the slots. What ``max_backlog_s`` bounds: a length-mix-aware queue bound, where a token
        bound sized for the longest inputs refuses short ones long before they would miss the SLA."""
        _, tokens, attn = self._alone(max(length, 1))
        n = self.max_batch_size
        if self.planner.max_batch_tokens:
            n = max(1, min(n, self.planner.max_batch_tokens // max(tokens, 1)))
        mem_budget = self.planner.max_batch_memory_bytes
        while n > 1 and mem_budget and self.cost_model.batch_memory(n, n * tokens, n * attn) > mem_budget:
            n = max(1, n // 2)
        return self.cost_model.batch_latency(n, n * tokens, n * attn) / (n * self.num_slots)

    def alone_latency_q(self, length: int) -> float:
        """Predicted high-quantile seconds of this request dispatched alone (as the planner pads it)."""
        if 0 <= length < len(self._alone_q):
            return self._alone_q[length]
        return self._alone_latency_q(length)

    def _alone_latency_q(self, length: int) -> float:
        n, tokens, attn = self._alone(length)
        return self.cost_model.batch_latency(n, tokens, attn) * self.cost_model.q_factor

    def _alone(self, length: int) -> tuple[int, int, int]:
        p = self.planner
        if p.padding == "none":
            return 1, length, length * length
        longest = p.max_len if p.padding == "max" else length
        padded = pad_length(longest, p.pad_to_multiple_of, p.max_len)
        return 1, padded, padded * padded

    def _budget_problem(self, length: int) -> str | None:
        """Why a request of this length cannot form a batch even alone (None if it can).

        Bucket edges move with refits, so with bucket padding the check assumes the widest edge.
        """
        p = self.planner
        n, tokens, attn = self._alone(p.max_len if p.padding == "bucket" else length)
        budget = self.planner.max_batch_tokens
        if budget and tokens > budget:
            return f"input needs {tokens} tokens of batch budget alone; planner.max_batch_tokens is {budget}"
        mem_budget = self.planner.max_batch_memory_bytes
        if mem_budget and self.cost_model.batch_memory(n, tokens, attn) > mem_budget:
            return (f"input of {length} tokens needs more than the batch memory budget "
                    f"({mem_budget:.0f} bytes) alone")
        return None

    def check_input(self, req: Request, now: float) -> Rejection | None:
        """The checks of one input that no queue state changes: too long (400), and a deadline it cannot
        meet even dispatched alone now (429). Retrying the same input would not help."""
        length = req.length
        if length > self._limit:
            if length > self.max_length:
                message = (f"input has {length} tokens; the limit is {self.max_length}: "
                           "shorten or split the input")
            else:
                message = self._budget_problem(length) or f"input of {length} tokens does not fit a batch"
            return Rejection(req, RejectReason.TOO_LONG, message)
        if req.deadline is not None and self.config.reject_infeasible:
            need = self._alone_q[length]
            slack = req.deadline - now
            if need > slack:
                return Rejection(req, RejectReason.INFEASIBLE_DEADLINE,
                                 f"deadline leaves {slack * 1e3:.1f} ms but this input alone is predicted "
                                 f"to take {need * 1e3:.1f} ms (p{self.cost_model.quantile * 100:g})")
        return None

    def check_group(self, reqs: Sequence[Request], now: float, state: LoadState,
                    tenants: TenantLedger | None = None) -> Rejection | None:
        """Admit the request ``reqs`` (one or more inputs) as a whole, or refuse it: None (admit; the rate
        bucket and the tenant's quota are charged once) or the ``Rejection`` of the first rule it breaks,
        naming the request's first input. Rules, cheapest and most permanent first: each input's own
        checks (``check_input``); the tenant's quotas (``check_quota``, with ``tenants``); the concurrency
        limit; the queue bounds (inputs, tokens, predicted work), which always admit into an empty queue,
        so a request larger than a bound is served alone rather than refused forever; a declared latency
        SLA or the inputs' own deadlines against the predicted completion (``predicted_completion_s``);
        the rate limit. Under the ``fair`` order a tenant below its weighted share of the concurrency
        limit is admitted at the limit (up to twice it): a tenant that floods the server cannot lock the
        others out."""
        first = reqs[0]
        self._offers.observe(now)
        for r in reqs:
            rej = self.check_input(r, now)
            if rej is not None:
                return rej
        n = len(reqs)
        tokens = sum(r.length for r in reqs) if n > 1 else first.length
        if tenants is not None:
            rej = self.check_quota(first, tokens, now, state, tenants)
            if rej is not None:
                return rej
        rej = self._check_bounds(first, n, tokens, state, tenants)
        if rej is not None:
            return rej
        cfg = self.config
        if cfg.max_backlog_s or cfg.latency_sla_s or first.deadline is not None:
            rej = self._check_latency(reqs, now, state)
            if rej is not None:
                return rej
        if self.bucket is not None:
            wait = self.bucket.try_take(now)
            if wait > 0.0:
                return Rejection(first, RejectReason.RATE_LIMITED,
                                 f"over the admitted rate of {cfg.rate:g} requests/s (burst {cfg.burst})",
                                 wait)
        if tenants is not None:
            tenants.admit(first.tenant, tokens, now)
        return None

    def check_quota(self, first: Request, tokens: int, now: float, state: LoadState,
                    tenants: TenantLedger) -> Rejection | None:
        """The tenant's quotas (``TenantLedger.check``) for a request of ``tokens`` tokens; charges nothing.
        Over the token quota, ``retry_after_s`` is when the bucket holds them; at the concurrency quota,
        one full batch's predicted time."""
        refusal = tenants.check(first.tenant, tokens, now)
        if refusal is None:
            return None
        if refusal.quota == "tokens":
            return Rejection(first, RejectReason.QUOTA_TOKENS, refusal.message, refusal.retry_after_s)
        return Rejection(first, RejectReason.QUOTA_CONCURRENCY, refusal.message,
                         self._drain_s(state.num_waiting, state.num_tokens))

    def _check_bounds(self, first: Request, n: int, tokens: int, state: LoadState,
                      tenants: TenantLedger | None) -> Rejection | None:
        """The concurrency limit and the queue bounds in inputs and tokens."""
        cfg = self.config
        limit = cfg.max_concurrent_requests
        if limit and state.num_requests >= limit:
            share = tenants.share(first.tenant, limit) if self.fair and tenants is not None else 0.0
            held = tenants.in_progress(first.tenant) if tenants is not None else 0
            if not admits_over_limit(held, share, state.num_requests, limit):
                why = (f"; tenant {first.tenant!r} holds {held}, its weighted share is {share:.1f}"
                       if share else "")
                return Rejection(first, RejectReason.QUEUE_FULL,
                                 f"{state.num_requests} requests are in progress "
                                 f"(admission.max_concurrent_requests = {limit}){why}",
                                 self._drain_s(state.num_waiting, state.num_tokens))
        waiting = state.num_waiting
        if waiting and cfg.max_queued_requests and waiting + n > cfg.max_queued_requests:
            return Rejection(first, RejectReason.QUEUE_FULL,
                             f"{waiting} inputs are waiting and this request adds {n} "
                             f"(admission.max_queued_requests = {cfg.max_queued_requests})",
                             self._drain_s(waiting, state.num_tokens))
        if waiting and cfg.max_queued_tokens and state.num_tokens + tokens > cfg.max_queued_tokens:
            return Rejection(first, RejectReason.QUEUE_FULL,
                             f"{state.num_tokens} tokens are waiting and this request adds {tokens} "
                             f"(admission.max_queued_tokens = {cfg.max_queued_tokens})",
                             self._drain_s(waiting, state.num_tokens))
        return None

    def _check_latency(self, reqs: Sequence[Request], now: float, state: LoadState) -> Rejection | None:
        """The work bound, a declared latency SLA and the inputs' own deadlines against the predicted
        completion (``state.backlog_s`` is the work ahead of this request)."""
        cfg = self.config
        first, n, waiting = reqs[0], len(reqs), state.num_waiting
        work = self.work_s
        own = (sum(work[r.length] for r in reqs) if n > 1 else work[first.length]) * state.work_scale
        ahead = state.backlog_s
        if cfg.max_backlog_s:
            over = work_refusal(cfg.max_backlog_s, waiting, ahead, own)
            if over > 0.0:
                return Rejection(first, RejectReason.QUEUE_FULL,
                                 f"{ahead * 1e3:.0f} ms of predicted work is waiting and this request "
                                 f"adds {own * 1e3:.1f} ms "
                                 f"(admission.max_backlog_s = {cfg.max_backlog_s * 1e3:.0f} ms)", over)
        if ahead <= 0.0:
            return None
        gap = self._offers.mean_s
        mates = batch_mates_s(waiting, n, self.max_batch_size, state.mate_s, own, self.num_slots,
                              ahead / gap if gap > 0.0 else math.inf)
        done_in = predicted_completion_s(ahead, own, mates)
        if cfg.latency_sla_s and done_in > cfg.latency_sla_s:
            return Rejection(first, RejectReason.QUEUE_FULL,
                             f"predicted to finish in {done_in * 1e3:.0f} ms "
                             f"({ahead * 1e3:.0f} ms of work ahead + {own * 1e3:.0f} ms of its own "
                             f"+ {mates * 1e3:.0f} ms of batch-mates after it), "
                             "over the latency SLA "
                             f"of {cfg.latency_sla_s * 1e3:.0f} ms", done_in - cfg.latency_sla_s)
        deadline = min((r.deadline for r in reqs if r.deadline is not None), default=None)
        if deadline is not None and now + done_in > deadline:
            return Rejection(first, RejectReason.QUEUE_FULL,
                             f"predicted to finish in {done_in * 1e3:.0f} ms behind "
                             f"{ahead * 1e3:.0f} ms of work; its deadline leaves "
                             f"{(deadline - now) * 1e3:.0f} ms", now + done_in - deadline)
        return None

    def _drain_s(self, num_waiting: int, num_waiting_tokens: int) -> float:
        """Retry hint: predicted time for one full batch of the current average length to finish."""
        avg = max(1, num_waiting_tokens // max(num_waiting, 1))
        n = self.max_batch_size
        return self.cost_model.batch_latency(n, n * avg, n * avg * avg)
