"""The autoscaling decision: how many replicas a fleet of encoder servers should run, from their backlogs.

    autoscaler = Autoscaler(AutoscaleConfig(min_replicas=1, max_replicas=8))
    desired = autoscaler.decide(now, current, [signal_of(scheduler, now) for scheduler in replicas])

The live autoscaling policy (Ray Serve) and the simulator's fleet call exactly this, with the signal
built the same way (``signal_of``). Nothing here reads a clock: ``now`` is an argument and must not go
backwards between calls; the state is a moving average of busy executors and when the present wish to
scale started.

**The rule.** Each replica reports ``predicted_wait_s``, ``BatchScheduler.predicted_backlog_s(now)``
(the predicted seconds, per executor slot, until everything it has dispatched and queued has run), and
how many of its ``slots`` are ``running`` a batch. Two counts follow, and the fleet wants the larger::

    for the wait:  ceil(W / target_queue_wait_s)      W = the predicted waits summed over the replicas
    for the load:  ceil(B / target_utilisation)       B = busy slots / slots, summed, averaged over time
    raw = max(both)                                   clipped to [min_replicas, max_replicas]

``W`` is the fleet's work ahead in replica-seconds: spread over ``n`` replicas it is ``W / n`` seconds
of wait each, so the first count is the fewest replicas that keep the wait within the target. With every
replica reporting it is ``ceil(current * mean wait / target)``, the proportional rule of Ray Serve's
default policy with the predicted wait in place of ongoing requests; summing instead of taking
``current`` times the mean counts a replica that has not reported yet (still starting) as having no
work: work does not multiply because a replica is on its way.

The wait alone cannot say when to scale down: a fleet with spare capacity has almost no backlog at any
load (batches are short beside the target), so it would shrink until it is overloaded, queue, grow
again, and cycle. ``B`` is the load itself, in replicas' worth of busy executors (Little's law: the
busy share is the arrival rate times the service time), averaged with an exponential moving average of
time constant ``busy_window_s`` because one instant sees each slot busy or idle. It does not depend on
``n`` while the fleet keeps up, so the second count is a fixed point the fleet settles at instead of
chasing its own changes, with ``1 - target_utilisation`` of headroom for bursts. Past saturation the
backlog grows and the first count takes over. An idle fleet has ``W = B = 0`` and goes to
``min_replicas``.

**Hysteresis** (Ray Serve's ``upscale_delay_s`` and ``downscale_delay_s``). The answer moves above
``current`` only after ``raw`` has been above it on every call for ``upscale_delay_s``, and then to the
smallest ``raw`` seen over that time (the scale the wish held at throughout); below ``current`` only
after ``downscale_delay_s`` of ``raw`` below it, to the largest ``raw`` seen. A call with ``raw ==
current``, or on the other side, restarts the wait. A delay of 0 acts at once. ``current`` outside
``[min_replicas, max_replicas]`` is brought inside at once: the bounds are not a scaling decision.

**What ``current`` is**: the replica count the fleet is set to now (Ray Serve's target number of
replicas, those still starting included), not the number running: while a scale-up is being carried
out, the answer stays the new count.

An empty ``signals`` (no replica has reported) is no information: the answer is ``current`` (within the
bounds) and the waits are not restarted. Scaling to zero replicas is not offered: with none running,
no replica reports a backlog to scale back up from (``min_replicas >= 1``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields

from batchpilot.core.scheduler import BatchScheduler

# W / target is a ratio of sums of floats: an exact multiple of the target may come out a hair above
# it (2.0000000000000004) and must not ask for one more replica.
_CEIL_SLACK = 1e-9


@dataclass(frozen=True)
class AutoscaleConfig:
    """Bounds, the wait the fleet aims at, and how long a wish to scale must hold before it is acted on."""

    min_replicas: int = 1
    max_replicas: int = 1
    target_queue_wait_s: float = 0.25  # predicted queue wait per replica the fleet aims at
    upscale_delay_s: float = 5.0
    downscale_delay_s: float = 30.0
    target_utilisation: float = 0.8  # busy share of the executors the fleet keeps at most, on average
    busy_window_s: float = 10.0  # time constant of the moving average of busy executors (0: none)

    def __post_init__(self) -> None:
        if int(self.min_replicas) != self.min_replicas or self.min_replicas < 1:
            raise ValueError(f"autoscale.min_replicas must be an integer >= 1 (with no replica running none "
                             f"reports a backlog to scale up from), got {self.min_replicas!r}")
        if int(self.max_replicas) != self.max_replicas or self.max_replicas < self.min_replicas:
            raise ValueError(f"autoscale.max_replicas must be an integer >= min_replicas "
                             f"({self.min_replicas}), got {self.max_replicas!r}")
        if not (math.isfinite(self.target_queue_wait_s) and self.target_queue_wait_s > 0):
            raise ValueError(f"autoscale.target_queue_wait_s must be a finite number > 0, "
                             f"got {self.target_queue_wait_s!r}")
        if not 0.0 < self.target_utilisation <= 1.0:
            raise ValueError(f"autoscale.target_utilisation must be in (0, 1], "
                             f"got {self.target_utilisation!r}")
        for name in ("upscale_delay_s", "downscale_delay_s", "busy_window_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"autoscale.{name} must be a finite number >= 0, got {value!r}")

    @classmethod
    def from_dict(cls, data: dict[str, object] | None) -> AutoscaleConfig:
        """From a config mapping; unknown keys are errors."""
        data = dict(data or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"autoscale: unknown key(s) {unknown}; the keys are {', '.join(sorted(known))}")
        return cls(**data)  # type: ignore[arg-type]


@dataclass(frozen=True)
class ReplicaSignal:
    """What one replica reports: its scheduler's state at one instant (``signal_of`` builds it)."""

    queue_depth: int  # inputs waiting in the replica's scheduler
    predicted_wait_s: float  # BatchScheduler.predicted_backlog_s(now): predicted seconds of work ahead
    running: int = 0  # batches dispatched and not yet done
    slots: int = 1  # the replica's executor slots (SchedulerConfig.num_slots)

    def __post_init__(self) -> None:
        if self.queue_depth < 0 or self.running < 0 or self.slots < 1:
            raise ValueError(f"replica signal: queue_depth and running must be >= 0 and slots >= 1, got "
                             f"{self.queue_depth}, {self.running}, {self.slots}")
        if not (math.isfinite(self.predicted_wait_s) and self.predicted_wait_s >= 0):
            raise ValueError(f"replica signal: predicted_wait_s must be a finite number >= 0, "
                             f"got {self.predicted_wait_s!r}")


def signal_of(scheduler: BatchScheduler, now: float) -> ReplicaSignal:
    """The signal of the replica whose encoder core is ``scheduler``, at ``now`` (live and simulated)."""
    return ReplicaSignal(scheduler.num_waiting, max(scheduler.predicted_backlog_s(now), 0.0),
                         scheduler.num_in_flight, max(scheduler.config.num_slots, 1))


class Autoscaler:
    """``decide(now, current, signals) -> desired replicas`` under ``config`` (the module docstring)."""

    def __init__(self, config: AutoscaleConfig) -> None:
        self.config = config
        self._last_now = -math.inf
        self._last_signal = -math.inf  # when the moving average of busy executors was last updated
        self._busy = 0.0
        # the wish in progress: (direction +1 up / -1 down, since when, the scale it has held at)
        self._wish: tuple[int, float, int] | None = None

    def raw_desire(self, current: int, signals: Sequence[ReplicaSignal]) -> int:
        """The replica count the signals ask for now, before the delays (the module docstring's rule;
        ``current`` within the bounds when nothing reported). Does not update the moving average."""
        cfg = self.config
        if not signals:
            wanted = current
        else:
            wanted = max(math.ceil(math.fsum(s.predicted_wait_s for s in signals) / cfg.target_queue_wait_s
                                   - _CEIL_SLACK),
                         math.ceil(self._busy / cfg.target_utilisation - _CEIL_SLACK))
        return min(max(wanted, cfg.min_replicas), cfg.max_replicas)

    @property
    def busy(self) -> float:
        """The moving average of busy executors, in replicas' worth (``B``)."""
        return self._busy

    def decide(self, now: float, current: int, signals: Sequence[ReplicaSignal]) -> int:
        """The replica count the fleet should be set to at ``now``; ``current`` is what it is set to."""
        if not math.isfinite(now):
            raise ValueError(f"autoscaler: now must be finite, got {now!r}")
        if now < self._last_now:
            raise ValueError(f"autoscaler: now went backwards ({now} after {self._last_now})")
        if current < 0:
            raise ValueError(f"autoscaler: current must be >= 0, got {current}")
        cfg = self.config
        if signals:
            busy = math.fsum(min(s.running, s.slots) / s.slots for s in signals)
            window = cfg.busy_window_s
            if self._last_signal == -math.inf or window == 0.0:
                self._busy = busy
            else:
                self._busy += (1.0 - math.exp(-(now - self._last_signal) / window)) * (busy - self._busy)
            self._last_signal = now
        self._last_now = now
        if current < cfg.min_replicas or current > cfg.max_replicas:
            self._wish = None
            return min(max(current, cfg.min_replicas), cfg.max_replicas)
        if not signals:
            return current
        raw = self.raw_desire(current, signals)
        if raw == current:
            self._wish = None
            return current
        direction = 1 if raw > current else -1
        wish = self._wish
        if wish is None or wish[0] != direction:
            wish = (direction, now, raw)
        else:
            wish = (direction, wish[1], min(wish[2], raw) if direction > 0 else max(wish[2], raw))
        delay = cfg.upscale_delay_s if direction > 0 else cfg.downscale_delay_s
        if now - wish[1] >= delay:
            self._wish = None
            return wish[2]
        self._wish = wish
        return current

    @property
    def pending(self) -> tuple[int, float, int] | None:
        """The wish waiting out its delay, ``(+1 up | -1 down, since, scale)``, or None (for logs)."""
        return self._wish
