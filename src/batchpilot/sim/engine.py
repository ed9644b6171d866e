"""The discrete-event loop: a virtual clock, N executor slots, and a pluggable target.

The engine decides nothing. It moves time forward and hands three kinds of events to a *target*
(the object that owns a scheduling core and knows what a "job" costs):

    target.on_arrival(index, now)        a workload row arrives (index into the workload arrays)
    target.schedule(now, free_slots)     -> (jobs to start now, wake_at or None)
    target.on_job_done(job, now)         a job's service time has elapsed; its slot is free again
    target.next_job_at(job)              (optional) when the slot running ``job`` takes its next one

Pipelining: a target with ``next_job_at`` (the encoder target asks the core's
``BatchScheduler.next_batch_at``) lets a busy slot take one more job once that time has passed, the
way the live slot collates its next batch while the current one runs. Such a job waits on its slot
and starts the instant the running job ends. ``schedule`` is offered those slots as free, after the
idle ones, and the loop wakes at the next such time while the target has work waiting.

A ``Job`` is opaque to the engine except for ``duration_s``. The encoder target's jobs are
``core.scheduler.Batch`` objects timed by ``CostModel.latency(batch.shape)``; an LLM target's jobs are
iterations (one ``StepShape`` each). Both run in this one loop, so there is one simulator.

Event sources and ordering. Arrivals come from a sorted array (no heap traffic for 1M rows), job
completions from a heap, and the policy wake-up is a single scalar: every ``schedule`` call sees the
whole state, so its latest ``wake_at`` supersedes earlier ones (the live driver sleeps the same way).
Ties at one instant break on kind, then sequence: completions, then arrivals (in row order), then the
wake-up; all events at one instant are applied before ``schedule`` is called once, so a completion and
an arrival at the same time are seen together, deterministically.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np


@dataclass(slots=True)
class Job:
    """One unit of executor work: ``duration_s`` of virtual time on one slot. ``payload`` is the target's."""

    duration_s: float
    payload: Any = None
    slot: int = -1
    start_s: float = 0.0


class SimTarget(Protocol):
    """What the engine drives. Implemented by ``EncoderTarget`` here and by the LLM target in sim/llm.py."""

    def on_arrival(self, index: int, now: float) -> None:
        """Row ``index`` of the workload arrives at ``now`` (build the request, submit it)."""

    def schedule(self, now: float, free_slots: int) -> tuple[Sequence[Job], float | None]:
        """Ask the core what to start now on at most ``free_slots`` slots, and when to ask again."""

    def on_job_done(self, job: Job, now: float) -> None:
        """``job`` finished at ``now``: record completions, feed the core's ``on_*_done`` hook."""


@dataclass(slots=True)
class EngineStats:
    """What the loop itself observed (the target records per-request metrics)."""

    end_s: float = 0.0
    num_events: int = 0
    num_schedule_calls: int = 0
    num_jobs: int = 0
    busy_s: list[float] = field(default_factory=list)  # per slot
    num_pipelined: int = 0  # jobs taken by a busy slot and started when its running job ended
    stalled: bool = False  # work left but nothing scheduled and no wake-up: a core bug or a full stop
    aborted: bool = False  # the target raised StopSimulation


class StopSimulation(Exception):
    """A target raises this to end the run early (e.g. the tuner: the SLA is already lost for certain)."""


class Engine:
    """Run ``target`` over ``arrivals`` (seconds; row ``i`` arrives at ``arrivals[i]``) with ``num_slots``
    executor slots. The target hears arrivals in time order (rows in order at equal times), each
    with its row index: after a front end with several tokenizer servers, rows can reach the batcher
    out of row order.

    ``progress`` is called every ``progress_every`` arrivals with the number processed so far (the CLI
    drives a rich progress bar with it). ``until_s`` stops the clock early (jobs in flight are left).
    """

    def __init__(
        self,
        target: SimTarget,
        num_slots: int = 1,
        progress: Callable[[int], None] | None = None,
        progress_every: int = 10_000,
    ) -> None:
        if num_slots < 1:
            raise ValueError(f"engine: num_slots must be >= 1, got {num_slots}")
        self.next_job_at: Callable[[Job], float] | None = getattr(target, "next_job_at", None)
        self.target = target
        self.num_slots = num_slots
        self.progress = progress
        self.progress_every = max(1, progress_every)

    def run(self, arrivals: np.ndarray | Sequence[float], until_s: float = math.inf) -> EngineStats:
        times = np.asarray(arrivals, dtype=float)
        rows = None
        if times.size and (np.diff(times) < 0).any():
            order = np.argsort(times, kind="stable")
            times, rows = times[order], order.tolist()
        stats = EngineStats(busy_s=[0.0] * self.num_slots)
        try:
            self._loop(times.tolist(), until_s, stats, rows)
        except StopSimulation:
            stats.aborted = True
        return stats

    def _loop(self, arr: list[float], until_s: float, stats: EngineStats, rows: list[int] | None) -> None:
        # arr holds python floats (faster to index than numpy scalars); counters are locals written
        # back in ``finally`` so an aborted run still reports them. What happens once per job (a start,
        # a completion) is ``_Slots``'; what happens once per event stays here, in locals.
        n = len(arr)
        target = self.target
        on_done, on_arrival, schedule = target.on_job_done, target.on_arrival, target.schedule
        num_slots = self.num_slots
        next_at = self.next_job_at
        slots = _Slots(num_slots, stats.busy_s, next_at)
        running, free, accept = slots.running, slots.free, slots.accept
        has_pending = getattr(type(target), "has_pending", None)
        inf = math.inf
        wake = inf
        i = wakes = calls = 0
        last = 0.0
        progress, every = self.progress, self.progress_every
        next_report = every
        try:
            while True:
                now = running[0][0] if running else inf
                if i < n and arr[i] < now:
                    now = arr[i]
                if wake < now:
                    now = wake
                if now == inf or now > until_s:
                    break
                last = now
                # every event at this instant: completions first, then arrivals (row order), then the wake-up
                if running and running[0][0] == now:
                    slots.finish(now, on_done)
                while i < n and arr[i] == now:
                    on_arrival(i if rows is None else rows[i], now)
                    i += 1
                if wake <= now:
                    wake = inf
                    wakes += 1
                if progress is not None and i >= next_report:
                    progress(i)
                    next_report = i + every
                # busy slots past their accept time (a slot with a job waiting behind it accepts at inf)
                amin = min(accept) if next_at is not None else inf
                ready = [k for k in range(num_slots) if accept[k] <= now] if amin <= now else []
                jobs, wake_at = schedule(now, len(free) + len(ready))
                calls += 1
                if jobs:
                    slots.start(jobs, ready, now)
                wake = inf if wake_at is None else wake_at
                if next_at is not None and (has_pending is None or target.has_pending):  # type: ignore[attr-defined]
                    soon = min(accept)
                    if soon <= now:
                        soon = min((t for t in accept if t > now), default=inf)
                    if soon < wake:
                        wake = soon
                if wake <= now:
                    # A wake-up at or before now would spin forever; nudge it to the next float instead.
                    wake = math.nextafter(now, inf)
        finally:
            stats.end_s = last
            stats.num_events = i + (slots.seq - len(running)) + wakes  # arrivals + completions + wake-ups
            stats.num_schedule_calls = calls
            stats.num_jobs = slots.seq + sum(1 for w in slots.waiting if w is not None)
            stats.num_pipelined = slots.queued_jobs
            stats.stalled = not running and wake == inf and bool(getattr(target, "has_pending", False))
            if progress is not None:
                progress(i)


class _Slots:
    """The executor slots of one run: the idle ones (``free``), the jobs running (a heap of (end time,
    sequence, job)), and per busy slot when it takes its next job (``accept``: pipelining) and the job
    collated behind its running one (``waiting``). The loop calls in here once per job, not per event."""

    __slots__ = ("free", "accept", "waiting", "running", "busy", "next_at", "seq", "queued_jobs")

    def __init__(self, num_slots: int, busy: list[float], next_at: Callable[[Job], float] | None) -> None:
        self.free: list[int] = list(range(num_slots - 1, -1, -1))  # pop() gives the lowest slot first
        self.accept = [math.inf] * num_slots
        self.waiting: list[Job | None] = [None] * num_slots
        self.running: list[tuple[float, int, Job]] = []
        self.busy = busy  # per slot: seconds of jobs finished on it
        self.next_at = next_at
        self.seq = 0  # jobs started, the heap's tie-break (start order)
        self.queued_jobs = 0  # jobs taken by a busy slot (started when its running job ended)

    def begin(self, job: Job, slot: int, now: float) -> None:
        job.slot = slot
        job.start_s = now
        self.seq += 1
        heapq.heappush(self.running, (now + job.duration_s, self.seq, job))
        self.accept[slot] = self.next_at(job) if self.next_at is not None else math.inf

    def finish(self, now: float, on_done: Callable[[Job, float], None]) -> None:
        """Every job ending at ``now``, in start order; a job collated behind one starts at once."""
        running, waiting = self.running, self.waiting
        while running and running[0][0] == now:
            job = heapq.heappop(running)[2]
            slot = job.slot
            self.busy[slot] += job.duration_s
            on_done(job, now)
            queued = waiting[slot]
            if queued is None:
                self.accept[slot] = math.inf
                self.free.append(slot)
            else:  # the slot's next job was collated meanwhile: it starts now
                waiting[slot] = None
                self.begin(queued, slot, now)

    def start(self, jobs: Sequence[Job], ready: list[int], now: float) -> None:
        """``schedule``'s jobs: on idle slots now (lowest first), then each behind a busy slot past its
        accept time (``ready``), to start when that slot's running job ends."""
        if len(jobs) > len(self.free) + len(ready):
            raise RuntimeError(f"target started {len(jobs)} jobs with "
                               f"{len(self.free) + len(ready)} free slots")
        for job in jobs:
            if self.free:
                self.begin(job, self.free.pop(), now)
            else:
                slot = ready.pop(0)
                job.slot = slot
                self.waiting[slot] = job
                self.accept[slot] = math.inf
                self.queued_jobs += 1
