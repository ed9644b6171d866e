"""When to dispatch: ``decide(now, state) -> Dispatch | Wait(until)``.

A policy is asked whenever a request arrives, a batch finishes, or a wake-up time it returned passes,
and only while an executor slot is free (work-conserving: while every slot is busy the queue simply
grows and the next batch is formed from everything waiting). It sees queue aggregates, never the
queue, so a decision is O(1). ``Dispatch.urgent`` tells the planner the head of the queue has waited
its bound and must be in this batch. ``Wait(None)`` means "nothing to do until something happens".

Each policy keeps its own EWMA of inter-arrival times (fed by ``on_arrival``) and may learn from
``on_batch_done`` (AIMD). ``wait_bound_s`` is how long a request can wait with a slot free before the
policy dispatches it: the starvation bound the tests check.

Windows open only when waiting can pay (``PolicyConfig.wait_only_if_it_pays``, on by default for every
windowed policy but ``static``): with a slot free, the policy waits for the next request only if it is
expected sooner than the cost model's break-even gap (``break_even_gap``). At light load the expected
gap is long, so a lone request is dispatched at once and batching costs it nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from batchpilot.core.admission import pad_length
from batchpilot.core.arrivals import GapAverage
from batchpilot.core.config import PlannerConfig, PolicyConfig
from batchpilot.core.costmodel import CostModel

_INF = math.inf


# Not frozen: these are built on every decision and a frozen dataclass's __init__ is ~3x slower.
@dataclass(slots=True)
class QueueState:
    """What a policy sees: cached queue aggregates (the scheduler keeps them O(1))."""

    num_waiting: int
    num_tokens: int
    oldest_arrival: float
    earliest_deadline: float = _INF
    max_length: int = 0
    free_slots: int = 1


@dataclass(slots=True)
class Dispatch:
    max_size: int
    urgent: bool = False  # the queue's head has waited its bound: it must be in this batch
    reason: str = ""


@dataclass(slots=True)
class Wait:
    until: float | None = None  # None: wait for an arrival or a batch end


Decision = Dispatch | Wait


class BatchEstimator:
    """Predicted latency of a batch of the ``n`` first waiting requests, without looking at them.

    Padded modes assume the longest waiting request sets the padded length (pessimistic, as an SLA
    check should be); padding-free assumes the average waiting length.
    """

    def __init__(self, planner: PlannerConfig, cost_model: CostModel) -> None:
        self.planner = planner
        self.cost_model = cost_model
        self.token_budget = planner.max_batch_tokens

    def latency(self, n: int, s: QueueState) -> float:
        p = self.planner
        if p.padding == "none":
            avg = s.num_tokens / s.num_waiting if s.num_waiting else 1.0
            return self.cost_model.batch_latency(n, n * avg, n * avg * avg)
        longest = p.max_len if p.padding == "max" else max(s.max_length, 1)
        padded = pad_length(longest, p.pad_to_multiple_of, p.max_len)
        return self.cost_model.batch_latency(n, n * padded, n * padded * padded)

    def latency_q(self, n: int, s: QueueState) -> float:
        return self.latency(n, s) * self.cost_model.q_factor

    def is_full(self, n: int, cap: int, tokens: int) -> bool:
        budget = self.planner.max_batch_tokens
        return n >= cap or (budget > 0 and tokens >= budget)


class Policy:
    """Base: Triton's fixed window (dispatch when full, or ``max_wait_s`` after the oldest arrival)."""

    name = "window"

    def __init__(self, config: PolicyConfig, estimator: BatchEstimator) -> None:
        self.config = config
        self.estimator = estimator
        self.cap = config.max_batch_size  # a plain attribute: read on every decision (AIMD moves it)
        self.arrivals = GapAverage(config.ewma_alpha)  # the gaps between arrivals (core/arrivals.py)

    @property
    def batch_cap(self) -> int:
        return self.cap

    @property
    def wait_bound_s(self) -> float:
        return self.config.max_wait_s

    def on_arrival(self, now: float) -> None:
        self.arrivals.observe(now)

    @property
    def mean_interarrival_s(self) -> float:
        """The moving average of the gaps between arrivals; inf until two arrivals were seen."""
        return self.arrivals.mean_s

    @property
    def last_arrival(self) -> float:
        return self.arrivals.last

    def expected_gap(self, now: float) -> float:
        """Expected seconds to the next arrival: the EWMA, or longer if it has been quiet longer."""
        return max(self.mean_interarrival_s, now - self.last_arrival)

    def on_batch_done(self, size: int, now: float, latency_s: float) -> None:
        return None

    def break_even_gap(self, n: int, s: QueueState) -> float:
        """With ``n`` waiting, dispatching now serves n in L(n); waiting one gap g serves n+1 in
        g + L(n+1). Waiting raises throughput only while g < (n+1)·L(n)/n − L(n+1), returned here."""
        lat_n = self.estimator.latency(n, s)
        return (n + 1) * lat_n / n - self.estimator.latency(n + 1, s)

    def _hold(self, now: float, s: QueueState, until: float) -> Decision:
        """``Wait(until)``, unless waiting cannot pay (``wait_only_if_it_pays``): the next request is
        expected later than the break-even gap, so the batch goes now (at light load: at once)."""
        if self.config.wait_only_if_it_pays:
            n = min(s.num_waiting, self.cap)
            if n and self.expected_gap(now) >= self.break_even_gap(n, s):
                return Dispatch(self.cap, False, "waiting does not pay")
        return Wait(until)

    def decide(self, now: float, s: QueueState) -> Decision:
        return self._window(now, s, self.cap, self.config.max_wait_s)

    def _window(self, now: float, s: QueueState, cap: int, wait_s: float) -> Decision:
        due = s.oldest_arrival + wait_s
        budget = self.estimator.token_budget
        if s.num_waiting >= cap or (budget and s.num_tokens >= budget):
            return Dispatch(cap, now >= due, "full")
        if now >= due:
            return Dispatch(cap, True, "window")
        return self._hold(now, s, due)


class WindowPolicy(Policy):
    name = "window"


class StaticPolicy(Policy):
    """Static batching: fire only full batches; ``max_wait_s`` is just the safety net against starvation
    (it never skips the wait: ``wait_only_if_it_pays`` does not apply)."""

    name = "static"

    def _hold(self, now: float, s: QueueState, until: float) -> Decision:
        return Wait(until)


class BacklogPolicy(Policy):
    """Fire as soon as ``backlog_requests`` requests (or ``backlog_tokens`` tokens) wait; window fallback."""

    name = "backlog"

    def decide(self, now: float, s: QueueState) -> Decision:
        c = self.config
        due = s.oldest_arrival + c.max_wait_s
        if s.num_waiting >= c.backlog_requests or (c.backlog_tokens and s.num_tokens >= c.backlog_tokens):
            return Dispatch(self.cap, now >= due, "backlog")
        budget = self.estimator.token_budget
        if s.num_waiting >= self.cap or (budget and s.num_tokens >= budget):
            return Dispatch(self.cap, now >= due, "full")
        if now >= due:
            return Dispatch(self.cap, True, "window")
        return self._hold(now, s, due)  # the window, inlined: this runs on every arrival and wake-up


class HybridPolicy(BacklogPolicy):
    """Window + backlog, plus patience: at the window's end a batch smaller than the backlog threshold
    waits up to ``patience_s`` longer when the arrival rate says another request is due before then
    and the most urgent request's p99 completion still fits its deadline."""

    name = "hybrid"

    @property
    def wait_bound_s(self) -> float:
        return self.config.max_wait_s + self.config.patience_s

    def decide(self, now: float, s: QueueState) -> Decision:
        c = self.config
        decision = BacklogPolicy.decide(self, now, s)
        if c.patience_s <= 0 or isinstance(decision, Wait) or decision.reason != "window":
            return decision
        extended = s.oldest_arrival + c.max_wait_s + c.patience_s
        if now >= extended or self.expected_gap(now) > extended - now:
            return decision
        deadline = min(s.earliest_deadline, s.oldest_arrival + c.sla_s)
        n = min(s.num_waiting + 1, self.cap)
        if extended + self.estimator.latency_q(n, s) > deadline:
            return decision
        return Wait(extended)


class AdaptivePolicy(Policy):
    """Window sized to the time a full batch takes to arrive (cap × EWMA inter-arrival), clamped to
    [min_wait_s, max_wait_s]: faster arrivals, narrower window."""

    name = "adaptive"

    def window_s(self) -> float:
        c = self.config
        return min(max(self.cap * self.mean_interarrival_s, c.min_wait_s), c.max_wait_s)

    def decide(self, now: float, s: QueueState) -> Decision:
        return self._window(now, s, self.cap, self.window_s())


class SlaPolicy(Policy):
    """Wait only while it pays and is safe.

    *Pays*: with ``n`` waiting, dispatching now serves n in L(n); waiting one expected gap g serves
    n+1 in g + L(n+1). Waiting raises throughput while g < g* = (n+1)·L(n)/n − L(n+1).
    *Safe*: the most urgent request (earliest deadline, or oldest arrival + ``sla_s``) still finishes by
    its deadline at the cost model's high quantile: dispatch no later than deadline − Lq(n+1).
    If the urgent request cannot make it even now, it is dispatched at once (``on_infeasible:
    dispatch``) or the scheduler drops what cannot be saved (``drop``).
    """

    name = "sla"

    @property
    def wait_bound_s(self) -> float:
        return self.config.sla_s

    def decide(self, now: float, s: QueueState) -> Decision:
        cap = self.cap
        n = min(s.num_waiting, cap)
        deadline = min(s.earliest_deadline, s.oldest_arrival + self.config.sla_s)
        latest = deadline - self.estimator.latency_q(n + 1, s)
        if self.estimator.is_full(s.num_waiting, cap, s.num_tokens):
            return Dispatch(cap, now >= latest, "full")  # urgent: a full batch must not skip the head
        if now >= latest:
            return Dispatch(cap, True, "deadline")
        if self.mean_interarrival_s == _INF:
            return Dispatch(cap, False, "no arrivals expected")
        gap_star = self.break_even_gap(n, s)
        until = min(latest, self.last_arrival + gap_star)
        if self.expected_gap(now) >= gap_star or until <= now:
            return Dispatch(cap, False, "throughput")
        return Wait(until)


class AimdPolicy(Policy):
    """Clipper's AIMD on the batch cap: +``aimd_add`` after a full batch that met ``aimd_target_s``,
    × ``aimd_mult`` after one that missed it. Dispatch itself is the fixed window with that cap."""

    name = "aimd"

    def __init__(self, config: PolicyConfig, estimator: BatchEstimator) -> None:
        super().__init__(config, estimator)
        self.cap = min(config.aimd_min_batch, config.max_batch_size)

    def on_batch_done(self, size: int, now: float, latency_s: float) -> None:
        c = self.config
        if latency_s > c.aimd_target_s:
            self.cap = max(c.aimd_min_batch, int(self.cap * c.aimd_mult))
        elif size >= self.cap:
            self.cap = min(c.max_batch_size, self.cap + c.aimd_add)


_POLICIES: dict[str, type[Policy]] = {
    "static": StaticPolicy, "window": WindowPolicy, "backlog": BacklogPolicy, "hybrid": HybridPolicy,
    "adaptive": AdaptivePolicy, "sla": SlaPolicy, "aimd": AimdPolicy,
}


def make_policy(config: PolicyConfig, cost_model: CostModel, planner: PlannerConfig | None = None) -> Policy:
    """Build the configured policy; ``planner`` tells its latency estimates how batches are padded."""
    return _POLICIES[config.name](config, BatchEstimator(planner or PlannerConfig(), cost_model))
