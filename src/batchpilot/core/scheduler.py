"""The encoder scheduling core: a state machine with two calls, driven by any clock.

    submit(request, now)          -> None (admitted) | Rejection
    schedule(now, free_slots)     -> SchedulerOutput(batches, dropped, wake_at)
    on_batch_done(batch, now, s)  -> None  (feeds adaptive policies)
    cancel(request_id, now)       -> bool

The live driver (runtime/), the simulator (sim/) and the tests call exactly these. Drivers call
``schedule`` whenever a request arrives, a batch finishes, or ``wake_at`` passes; they never decide
anything themselves. Nothing here reads a clock, awaits, or imports torch.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field

from .config import SchedulerConfig
from .costmodel import BatchShape, CostModel
from .request import IdCounter, Request


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


@dataclass(slots=True)
class Batch:
    """A dispatched batch: plain data the executor runs and the simulator times."""

    id: int
    requests: list[Request]
    padded_len: int
    shape: BatchShape
    padding: str
    formed_at: float
    predicted_s: float = 0.0

    @property
    def size(self) -> int:
        return len(self.requests)


@dataclass(slots=True)
class SchedulerOutput:
    batches: list[Batch] = field(default_factory=list)
    dropped: list[Rejection] = field(default_factory=list)
    wake_at: float | None = None  # call schedule() again at this time if nothing else happens first


def pad_length(max_len_in_batch: int, multiple: int, cap: int) -> int:
    """Round up to a multiple (tensor-core friendly shapes) without exceeding the model's limit."""
    padded = -(-max_len_in_batch // multiple) * multiple
    return min(max(padded, max_len_in_batch), max(cap, max_len_in_batch))


class BatchScheduler:
    """Minimal reference implementation: FCFS queue, fixed window, FIFO batches, dynamic padding.

    The full policy/planner/queue/admission set plugs in behind the same four calls.
    """

    def __init__(self, config: SchedulerConfig | None = None, cost_model: CostModel | None = None) -> None:
        self.config = config or SchedulerConfig()
        self.cost_model = cost_model or CostModel.default_cpu_minilm()
        self._queue: deque[Request] = deque()
        self._batch_ids = IdCounter()
        self._num_tokens = 0

    @property
    def num_waiting(self) -> int:
        return len(self._queue)

    @property
    def num_waiting_tokens(self) -> int:
        return self._num_tokens

    def submit(self, request: Request, now: float) -> Rejection | None:
        max_len = self.config.admission.max_length
        if request.length > max_len:
            return Rejection(request, RejectReason.TOO_LONG,
                             f"input has {request.length} tokens; the limit is {max_len}")
        self._queue.append(request)
        self._num_tokens += request.length
        return None

    def cancel(self, request_id: int, now: float) -> bool:
        for req in self._queue:
            if req.id == request_id:
                self._queue.remove(req)
                self._num_tokens -= req.length
                return True
        return False

    def schedule(self, now: float, free_slots: int) -> SchedulerOutput:
        out = SchedulerOutput()
        pol = self.config.policy
        while free_slots > 0 and self._queue:
            oldest = self._queue[0].arrival
            if len(self._queue) < pol.max_batch_size and now < oldest + pol.max_wait_s:
                out.wake_at = oldest + pol.max_wait_s
                break
            reqs = [self._queue.popleft() for _ in range(min(pol.max_batch_size, len(self._queue)))]
            self._num_tokens -= sum(r.length for r in reqs)
            out.batches.append(self._make_batch(reqs, now))
            free_slots -= 1
        return out

    def on_batch_done(self, batch: Batch, now: float, latency_s: float) -> None:
        return None

    def _make_batch(self, reqs: list[Request], now: float) -> Batch:
        plan = self.config.planner
        lengths = [r.length for r in reqs]
        if plan.padding == "none":
            shape = BatchShape.ragged(lengths)
            padded = shape.padded_len
        else:
            longest = plan.max_len if plan.padding == "max" else max(lengths)
            padded = pad_length(longest, plan.pad_to_multiple_of, plan.max_len)
            shape = BatchShape.padded(lengths, padded)
        return Batch(self._batch_ids(), reqs, padded, shape, plan.padding, now, self.cost_model.latency(shape))
