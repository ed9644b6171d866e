"""What gets into the queue: length, deadline feasibility, queue bounds, and a token-bucket rate limit.

Checks run cheapest-and-most-permanent first, so a client learns the reason that retrying will not
fix (too long, infeasible) before the one that retrying will (queue full, rate limited). The token
bucket is charged only for requests that are admitted.

Every ``Rejection`` carries a reason a server maps to a status (400 too long, 429 rate limited or
infeasible, 503 queue full, 504 expired), a message that says what happened in numbers, and a
``retry_after_s`` where waiting would help.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from .config import AdmissionConfig, PlannerConfig
from .costmodel import CostModel
from .overload import work_refusal
from .request import Request


class RejectReason(enum.Enum):
    """Why a request was not (or will not be) served. Servers map these to HTTP statuses."""

    QUEUE_FULL = "queue_full"  # 503 + Retry-After
    RATE_LIMITED = "rate_limited"  # 429 + Retry-After
    INFEASIBLE_DEADLINE = "infeasible_deadline"  # 429: cannot finish in time even alone, now
    TOO_LONG = "too_long"  # 400: longer than the model / budget allows
    DEADLINE_EXPIRED = "deadline_expired"  # dropped from the queue: its deadline passed (504)
    CANCELLED = "cancelled"
    SHUTTING_DOWN = "shutting_down"  # 503


@dataclass(frozen=True, slots=True)
class Rejection:
    request: Request
    reason: RejectReason
    message: str
    retry_after_s: float | None = None


def pad_length(max_len_in_batch: int, multiple: int, cap: int) -> int:
    """Round up to a multiple (tensor-core friendly shapes) without exceeding the model's limit."""
    padded = -(-max_len_in_batch // multiple) * multiple
    return min(max(padded, max_len_in_batch), max(cap, max_len_in_batch))


class TokenBucket:
    """``rate`` tokens per second up to ``burst``; starts full. Time is the caller's clock."""

    def __init__(self, rate: float, burst: int) -> None:
        self.rate = rate
        self.burst = float(burst)
        self._tokens = float(burst)
        self._last: float | None = None

    def _refill(self, now: float) -> None:
        if self._last is not None and now > self._last:
            self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate)
        if self._last is None or now > self._last:
            self._last = now

    def try_take(self, now: float) -> float:
        """Take one token: returns 0.0 on success, else the seconds until one is available."""
        self._refill(now)
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return 0.0
        return (1.0 - self._tokens) / self.rate


class AdmissionController:
    """Decides ``submit``: ``check`` returns None (admit; the bucket is charged) or a ``Rejection``."""

    def __init__(self, config: AdmissionConfig, planner: PlannerConfig, cost_model: CostModel,
                 max_batch_size: int, num_slots: int = 1) -> None:
        self.config = config
        self.planner = planner
        self.cost_model = cost_model
        self.max_batch_size = max_batch_size
        self.num_slots = max(num_slots, 1)
        self.max_length = min(config.max_length, planner.max_len)
        self.bucket = TokenBucket(config.rate, config.burst) if config.rate > 0 else None
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

    def check(self, req: Request, now: float, num_waiting: int, num_waiting_tokens: int,
              predicted_backlog_s: float = 0.0, work_scale: float = 1.0) -> Rejection | None:
        cfg = self.config
        length = req.length
        if length > self._limit:
            if length > self.max_length:
                message = (f"input has {length} tokens; the limit is {self.max_length}: "
                           "shorten or split the input")
            else:
                message = self._budget_problem(length) or f"input of {length} tokens does not fit a batch"
            return Rejection(req, RejectReason.TOO_LONG, message)
        if req.deadline is not None and cfg.reject_infeasible:
            need = self._alone_q[length]
            slack = req.deadline - now
            if need > slack:
                return Rejection(req, RejectReason.INFEASIBLE_DEADLINE,
                                 f"deadline leaves {slack * 1e3:.1f} ms but this input alone is predicted "
                                 f"to take {need * 1e3:.1f} ms (p{self.cost_model.quantile * 100:g})")
        if cfg.max_queued_requests and num_waiting >= cfg.max_queued_requests:
            return Rejection(req, RejectReason.QUEUE_FULL,
                             f"{num_waiting} requests are waiting (admission.max_queued_requests)",
                             self._drain_s(num_waiting, num_waiting_tokens))
        if cfg.max_queued_tokens and num_waiting_tokens + req.length > cfg.max_queued_tokens:
            return Rejection(req, RejectReason.QUEUE_FULL,
                             f"{num_waiting_tokens} tokens are waiting and this input adds {req.length} "
                             f"(admission.max_queued_tokens = {cfg.max_queued_tokens})",
                             self._drain_s(num_waiting, num_waiting_tokens))
        if cfg.max_backlog_s:
            own = self.work_s[length] * work_scale
            over = work_refusal(cfg.max_backlog_s, num_waiting, predicted_backlog_s, own)
            if over > 0.0:
                return Rejection(req, RejectReason.QUEUE_FULL,
                                 f"{predicted_backlog_s * 1e3:.0f} ms of predicted work is waiting and this "
                                 f"input adds {own * 1e3:.1f} ms "
                                 f"(admission.max_backlog_s = {cfg.max_backlog_s * 1e3:.0f} ms)",
                                 over)
        if self.bucket is not None:
            wait = self.bucket.try_take(now)
            if wait > 0.0:
                return Rejection(req, RejectReason.RATE_LIMITED,
                                 f"over the admitted rate of {cfg.rate:g} requests/s (burst {cfg.burst})",
                                 wait)
        return None

    def _drain_s(self, num_waiting: int, num_waiting_tokens: int) -> float:
        """Retry hint: predicted time for one full batch of the current average length to finish."""
        avg = max(1, num_waiting_tokens // max(num_waiting, 1))
        n = self.max_batch_size
        return self.cost_model.batch_latency(n, n * avg, n * avg * avg)
