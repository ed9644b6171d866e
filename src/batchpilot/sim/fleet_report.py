"""Rich tables for fleet runs: each replica's share of a ``simulate --replicas`` run."""

from __future__ import annotations

import math
from typing import Any

from .fleet import FleetRun


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
