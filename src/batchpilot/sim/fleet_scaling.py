"""Autoscaling a simulated fleet: ``core.autoscale.Autoscaler`` deciding, replicas that take time to start.

    run = simulate_fleet(workload, config, cost_model, router="power_of_two",
                         autoscale=FleetScaling(AutoscaleConfig(min_replicas=1, max_replicas=6)))

Every ``interval_s`` of simulated time (while requests are still to come or in progress) the replicas
taking traffic report ``core.autoscale.signal_of(scheduler, now)`` — the signal the live policy
builds — and ``Autoscaler.decide(now, current, signals)`` answers with the replica count, ``current``
being the count the fleet is set to (running plus starting). A new replica takes ``start_delay_s``
before it is routed to (loading the model, warming up); a replica being removed stops receiving
requests at once, finishes what it has (draining) and is then off. A replica still starting is the
first removed; one draining is the first brought back. The replicas are allocated up front
(``max_replicas`` of them, each with its own scheduler); one that is off keeps its state, as a fresh
start would not (its ``work_scale`` and policy averages stay), which matters little for an idle core.

What it does not model: the start delay's spread, a replica that fails to start, the controller's
metrics delay beyond ``interval_s`` (Ray Serve averages metrics over a look-back period), and the cost
of a start on the replicas already running.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from batchpilot.core.autoscale import AutoscaleConfig, Autoscaler, signal_of
from batchpilot.sim.replica import Replica

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


def scaling_from_args(args: Any) -> FleetScaling | None:
    """``--autoscale MIN:MAX`` as a ``FleetScaling`` (None without it)."""
    if not getattr(args, "autoscale", None):
        return None
    try:
        lo, hi = (int(x) for x in str(args.autoscale).split(":"))
    except ValueError:
        raise ValueError(f"--autoscale wants MIN:MAX (two integers), got {args.autoscale!r}") from None
    if args.replicas != 1:
        raise ValueError("--autoscale sets the replica count: leave out --replicas")
    return FleetScaling(AutoscaleConfig(min_replicas=lo, max_replicas=hi), start_delay_s=args.start_delay_s)
