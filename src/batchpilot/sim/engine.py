"""The discrete-event loop: a virtual clock, N executor slots, and a pluggable target.

The engine decides nothing. It moves time forward and hands three kinds of events to a *target*
(the object that owns a scheduling core and knows what a "job" costs):

    target.on_arrival(index, now)        a workload row arrives (index into the workload arrays)
    target.schedule(now, free_slots)     -> (jobs to start now, wake_at or None)
    target.on_job_done(job, now)         a job's service time has elapsed; its slot is free again

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
    stalled: bool = False  # work left but nothing scheduled and no wake-up: a core bug or a full stop
    aborted: bool = False  # the target raised StopSimulation


class StopSimulation(Exception):
    """A target raises this to end the run early (e.g. the tuner: the SLA is already lost for certain)."""


class Engine:
    """Run ``target`` over sorted ``arrivals`` (seconds) with ``num_slots`` executor slots.

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
        self.target = target
        self.num_slots = num_slots
        self.progress = progress
        self.progress_every = max(1, progress_every)

    def run(self, arrivals: np.ndarray | Sequence[float], until_s: float = math.inf) -> EngineStats:
        times = np.asarray(arrivals, dtype=float)
        if times.size and (np.diff(times) < 0).any():
            raise ValueError("engine: arrival times must be sorted ascending")
        stats = EngineStats(busy_s=[0.0] * self.num_slots)
        try:
            self._loop(times.tolist(), until_s, stats)
        except StopSimulation:
            stats.aborted = True
        return stats

    def _loop(self, arr: list[float], until_s: float, stats: EngineStats) -> None:
        # arr holds python floats (faster to index than numpy scalars); counters are locals written
        # back in ``finally`` so an aborted run still reports them.
        n = len(arr)
        target = self.target
        on_done, on_arrival, schedule = target.on_job_done, target.on_arrival, target.schedule
        busy = stats.busy_s
        free: list[int] = list(range(self.num_slots - 1, -1, -1))  # pop() gives the lowest slot first
        running: list[tuple[float, int, Job]] = []  # (end time, seq, job)
        push, pop = heapq.heappush, heapq.heappop
        inf = math.inf
        wake = inf
        i = seq = wakes = calls = 0
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
                while running and running[0][0] == now:
                    job = pop(running)[2]
                    free.append(job.slot)
                    busy[job.slot] += job.duration_s
                    on_done(job, now)
                while i < n and arr[i] == now:
                    on_arrival(i, now)
                    i += 1
                if wake <= now:
                    wake = inf
                    wakes += 1
                if progress is not None and i >= next_report:
                    progress(i)
                    next_report = i + every
                jobs, wake_at = schedule(now, len(free))
                calls += 1
                if jobs:
                    if len(jobs) > len(free):
                        raise RuntimeError(f"target started {len(jobs)} jobs with {len(free)} free slots")
                    for job in jobs:
                        job.slot = free.pop()
                        job.start_s = now
                        seq += 1
                        push(running, (now + job.duration_s, seq, job))
                if wake_at is None:
                    wake = inf
                else:
                    # A wake-up at or before now would spin forever; nudge it to the next float instead.
                    wake = wake_at if wake_at > now else math.nextafter(now, inf)
        finally:
            stats.end_s = last
            stats.num_events = i + (seq - len(running)) + wakes  # arrivals + completions + wake-ups
            stats.num_schedule_calls = calls
            stats.num_jobs = seq
            stats.stalled = not running and wake == inf and bool(getattr(target, "has_pending", False))
            if progress is not None:
                progress(i)
