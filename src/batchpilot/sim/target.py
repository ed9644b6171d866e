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

import heapq
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from batchpilot.core.admission import Rejection
from batchpilot.core.batch import Batch
from batchpilot.core.config import SchedulerConfig
from batchpilot.core.costmodel import CostModel
from batchpilot.core.request import Request
from batchpilot.core.scheduler import BatchScheduler
from batchpilot.sim.engine import Engine, EngineStats, Job, StopSimulation
from batchpilot.sim.service import RATE_WINDOW_S, BatchNoise, BusyWindow, FrontEnd, served_seconds
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
        batch_overhead_s: float = 0.0,
        batch_gap_s: float = 0.0,
        loaded: tuple[float, float, float] = (1.0, 0.0, 0.0),
        loaded_residuals: tuple[float, ...] = (),
        loaded_residual_ref_s: float = 0.0,
        loaded_idle_factors: tuple[float, ...] = (),
        loaded_token_factors: tuple[tuple[int, float], ...] = (),
        loaded_busy_factors: tuple[float, ...] = (),
        loaded_wander: float = 0.0,
        batch_gap_per_input_s: float = 0.0,
    ) -> None:
        """``batch_overhead_s``: seconds the live driver adds to every batch outside the model (thread
        hand-offs, the event loop; the profile's ``frontend.batch_overhead_s``); ``batch_gap_s``: in
        its place for a batch that starts as the one before it ends, the driver's turnaround under
        load, plus ``batch_gap_per_input_s`` per input of the batch that ended last (``frontend``'s;
        both 0: ``batch_overhead_s``). ``loaded``: (alpha,
        rate coefficient, const) of a batch's time under serving load, ``cost model * (alpha + coef *
        rate) + const`` with ``rate`` the arrivals of the last ``RATE_WINDOW_S`` per second (the
        profile's ``frontend.loaded_*``); ``loaded_residuals``: the served batches'
        spread around it, drawn from for every batch (seeded) in place of the profile's residuals, in
        the units of a batch of ``loaded_residual_ref_s`` seconds (``FrontEnd.residual_scale``);
        ``loaded_idle_factors``: the line's factor by the idle time before the batch (no batch running
        on any slot; ``sim.service.idle_factor``); ``loaded_token_factors``: its factor by the batch's
        computed tokens (the thread plan's steps; ``sim.service.step_factor``);
        ``loaded_busy_factors``: its factor by the share of the second before the batch starts in
        which a batch ran (``sim.service.BusyWindow``); ``loaded_wander``: the machine's speed
        wander between windows of simulated time (``sim.service``), drawn with the residuals.
        ``stop_after_misses = (sla_s, max_misses, warmup_s)``: stop the run (``StopSimulation``) once more
        than ``max_misses`` measured requests finished later than ``sla_s`` or failed — the tuner's
        early exit when a probe's P99 is already lost for certain."""
        self.scheduler = scheduler
        self.workload = workload
        self.service_model = service_model or scheduler.cost_model
        self.noise = noise
        self.request_sla_s = request_sla_s
        self.record = EncoderRecord(len(workload))
        self._lengths = workload.input_tokens.tolist()
        self._prio = workload.priority.tolist()
        self.noise = noise or bool(loaded_residuals)
        self._noise = BatchNoise(loaded_residuals or self.service_model.rel_residuals,
                                 loaded_residual_ref_s if loaded_residuals else 0.0,
                                 loaded_wander if loaded_residuals else 0.0, seed) if self.noise else None
        self._stop = stop_after_misses
        self._overhead, self._per_input = batch_overhead_s, batch_gap_per_input_s
        self._gap = batch_gap_s if batch_gap_s or batch_gap_per_input_s else batch_overhead_s
        self._answered = self._started = 0  # inputs of the batch that ended last / that started last
        self._loaded = loaded
        self._rate_coef = loaded[1]
        self._idle_factors = loaded_idle_factors
        self._token_factors = loaded_token_factors
        self._busy_factors = loaded_busy_factors
        self._busy = BusyWindow() if loaded_busy_factors else None
        self._ends: list[float] = []  # the batches in flight: when each ends (only with busy factors)
        self._slots = scheduler.config.num_slots
        self._in_flight = 0  # batches started (or collated behind a running one) and not done
        self._last_end = -math.inf  # when the last batch done so far ended
        self._recent: deque[float] = deque()  # arrivals in the last RATE_WINDOW_S (only with a rate coef)
        self.num_misses = 0

    @property
    def has_pending(self) -> bool:
        return self.scheduler.num_waiting > 0

    def on_arrival(self, index: int, now: float) -> None:
        if self._rate_coef:
            self._recent.append(now)
        req = Request(index, now, self._lengths[index], self._prio[index], None, self.request_sla_s)
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
        self._in_flight -= 1
        if self._ends:
            heapq.heappop(self._ends)
        self._last_end = max(self._last_end, now)
        self._answered = batch.shape.n
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
        rate = 0.0
        if self._rate_coef:
            recent, start = self._recent, now - RATE_WINDOW_S
            while recent and recent[0] < start:
                recent.popleft()
            rate = len(recent) / RATE_WINDOW_S
        # a batch started while another runs (or behind it) found no idle time
        idle_s = 0.0 if self._in_flight else now - self._last_end
        # answered on the event loop before this batch begins: the batch it starts behind, else the last
        answered, self._started = self._started if self._in_flight else self._answered, shape.n
        busy, start = 0.0, now
        if self._busy is not None:  # with every slot busy the batch starts when the first one ends
            start = max(now, self._ends[0]) if self._in_flight >= self._slots and self._ends else now
            busy = self._busy.share(start)
        self._in_flight += 1
        mean = served_seconds(self.service_model.batch_latency(shape.n, shape.tokens, shape.attn),
                              self._loaded, rate, idle_s, shape.tokens, self._idle_factors,
                              self._token_factors, busy, self._busy_factors)
        took = (self._noise.draw(mean, start) if self._noise is not None else mean) \
            + (self._gap + self._per_input * answered if idle_s == 0.0 else self._overhead)
        if self._busy is not None:
            self._busy.add(start, start + took)
            heapq.heappush(self._ends, start + took)
        return took

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


def draws_batch_times(noise: bool, frontend: FrontEnd | None, service_model: CostModel) -> bool:
    """Whether ``simulate_encoder`` draws batch times (so that runs of different seeds differ): the
    profile's loaded residuals, or ``noise`` with the service model's own residuals (the rule of
    ``EncoderTarget``)."""
    if frontend is not None and frontend.loaded_residuals:
        return True
    return bool(noise and service_model.rel_residuals)


def served_batch_terms(frontend: FrontEnd | None) -> dict[str, Any]:
    """``EncoderTarget``'s keyword arguments for what the profile's serving path says a served batch
    costs beyond the cost model (none without a front end)."""
    if frontend is None:
        return {}
    names = ("batch_overhead_s", "batch_gap_s", "batch_gap_per_input_s", "loaded_residuals",
             "loaded_residual_ref_s", "loaded_idle_factors", "loaded_token_factors", "loaded_busy_factors",
             "loaded_wander")
    return {"loaded": (frontend.loaded_alpha, frontend.loaded_rate_coef, frontend.loaded_const_s),
            **{name: getattr(frontend, name) for name in names}}


@dataclass
class SimRun:
    """Everything one run produced: the inputs, the engine's counters and the target's records."""

    workload: Workload
    config: SchedulerConfig
    cost_model: CostModel  # the scheduler's belief
    service_model: CostModel  # what batches really cost (the same object unless a study says otherwise)
    stats: EngineStats
    record: EncoderRecord
    batcher_arrival_s: np.ndarray | None = None  # after the front end's serial stage (None: = arrival)


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
    frontend: FrontEnd | None = None,
) -> SimRun:
    """Replay ``workload`` through a fresh ``BatchScheduler(config, cost_model)`` on ``config.num_slots``.

    With ``frontend`` (``sim.service``), requests reach the scheduler after its serial stage and
    finish after its delay; latencies stay measured from the workload's own arrival times."""
    config = config or SchedulerConfig()
    cost_model = cost_model or CostModel.default_cpu_minilm()
    target = EncoderTarget(BatchScheduler(config, cost_model), workload, service_model, noise, seed,
                           request_sla_s, stop_after_misses, **served_batch_terms(frontend))
    engine = Engine(target, config.num_slots, progress=progress)
    at_batcher = None
    if frontend is not None:
        at_batcher = frontend.batcher_arrivals(workload.arrival_s, workload.input_tokens)
    stats = engine.run(workload.arrival_s if at_batcher is None else at_batcher)
    if frontend is not None:
        rec = target.record
        delay = frontend.delay(workload.input_tokens, workload.arrival_s)
        rec.finish_s = (np.asarray(rec.finish_s) + delay).tolist()
    return SimRun(workload, config, cost_model, target.service_model, stats, target.record, at_batcher)
