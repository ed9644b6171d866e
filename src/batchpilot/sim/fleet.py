"""A fleet: N replicas of one deployment behind a router model, in one event loop.

    run = simulate_fleet(workload, config, cost_model, replicas=3, router="least_loaded")
    report = summarize(run.run)                     # the fleet, as one SimRun
    run.per_replica                                 # requests, P99 and utilisation of each replica

Every replica is the single-replica simulation's own code: an ``EncoderTarget`` around its own
``BatchScheduler`` built from the same resolved ``SchedulerConfig`` and cost model, on its own
``num_slots`` slots (``sim/replica.py``), with its own serving-path serial stage when a ``FrontEnd`` is
given. A request is routed when it arrives (``sim/router.py``) on what the router can count: each
replica's outstanding requests. Nothing is decided here that a replica's core or the router does not
decide. With ``replicas=1`` the run is the plain simulation's, request by request.

The fleet's ``SimRun`` has every row's record from the replica that served it, every replica's
batches, and ``config.num_slots`` = replicas x slots, so ``summarize`` counts the fleet's utilisation
over all its executors. Noise draws are seeded per replica (``seed + k``), the router's draws by
``seed``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from batchpilot.core.config import SchedulerConfig
from batchpilot.core.costmodel import CostModel
from batchpilot.core.scheduler import BatchScheduler
from batchpilot.sim.engine import Engine, EngineStats, Job, StopSimulation
from batchpilot.sim.fleet_scaling import FleetScaling, Scaler
from batchpilot.sim.frontend import FrontEnd
from batchpilot.sim.replica import Replica
from batchpilot.sim.router import Router, make_router
from batchpilot.sim.target import DONE, PENDING, EncoderRecord, EncoderTarget, SimRun, served_batch_terms
from batchpilot.sim.traces import Workload


class FleetTarget:
    """``SimTarget`` for the engine: routes arrivals, steps each replica at its own instants."""

    def __init__(self, replicas: list[Replica], router: Router,
                 stop_after_misses: tuple[float, int, float] | None = None,
                 scaler: Scaler | None = None) -> None:
        self.replicas = replicas
        self.router = router
        self.routed = [-1] * len(replicas[0].target.workload)  # per row, the replica it went to
        self._stop = stop_after_misses
        self.scaler = scaler
        self._left = len(self.routed)  # rows still to arrive

    @property
    def has_pending(self) -> bool:
        return any(r.has_pending for r in self.replicas)

    def on_arrival(self, index: int, now: float) -> None:
        reps = self.replicas
        self._left -= 1
        if self.scaler is not None:
            up = self.scaler.routable
            k = up[self.router.choose([reps[j].outstanding for j in up]) if len(up) > 1 else 0]
        else:
            k = self.router.choose([r.outstanding for r in reps]) if len(reps) > 1 else 0
        self.routed[index] = k
        reps[k].route(index, now)

    def on_job_done(self, job: Job, now: float) -> None:
        # request ids are workload rows: a batch belongs to the replica its first request was routed to
        self.replicas[self.routed[job.payload.requests[0].id]].on_job_done(job, now)

    def schedule(self, now: float, free_slots: int) -> tuple[list[Job], float | None]:
        jobs: list[Job] = []
        wake = math.inf
        for r in self.replicas:
            if r.due(now):
                jobs.extend(r.step(now))
            t = r.next_event
            if t < wake:
                wake = t
        scaler = self.scaler
        if scaler is not None:
            busy = self._left > 0 or any(r.outstanding for r in self.replicas)
            if scaler.due(now):
                scaler.update(now, busy)
            wake = min(wake, scaler.next_event(busy))
        if self._stop is not None and sum(r.target.num_misses for r in self.replicas) > self._stop[1]:
            raise StopSimulation("the fleet's requests missed the SLA")
        return jobs, (None if wake == math.inf else wake)


@dataclass
class ReplicaSummary:
    """One replica's share of a fleet run."""

    index: int
    requests: int
    completed: int
    failed: int
    p99_s: float  # over its completed requests
    batches: int
    mean_batch_size: float
    utilisation: float  # busy slot-seconds / (its slots x the run's span)


@dataclass
class FleetRun:
    run: SimRun  # the fleet as one run (records of every row, every batch)
    replicas: int
    router: str
    config: SchedulerConfig  # one replica's
    per_replica: list[ReplicaSummary]
    routed: np.ndarray  # per row, the replica it went to (-1: never arrived)
    records: list[EncoderRecord]  # each replica's own record (rows it never saw stay pending there)


def simulate_fleet(
    workload: Workload,
    config: SchedulerConfig | None = None,
    cost_model: CostModel | None = None,
    *,
    replicas: int = 1,
    router: str = "round_robin",
    service_model: CostModel | None = None,
    noise: bool = False,
    seed: int = 0,
    request_sla_s: float | None = None,
    progress: Callable[[int], None] | None = None,
    stop_after_misses: tuple[float, int, float] | None = None,
    frontend: FrontEnd | None = None,
    autoscale: FleetScaling | None = None,
) -> FleetRun:
    """Replay ``workload`` through ``replicas`` copies of ``BatchScheduler(config, cost_model)`` behind
    ``router``, with the arguments of ``sim.target.simulate_encoder`` meaning what they mean there
    (``stop_after_misses`` counts the fleet's misses together). With ``autoscale``
    (``sim/fleet_scaling.py``) the fleet has ``max_replicas`` replicas, ``min_replicas`` of them running
    at first, and ``replicas`` is not read."""
    if autoscale is not None:
        replicas = autoscale.config.max_replicas
    if replicas < 1:
        raise ValueError(f"fleet: replicas must be >= 1, got {replicas}")
    config = config or SchedulerConfig()
    cost_model = cost_model or CostModel.default_cpu_minilm()
    fe = frontend
    serial = None
    if fe is not None:
        serial = (fe.serial_busy_factor * (fe.serial_const_s + fe.serial_per_token_s
                                          * np.asarray(workload.input_tokens, dtype=float))).tolist()
    # each replica counts its own misses and never stops the run itself: the fleet stops on the total
    count_only = None if stop_after_misses is None else (stop_after_misses[0], len(workload),
                                                         stop_after_misses[2])
    reps = []
    for k in range(replicas):
        target = EncoderTarget(
            BatchScheduler(config, cost_model), workload, service_model, noise, seed + k, request_sla_s,
            count_only, **served_batch_terms(fe))
        reps.append(Replica(target, config.num_slots, serial, fe.serial_servers if fe is not None else 1))
    scaler = Scaler(autoscale, reps) if autoscale is not None else None
    fleet = FleetTarget(reps, make_router(router, seed), stop_after_misses, scaler)
    stats = Engine(fleet, replicas * config.num_slots, progress=progress).run(workload.arrival_s)
    stats.num_pipelined = sum(r.num_pipelined for r in reps)
    routed = np.asarray(fleet.routed, dtype=np.int64)
    record, at_batcher = _merge(workload, reps, routed, fe is not None)
    if fe is not None:
        delay = fe.delay(workload.input_tokens)
        for k in range(replicas):  # each replica's own traffic loads its own serving path
            mine = routed == k
            delay[mine] = fe.delay(workload.input_tokens[mine], workload.arrival_s[mine])
        record.finish_s = (np.asarray(record.finish_s) + delay).tolist()
    fleet_config = dataclasses.replace(config, num_slots=replicas * config.num_slots)
    run = SimRun(workload, fleet_config, cost_model, reps[0].target.service_model, stats, record, at_batcher)
    return FleetRun(run, replicas, router, config, _summaries(run, reps, routed, stats), routed,
                    [r.target.record for r in reps])


def _merge(workload: Workload, reps: list[Replica], routed: np.ndarray,
           with_frontend: bool) -> tuple[EncoderRecord, np.ndarray | None]:
    """Every row's record from the replica it was routed to; every replica's batches, in turn."""
    n = len(workload)
    dispatch = np.full(n, math.nan)
    finish = np.full(n, math.nan)
    status = np.full(n, PENDING, dtype=np.int64)
    at_batcher = workload.arrival_s.astype(float).copy() if with_frontend else None
    record = EncoderRecord(n)
    for k, r in enumerate(reps):
        rows = np.flatnonzero(routed == k)
        rec = r.target.record
        dispatch[rows] = np.asarray(rec.dispatch_s)[rows]
        finish[rows] = np.asarray(rec.finish_s)[rows]
        status[rows] = np.asarray(rec.status)[rows]
        for key, v in rec.reasons.items():
            record.reasons[key] = record.reasons.get(key, 0) + v
        for name in ("b_start", "b_duration", "b_size", "b_padded_len", "b_tokens", "b_useful", "b_attn"):
            getattr(record, name).extend(getattr(rec, name))
        if at_batcher is not None:
            for row, t in r.batcher_arrival.items():
                at_batcher[row] = t
    record.dispatch_s, record.finish_s, record.status = dispatch.tolist(), finish.tolist(), status.tolist()
    return record, at_batcher


def _summaries(run: SimRun, reps: list[Replica], routed: np.ndarray,
               stats: EngineStats) -> list[ReplicaSummary]:
    arrival = run.workload.arrival_s
    status = np.asarray(run.record.status)
    finish = np.asarray(run.record.finish_s)
    span = max(stats.end_s - (float(arrival[0]) if len(arrival) else 0.0), 1e-12)
    out = []
    for k, r in enumerate(reps):
        mine = routed == k
        done = mine & (status == DONE)
        lat = finish[done] - arrival[done]
        rec = r.target.record
        sizes = np.asarray(rec.b_size, dtype=float)
        out.append(ReplicaSummary(
            k, int(mine.sum()), int(done.sum()), int((mine & (status != DONE) & (status != PENDING)).sum()),
            float(np.percentile(lat, 99.0)) if lat.size else math.nan, int(sizes.size),
            float(sizes.mean()) if sizes.size else math.nan,
            float(sum(rec.b_duration)) / (r.num_slots * span)))
    return out
