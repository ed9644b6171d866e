"""A fleet: N replicas of one deployment behind a router model, in one event loop.

    run = simulate_fleet(workload, config, cost_model, replicas=3, router="least_loaded")
    report = summarize(run.run)                     # the fleet, as one SimRun
    run.per_replica                                 # requests, P99 and utilisation of each replica

Every replica is the single-replica simulation's own code: an ``EncoderTarget`` around its own
``BatchScheduler`` built from the same resolved ``SchedulerConfig`` and cost model, on its own
``num_slots`` slots (``sim/fleet.py``), with the service model's batch costs when one is given. A
request is routed when it arrives (``sim/router.py``) on what the router can count: each replica's
outstanding requests. Nothing is decided here that a replica's core or the router does not
decide. With ``replicas=1`` the run is the plain simulation's, request by request.

The fleet's ``SimRun`` has every row's record from the replica that served it, every replica's
batches, and ``config.num_slots`` = replicas x slots, so ``summarize`` counts the fleet's utilisation
over all its executors. Noise draws are seeded per replica (``seed + k``), the router's draws by
``seed``.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from batchpilot.core.autoscale import AutoscaleConfig, Autoscaler, signal_of
from batchpilot.core.config import SchedulerConfig
from batchpilot.core.costmodel import CostModel
from batchpilot.core.scheduler import BatchScheduler
from batchpilot.sim.engine import Engine, EngineStats, Job, StopSimulation
from batchpilot.sim.router import Router, make_router
from batchpilot.sim.service import ServiceModel
from batchpilot.sim.target import DONE, PENDING, EncoderRecord, EncoderTarget, SimRun
from batchpilot.sim.traces import Workload

# One replica of a fleet: an ``EncoderTarget`` (its own ``BatchScheduler``) on its own executor slots.
#
# A fleet runs in one ``Engine`` whose slots are every replica's slots together; the engine starts each
# job the instant the fleet returns it. What makes the slots a replica's own is here: a replica keeps
# its ``num_slots`` slots, and replays, for them alone, exactly what the engine does for a single target
# (sim/engine.py):
#
# * it is stepped only at its own instants — a completion of one of its batches, a request reaching its
#   batcher, the wake-up it asked for — so its core sees the calls a server of its own would make;
# * at one instant: completions first (a batch collated behind a finishing one starts at once, its next
#   accept time taken right after that completion is reported, as the engine does), then the requests
#   reaching the batcher in row order, then one ``schedule`` call with the idle slots and the busy slots
#   past their accept time (``next_batch_at``: pipelining);
# * jobs for idle slots start now (returned to the engine), lowest idle slot first, as the engine's free
#   list gives them; jobs for busy slots wait behind the running batch of that slot;
# * its next instant is its own ``wake_at`` or, while work waits, the next accept time of a busy slot.
#
# ``tests/test_sim_fleet.py`` checks that a fleet of one replica gives the plain simulation's results
# request by request.

_INF = math.inf


class Replica:
    """The slots and pipelining of one replica around its ``EncoderTarget``."""

    def __init__(self, target: EncoderTarget, num_slots: int) -> None:
        self.target = target
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # pop() gives the lowest slot first
        self._accept = [_INF] * num_slots
        self._waiting: list[Job | None] = [None] * num_slots
        self._slot_of: dict[int, int] = {}  # id(job) -> slot, for jobs running here
        self._starting: list[Job] = []  # collated jobs whose slot came free at this instant
        self._arriving: list[tuple[float, int]] = []  # heap of (arrival, row) not yet submitted
        self._due = _INF
        self._dirty = False
        self.num_routed = 0
        self.num_pipelined = 0

    @property
    def outstanding(self) -> int:
        """Requests routed here and not yet answered: routed and not yet submitted plus the core's count
        of requests in progress (finished, refused and dropped ones have left it)."""
        return len(self._arriving) + self.target.scheduler.num_requests

    @property
    def has_pending(self) -> bool:
        return bool(self._arriving) or self.target.has_pending

    @property
    def next_event(self) -> float:
        """This replica's next instant of its own (inf: none until a completion or a routed request)."""
        return min(self._due, self._arriving[0][0]) if self._arriving else self._due

    def route(self, index: int, now: float) -> None:
        """Row ``index`` is routed here at ``now``; the replica's next step submits it."""
        self.num_routed += 1
        heapq.heappush(self._arriving, (now, index))

    def on_job_done(self, job: Job, now: float) -> None:
        slot = self._slot_of.pop(id(job))
        self.target.on_job_done(job, now)
        self._dirty = True
        queued = self._waiting[slot]
        if queued is None:
            self._accept[slot] = _INF
            self._free.append(slot)
            return
        self._waiting[slot] = None  # the slot's next batch was collated meanwhile: it starts now
        queued.start_s = now
        self._slot_of[id(queued)] = slot
        self._accept[slot] = self.target.next_job_at(queued)
        self._starting.append(queued)

    def due(self, now: float) -> bool:
        """Whether ``now`` is one of this replica's instants."""
        return self._dirty or self._due <= now or bool(self._arriving and self._arriving[0][0] <= now)

    def step(self, now: float) -> list[Job]:
        """This replica's part of the instant ``now``; the jobs to start on the engine now."""
        target = self.target
        out, self._starting = self._starting, []
        self._dirty = False
        arriving = self._arriving
        while arriving and arriving[0][0] <= now:
            target.on_arrival(heapq.heappop(arriving)[1], now)
        accept, free = self._accept, self._free
        ready = [k for k in range(self.num_slots) if accept[k] <= now] if min(accept) <= now else []
        jobs, wake_at = target.schedule(now, len(free) + len(ready))
        if len(jobs) > len(free) + len(ready):
            raise RuntimeError(f"target started {len(jobs)} jobs with {len(free) + len(ready)} free slots")
        for job in jobs:
            if free:
                slot = free.pop()
                job.start_s = now
                self._slot_of[id(job)] = slot
                accept[slot] = target.next_job_at(job)
                out.append(job)
            else:  # a busy slot past its accept time: the job waits for the running one
                slot = ready.pop(0)
                self._waiting[slot] = job
                accept[slot] = _INF
                self.num_pipelined += 1
        due = _INF if wake_at is None else wake_at
        if target.has_pending:
            soon = min(accept)
            if soon <= now:
                soon = min((t for t in accept if t > now), default=_INF)
            if soon < due:
                due = soon
        self._due = math.nextafter(now, _INF) if due <= now else due
        return out


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
    service: ServiceModel | None = None,
    autoscale: FleetScaling | None = None,
) -> FleetRun:
    """Replay ``workload`` through ``replicas`` copies of ``BatchScheduler(config, cost_model)`` behind
    ``router``, with the arguments of ``sim.target.simulate_encoder`` meaning what they mean there
    (``stop_after_misses`` counts the fleet's misses together). With ``autoscale``
    (``sim/fleet.py``) the fleet has ``max_replicas`` replicas, ``min_replicas`` of them running
    at first, and ``replicas`` is not read."""
    if autoscale is not None:
        replicas = autoscale.config.max_replicas
    if replicas < 1:
        raise ValueError(f"fleet: replicas must be >= 1, got {replicas}")
    config = config or SchedulerConfig()
    cost_model = cost_model or CostModel.default_cpu_minilm()
    # each replica counts its own misses and never stops the run itself: the fleet stops on the total
    count_only = None if stop_after_misses is None else (stop_after_misses[0], len(workload),
                                                         stop_after_misses[2])
    reps = []
    for k in range(replicas):
        target = EncoderTarget(
            BatchScheduler(config, cost_model), workload, service_model, noise, seed + k, request_sla_s,
            count_only, service)
        reps.append(Replica(target, config.num_slots))
    scaler = Scaler(autoscale, reps) if autoscale is not None else None
    fleet = FleetTarget(reps, make_router(router, seed), stop_after_misses, scaler)
    stats = Engine(fleet, replicas * config.num_slots, progress=progress).run(workload.arrival_s)
    stats.num_pipelined = sum(r.num_pipelined for r in reps)
    routed = np.asarray(fleet.routed, dtype=np.int64)
    record = _merge(workload, reps, routed)
    if service is not None:
        delay = service.request.delay(workload.input_tokens)
        record.finish_s = (np.asarray(record.finish_s) + delay).tolist()
    fleet_config = dataclasses.replace(config, num_slots=replicas * config.num_slots)
    run = SimRun(workload, fleet_config, cost_model, reps[0].target.service_model, stats, record)
    return FleetRun(run, replicas, router, config, _summaries(run, reps, routed, stats), routed,
                    [r.target.record for r in reps])


def _merge(workload: Workload, reps: list[Replica], routed: np.ndarray) -> EncoderRecord:
    """Every row's record from the replica it was routed to; every replica's batches, in turn."""
    n = len(workload)
    dispatch = np.full(n, math.nan)
    finish = np.full(n, math.nan)
    status = np.full(n, PENDING, dtype=np.int64)
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
    record.dispatch_s, record.finish_s, record.status = dispatch.tolist(), finish.tolist(), status.tolist()
    return record


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


# Rich tables for fleet runs: each replica's share of a ``simulate --replicas`` run.

def replicas_table(fleet: FleetRun) -> Any:
    from rich.table import Table

    t = Table(title=f"{fleet.replicas} replicas behind {fleet.router}: each replica's share",
              header_style="bold")
    for col in ("replica", "requests", "completed", "refused/dropped", "latency p99", "batches", "mean batch",
                "utilisation"):
        t.add_column(col, justify="right")
    for r in fleet.per_replica:
        t.add_row(str(r.index), f"{r.requests:,}", f"{r.completed:,}", f"{r.failed:,}",
                  "-" if math.isnan(r.p99_s) else f"{r.p99_s * 1e3:,.1f} ms", f"{r.batches:,}",
                  "-" if math.isnan(r.mean_batch_size) else f"{r.mean_batch_size:.2f}",
                  f"{r.utilisation:.1%}")
    return t


def scaling_table(scaling: FleetScaling, end_s: float, limit: int = 24) -> Any:
    """When the replica count changed, and what the fleet used in replica-seconds."""
    from rich.table import Table

    cfg = scaling.config
    mean = scaling.replica_seconds / end_s if end_s > 0 else float("nan")
    t = Table(title=f"autoscaling {cfg.min_replicas}..{cfg.max_replicas}: {scaling.replica_seconds:,.0f} "
                    f"replica-seconds, {mean:.2f} replicas on average", header_style="bold",
              caption=f"target wait {cfg.target_queue_wait_s:g} s, utilisation {cfg.target_utilisation:.0%}, "
                      f"delays up {cfg.upscale_delay_s:g} s / down {cfg.downscale_delay_s:g} s, replica "
                      f"start {scaling.start_delay_s:g} s, a decision every {scaling.interval_s:g} s")
    for col in ("time", "replicas set", "taking traffic"):
        t.add_column(col, justify="right")
    rows = scaling.timeline
    shown = rows if len(rows) <= limit else rows[: limit - 1] + rows[-1:]
    for i, (when, target, routed) in enumerate(shown):
        if len(rows) > limit and i == limit - 1:
            t.add_row("...", f"({len(rows) - limit + 1} more changes)", "")
        t.add_row(f"{when:,.1f} s", str(target), str(routed))
    return t


# Autoscaling a simulated fleet: ``core.autoscale.Autoscaler`` deciding, replicas that take time to start.
#
#     run = simulate_fleet(workload, config, cost_model, router="power_of_two",
#                          autoscale=FleetScaling(AutoscaleConfig(min_replicas=1, max_replicas=6)))
#
# Every ``interval_s`` of simulated time (while requests are still to come or in progress) the replicas
# taking traffic report ``core.autoscale.signal_of(scheduler, now)`` — the signal the live policy
# builds — and ``Autoscaler.decide(now, current, signals)`` answers with the replica count, ``current``
# being the count the fleet is set to (running plus starting). A new replica takes ``start_delay_s``
# before it is routed to (loading the model, warming up); a replica being removed stops receiving
# requests at once, finishes what it has (draining) and is then off. A replica still starting is the
# first removed; one draining is the first brought back. The replicas are allocated up front
# (``max_replicas`` of them, each with its own scheduler); one that is off keeps its state, as a fresh
# start would not (its ``work_scale`` and policy averages stay), which matters little for an idle core.
#
# What it does not model: the start delay's spread, a replica that fails to start, the controller's
# metrics delay beyond ``interval_s`` (Ray Serve averages metrics over a look-back period), and the cost
# of a start on the replicas already running.

OFF, STARTING, ACTIVE, DRAINING = 0, 1, 2, 3


@dataclass
class FleetScaling:
    """The autoscaler's settings in a simulated fleet, and after the run what it did."""

    config: AutoscaleConfig
    start_delay_s: float = 30.0
    interval_s: float = 1.0
    # filled by the run: (time, replicas set, replicas routed to) at every change, and replica-seconds
    timeline: list[tuple[float, int, int]] = field(default_factory=list)
    replica_seconds: float = 0.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.start_delay_s) and self.start_delay_s >= 0):
            raise ValueError(f"autoscale: start_delay_s must be a finite number >= 0, "
                             f"got {self.start_delay_s}")
        if not (math.isfinite(self.interval_s) and self.interval_s > 0):
            raise ValueError(f"autoscale: interval_s must be a finite number > 0, got {self.interval_s}")


class Scaler:
    """The fleet's replica states, driven by the autoscaler at every tick."""

    def __init__(self, scaling: FleetScaling, replicas: list[Replica]) -> None:
        self.scaling = scaling
        self.autoscaler = Autoscaler(scaling.config)
        self.replicas = replicas
        lo = scaling.config.min_replicas
        self.state = [ACTIVE if k < lo else OFF for k in range(len(replicas))]
        self.ready_at = [math.inf] * len(replicas)
        self.routable = list(range(lo))
        self._next_tick = 0.0
        self._last = 0.0
        scaling.timeline = [(0.0, lo, lo)]
        scaling.replica_seconds = 0.0

    @property
    def target(self) -> int:
        return sum(1 for s in self.state if s in (STARTING, ACTIVE))

    def next_event(self, busy: bool) -> float:
        """The next tick (only while ``busy``: requests to come or in progress) or start completing."""
        t = min(self.ready_at)
        return min(t, self._next_tick) if busy else t

    def due(self, now: float) -> bool:
        return now >= self._next_tick or now >= min(self.ready_at)

    def update(self, now: float, busy: bool) -> None:
        """Starts that completed, then (at a tick) the autoscaler's decision and what it changes."""
        s = self.scaling
        provisioned = sum(1 for x in self.state if x != OFF)
        s.replica_seconds += provisioned * (now - self._last)
        self._last = now
        changed = False
        for k, t in enumerate(self.ready_at):
            if t <= now:
                self.state[k], self.ready_at[k] = ACTIVE, math.inf
                changed = True
        for k, st in enumerate(self.state):
            if st == DRAINING and self.replicas[k].outstanding == 0:
                self.state[k] = OFF
        if now >= self._next_tick:
            self._next_tick = now + s.interval_s if busy else math.inf
            signals = [signal_of(self.replicas[k].target.scheduler, now) for k in self.routable]
            current = self.target
            desired = self.autoscaler.decide(now, current, signals)
            changed |= self._apply(desired - current, now)
        if changed:
            self.routable = [k for k, st in enumerate(self.state) if st == ACTIVE]
            s.timeline.append((now, self.target, len(self.routable)))

    def _apply(self, delta: int, now: float) -> bool:
        state = self.state
        for _ in range(max(delta, 0)):
            back = [k for k, st in enumerate(state) if st == DRAINING]
            if back:
                state[back[0]] = ACTIVE
                continue
            k = state.index(OFF)
            state[k], self.ready_at[k] = STARTING, now + self.scaling.start_delay_s
            if self.scaling.start_delay_s == 0:
                state[k], self.ready_at[k] = ACTIVE, math.inf
        for _ in range(max(-delta, 0)):
            starting = [k for k, st in enumerate(state) if st == STARTING]
            if starting:
                k = starting[-1]
                state[k], self.ready_at[k] = OFF, math.inf
                continue
            k = max(k for k, st in enumerate(state) if st == ACTIVE)
            state[k] = DRAINING if self.replicas[k].outstanding else OFF
        return delta != 0
