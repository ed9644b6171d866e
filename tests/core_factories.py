"""Factories for the scheduling-core tests: requests, schedulers, a fake clock and a fake executor.

Nothing here sleeps or reads a clock: time is whatever ``FakeClock`` says, and the fake executor
finishes a batch after the cost model's predicted latency (or a fixed one) of fake time.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from batchpilot.core.admission import Rejection
from batchpilot.core.batch import Batch
from batchpilot.core.config import (
    AdmissionConfig,
    BucketingConfig,
    PlannerConfig,
    PolicyConfig,
    SchedulerConfig,
)
from batchpilot.core.costmodel import CostModel
from batchpilot.core.request import Request
from batchpilot.core.scheduler import BatchScheduler

_ids = iter(range(10**9))


def make_request(length: int = 16, arrival: float = 0.0, *, id: int | None = None, priority: int = 0,
                 deadline: float | None = None, sla: float | None = None, tenant: str = "default") -> Request:
    return Request(next(_ids) if id is None else id, arrival, length, priority, deadline, sla, tenant=tenant)


def simple_cost_model(const: float = 0.010, per_req: float = 0.0, per_token: float = 1e-4,
                      attn: float = 0.0, residuals: tuple[float, ...] = ()) -> CostModel:
    """A hand-set linear model: easy to reason about in assertions."""
    return CostModel(latency_coef=(const, per_req, per_token, attn), memory_coef=(0.0, 0.0, 1000.0, 0.0),
                     rel_residuals=residuals)


def make_config(policy: dict[str, Any] | None = None, planner: dict[str, Any] | None = None,
                admission: dict[str, Any] | None = None, bucketing: dict[str, Any] | None = None,
                **top: Any) -> SchedulerConfig:
    return SchedulerConfig(
        policy=PolicyConfig(**(policy or {})),
        planner=PlannerConfig(**{"padding": "dynamic", **(planner or {})}),
        admission=AdmissionConfig(**(admission or {})),
        bucketing=BucketingConfig(**(bucketing or {})),
        **top,
    )


def make_scheduler(cost_model: CostModel | None = None, **kwargs: Any) -> BatchScheduler:
    return BatchScheduler(make_config(**kwargs), cost_model or simple_cost_model())


class FakeClock:
    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def advance(self, dt: float) -> float:
        self.now += dt
        return self.now

    def __call__(self) -> float:
        return self.now


@dataclass
class RunLog:
    """Everything a driver saw: for property checks."""

    batches: list[tuple[float, Batch]] = field(default_factory=list)  # (dispatch time, batch)
    rejected: list[Rejection] = field(default_factory=list)  # at submit
    dropped: list[Rejection] = field(default_factory=list)  # from schedule
    admitted: list[Request] = field(default_factory=list)
    free_slots_at_dispatch: list[int] = field(default_factory=list)
    leftover_checks: list[tuple[float, int, list[Request]]] = field(default_factory=list)
    # per schedule() call that dispatched: (now, queue head before the call, oldest arrival, first batch)
    head_checks: list[tuple[float, Request, float, Batch]] = field(default_factory=list)


def drive(sched: BatchScheduler, arrivals: list[Request], slots: int = 1,
          service_s: float | None = None, horizon: float = 1e9, check_leftovers: bool = False) -> RunLog:
    """A tiny discrete-event driver (the same contract as sim/ and runtime/): calls ``schedule`` on
    every arrival, batch end and ``wake_at``; a batch takes ``service_s`` (or its predicted time)."""
    log = RunLog()
    events: list[tuple[float, int, int, Any]] = []  # (time, kind, seq, payload): 0 done, 1 arrive, 2 wake
    seq = 0
    for r in arrivals:
        heapq.heappush(events, (r.arrival, 1, seq, r))
        seq += 1
    free = slots
    while events:
        now, kind, _, payload = heapq.heappop(events)
        if now > horizon:
            break
        if kind == 0:
            free += 1
            sched.on_batch_done(payload, now, service_s if service_s is not None else payload.predicted_s)
        elif kind == 1:
            rej = sched.submit(payload, now)
            if rej is None:
                log.admitted.append(payload)
            else:
                log.rejected.append(rej)
        head, oldest = sched.queue.head(), sched.queue.oldest()
        out = sched.schedule(now, free)
        if out.batches and head is not None and oldest is not None and head.id not in {
                d.request.id for d in out.dropped}:
            log.head_checks.append((now, head, oldest.arrival, out.batches[0]))
        log.dropped.extend(out.dropped)
        for b in out.batches:
            log.batches.append((now, b))
            log.free_slots_at_dispatch.append(free)
            free -= 1
            dur = service_s if service_s is not None else b.predicted_s
            heapq.heappush(events, (now + dur, 0, seq, b))
            seq += 1
        if check_leftovers and free > 0:
            log.leftover_checks.append((now, free, sched.waiting_requests()))
        if out.wake_at is not None:
            assert out.wake_at > now, f"wake_at {out.wake_at} is not after now {now}"
            heapq.heappush(events, (out.wake_at, 2, seq, None))
            seq += 1
    return log


def lindley_waits(arrivals: np.ndarray, service: float) -> np.ndarray:
    """Waits of a single FIFO server with a fixed service time (the Lindley recursion): the reference
    the simulator's queues are checked against."""
    waits = np.zeros(len(arrivals))
    free = 0.0
    for i, a in enumerate(arrivals.tolist()):
        start = max(a, free)
        waits[i] = start - a
        free = start + service
    return waits
