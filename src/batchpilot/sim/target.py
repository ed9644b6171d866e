"""The encoder target: the real ``BatchScheduler`` in the event loop, the model replaced by a cost model.

It only moves data: a workload row becomes a ``Request`` and goes to ``submit``; ``schedule`` returns
batches, each becomes a ``Job`` lasting ``CostModel.latency(batch.shape)`` (or ``sample_latency`` with
a seeded residual when ``noise`` is on); when the job ends, ``on_batch_done`` gets the elapsed time.
Every decision is the scheduler's. It records (per request and per batch, flat lists that
``metrics.summarize`` turns into arrays) everything the report needs.

``service_model`` is the *true* cost of a batch (what the simulated hardware does); the scheduler's
``cost_model`` is what it believes: the same object unless a study wants to see what a wrong belief costs.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from batchpilot.core.admission import Rejection
from batchpilot.core.batch import Batch
from batchpilot.core.config import SchedulerConfig
from batchpilot.core.costmodel import CostModel
from batchpilot.core.request import Request
from batchpilot.core.scheduler import BatchScheduler
from batchpilot.core.tenants import TenantTable
from batchpilot.sim.engine import Engine, EngineStats, Job, StopSimulation
from batchpilot.sim.service import BatchCost, BatchNoise, ServiceModel
from batchpilot.sim.traces import Workload

DONE, PENDING, REJECTED, DROPPED = 1, 0, 2, 3


@dataclass
class EncoderRecord:
    """Flat per-request and per-batch records of one run (lists while running, arrays after)."""

    n: int
    dispatch_s: list[float] = field(default_factory=list)
    finish_s: list[float] = field(default_factory=list)
    status: list[int] = field(default_factory=list)
    reasons: dict[str, int] = field(default_factory=dict)
    # per batch
    b_start: list[float] = field(default_factory=list)
    b_duration: list[float] = field(default_factory=list)
    b_size: list[int] = field(default_factory=list)
    b_padded_len: list[int] = field(default_factory=list)
    b_tokens: list[int] = field(default_factory=list)
    b_useful: list[int] = field(default_factory=list)
    b_attn: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        nan = math.nan
        self.dispatch_s = [nan] * self.n
        self.finish_s = [nan] * self.n
        self.status = [PENDING] * self.n


class EncoderTarget:
    """``SimTarget`` for the encoder ``BatchScheduler``. Request ``id`` = workload row index."""

    def __init__(
        self,
        scheduler: BatchScheduler,
        workload: Workload,
        service_model: CostModel | None = None,
        noise: bool = False,
        seed: int = 0,
        request_sla_s: float | None = None,
        stop_after_misses: tuple[float, int, float] | None = None,
        service: ServiceModel | None = None,
    ) -> None:
        """``service``: what a served batch costs beyond its price and how it scatters (the profile's
        ``ServiceModel``: ``batch`` and ``noise``; its ``request`` part is added to each request by
        ``simulate_encoder``); None: every batch takes the cost model's time, drawn with its own
        residuals when ``noise``. ``stop_after_misses = (sla_s, max_misses, warmup_s)``: stop the run
        (``StopSimulation``) once more than ``max_misses`` measured requests finished later than
        ``sla_s`` or failed — the tuner's early exit when a probe's P99 is already lost for certain."""
        self.scheduler = scheduler
        self.workload = workload
        self.service_model = service_model or scheduler.cost_model
        self.request_sla_s = request_sla_s
        self.record = EncoderRecord(len(workload))
        self._lengths = workload.input_tokens.tolist()
        self._prio = workload.priority.tolist()
        self._tenants: list[str] | None = None if workload.tenant is None else workload.tenant.tolist()
        self._batch = service.batch if service is not None else BatchCost()
        self._noise = service.noise.sampler(seed) if service is not None else None
        if self._noise is None and noise and self.service_model.rel_residuals:  # the cost model's own spread
            self._noise = BatchNoise(self.service_model.rel_residuals, seed=seed)
        self.noise = self._noise is not None
        self._stop = stop_after_misses
        self.num_misses = 0

    @property
    def has_pending(self) -> bool:
        return self.scheduler.num_waiting > 0

    def on_arrival(self, index: int, now: float) -> None:
        req = Request(index, now, self._lengths[index], self._prio[index], None, self.request_sla_s)
        if self._tenants is not None:
            req.tenant = self._tenants[index]
        rejection = self.scheduler.submit(req, now)
        if rejection is not None:
            self._fail(rejection, REJECTED, now)

    def schedule(self, now: float, free_slots: int) -> tuple[list[Job], float | None]:
        if (free_slots == 0 and self.request_sla_s is None) or not self.scheduler.num_waiting:
            # Driver fast path, exact: with an empty queue there is nothing to dispatch or drop, and
            # with every slot busy and no request carrying a deadline the core has nothing to decide
            # (no policy call, nothing can expire). Skipping those calls saves a third of them.
            return [], None
        out = self.scheduler.schedule(now, free_slots)
        for rej in out.dropped:
            self._fail(rej, DROPPED, now)
        if not out.batches:
            return [], out.wake_at
        jobs = []
        rec = self.record
        dispatch = rec.dispatch_s
        for batch in out.batches:
            for r in batch.requests:
                dispatch[r.id] = now
            jobs.append(Job(self._duration(batch, now), batch))
        return jobs, out.wake_at

    def next_job_at(self, job: Job) -> float:
        """When the slot that started ``job`` takes its next batch: the core's ``next_batch_at``."""
        return self.scheduler.next_batch_at(job.payload, job.start_s)

    def on_job_done(self, job: Job, now: float) -> None:
        batch: Batch = job.payload
        rec = self.record
        finish, status = rec.finish_s, rec.status
        for r in batch.requests:
            finish[r.id] = now
            status[r.id] = DONE
        if self._stop is not None:
            sla, _, warmup = self._stop
            self._miss(sum(1 for r in batch.requests if now - r.arrival > sla and r.arrival >= warmup))
        shape = batch.shape
        rec.b_start.append(job.start_s)
        rec.b_duration.append(job.duration_s)
        rec.b_size.append(shape.n)
        rec.b_padded_len.append(batch.padded_len)
        rec.b_tokens.append(shape.tokens)
        rec.b_useful.append(shape.useful_tokens)
        rec.b_attn.append(shape.attn)
        self.scheduler.on_batch_done(batch, now, job.duration_s)

    def _duration(self, batch: Batch, now: float) -> float:
        shape = batch.shape
        line = self._batch.seconds(self.service_model.batch_latency(shape.n, shape.tokens, shape.attn),
                                   shape.tokens)
        took = self._noise.draw(line) if self._noise is not None else line
        return took + self._batch.overhead_s

    def _fail(self, rej: Rejection, kind: int, now: float) -> None:
        rec = self.record
        rec.status[rej.request.id] = kind
        rec.finish_s[rej.request.id] = now
        key = rej.reason.value
        rec.reasons[key] = rec.reasons.get(key, 0) + 1
        if self._stop is not None and rej.request.arrival >= self._stop[2]:
            self._miss(1)

    def _miss(self, k: int) -> None:
        self.num_misses += k
        if self._stop is not None and self.num_misses > self._stop[1]:
            raise StopSimulation(f"{self.num_misses} requests missed the SLA")


def draws_batch_times(noise: bool, service: ServiceModel | None, service_model: CostModel) -> bool:
    """Whether ``simulate_encoder`` draws batch times (so that runs of different seeds differ): the
    service model's noise, else ``noise`` with the cost model's own residuals (the rule of
    ``EncoderTarget``)."""
    if service is not None and service.draws_batch_times:
        return True
    return bool(noise and service_model.rel_residuals)


@dataclass
class SimRun:
    """Everything one run produced: the inputs, the engine's counters and the target's records."""

    workload: Workload
    config: SchedulerConfig
    cost_model: CostModel  # the scheduler's belief
    service_model: CostModel  # what batches really cost (the same object unless a study says otherwise)
    stats: EngineStats
    record: EncoderRecord


def simulate_encoder(
    workload: Workload,
    config: SchedulerConfig | None = None,
    cost_model: CostModel | None = None,
    *,
    service_model: CostModel | None = None,
    noise: bool = False,
    seed: int = 0,
    request_sla_s: float | None = None,
    progress: Callable[[int], None] | None = None,
    stop_after_misses: tuple[float, int, float] | None = None,
    service: ServiceModel | None = None,
    tenants: TenantTable | None = None,
) -> SimRun:
    """Replay ``workload`` through a fresh ``BatchScheduler(config, cost_model, tenants)`` on
    ``config.num_slots``; each row is its ``workload.tenant``'s (``tenants``: their weights and quotas).

    With ``service`` (``sim.service.ServiceModel``), batches take its batch part's time with its noise
    and requests finish after its request part's delay; latencies are measured from the workload's
    arrival times."""
    config = config or SchedulerConfig()
    cost_model = cost_model or CostModel.default_cpu_minilm()
    target = EncoderTarget(BatchScheduler(config, cost_model, tenants), workload, service_model, noise, seed,
                           request_sla_s, stop_after_misses, service)
    engine = Engine(target, config.num_slots, progress=progress)
    stats = engine.run(workload.arrival_s)
    if service is not None:
        rec = target.record
        rec.finish_s = (np.asarray(rec.finish_s) + service.request.delay(workload.input_tokens)).tolist()
    return SimRun(workload, config, cost_model, target.service_model, stats, target.record)
