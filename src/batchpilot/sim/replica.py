"""One replica of a fleet: an ``EncoderTarget`` (its own ``BatchScheduler``) on its own executor slots.

A fleet runs in one ``Engine`` whose slots are every replica's slots together; the engine starts each
job the instant the fleet returns it. What makes the slots a replica's own is here: a replica keeps
its ``num_slots`` slots, and replays, for them alone, exactly what the engine does for a single target
(sim/engine.py):

* it is stepped only at its own instants — a completion of one of its batches, a request reaching its
  batcher, the wake-up it asked for — so its core sees the calls a server of its own would make;
* at one instant: completions first (a batch collated behind a finishing one starts at once, its next
  accept time taken right after that completion is reported, as the engine does), then the requests
  reaching the batcher in row order, then one ``schedule`` call with the idle slots and the busy slots
  past their accept time (``next_batch_at``: pipelining);
* jobs for idle slots start now (returned to the engine), lowest idle slot first, as the engine's free
  list gives them; jobs for busy slots wait behind the running batch of that slot;
* its next instant is its own ``wake_at`` or, while work waits, the next accept time of a busy slot.

The serving path's serial stage (the tokenizer threads of ``sim/frontend.py``) is per replica as well:
a request routed at ``a`` reaches this replica's batcher at ``max(a, f) + c``, ``f`` the time the
earliest of *its* servers is free. ``tests/test_sim_fleet.py`` checks that a fleet of one replica gives
the plain simulation's results request by request.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

from batchpilot.sim.engine import Job
from batchpilot.sim.target import EncoderTarget

_INF = math.inf


class Replica:
    """The slots, pipelining and serial stage of one replica around its ``EncoderTarget``."""

    def __init__(self, target: EncoderTarget, num_slots: int, serial_s: Sequence[float] | None = None,
                 serial_servers: int = 1) -> None:
        """``serial_s``: per workload row, the serial stage's service time (None: no serial stage)."""
        self.target = target
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # pop() gives the lowest slot first
        self._accept = [_INF] * num_slots
        self._waiting: list[Job | None] = [None] * num_slots
        self._slot_of: dict[int, int] = {}  # id(job) -> slot, for jobs running here
        self._starting: list[Job] = []  # collated jobs whose slot came free at this instant
        self._arriving: list[tuple[float, int]] = []  # heap of (batcher arrival, row) not yet submitted
        self._serial = serial_s
        self._servers = [-_INF] * serial_servers
        self.batcher_arrival: dict[int, float] = {}  # row -> when it reached this replica's batcher
        self._due = _INF
        self._dirty = False
        self.num_routed = 0
        self.num_pipelined = 0

    @property
    def outstanding(self) -> int:
        """Requests routed here and not yet answered: on their way to the batcher plus the core's count
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
        """Row ``index`` is routed here at ``now``; it reaches the batcher after the serial stage."""
        self.num_routed += 1
        at = now
        if self._serial is not None:
            free = self._servers[0]
            at = (now if now > free else free) + self._serial[index]
            heapq.heapreplace(self._servers, at)
        self.batcher_arrival[index] = at
        heapq.heappush(self._arriving, (at, index))

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
