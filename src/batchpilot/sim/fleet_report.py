"""Rich tables for fleet runs: each replica's share of a ``simulate --replicas`` run."""

from __future__ import annotations

import math
from typing import Any

from batchpilot.sim.fleet import FleetRun
from batchpilot.sim.fleet_scaling import FleetScaling


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
