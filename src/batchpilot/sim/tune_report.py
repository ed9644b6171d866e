"""What a tuning run says: why the winner wins, the ranked table, and the winner as a config file."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from batchpilot.core.deployment import DeploymentSpec

if TYPE_CHECKING:
    from batchpilot.sim.tune import TuneResult


def explain(result: TuneResult) -> str:
    """Why the winner wins, in the three terms that decide it: batch size, padding, queueing."""
    b = result.best
    lines = [f"winner: {b.label}: {b.rps:.2f} req/s with P99 <= {result.sla_p99_s:g} s"]
    for base in result.baselines:
        lines.append(f"  vs {base.label}: {base.rps:.2f} req/s -> x{result.gain_over(base):.2f}")
    rows = [("winner", b)] + [(c.label, c) for c in result.baselines]
    lines.append("  at capacity (batch per request = sum(n^2)/sum(n); tail = slowest 1%):")
    for name, c in rows:
        r = c.report
        if r is None:
            continue
        lines.append(
            f"    {name:<34} batch {r.mean_batch_size:4.1f} (per request {r.request_batch_size:4.1f}), "
            f"padding efficiency {r.padding_efficiency:4.0%}, queueing {r.queue_share:4.0%} of latency "
            f"({r.tail_queue_share:4.0%} in the tail), executor {r.utilisation:4.0%} busy")
    return "\n".join(lines)


def write_yaml(result: TuneResult, path: str | Path, spec: DeploymentSpec | None = None) -> Path:
    """The winner as a config file (``encoder:`` and ``server:`` sections) that ``serve --config`` and
    ``simulate --config`` read."""
    from batchpilot.config_file import dump_spec

    b = result.best
    header = (f"# batchpilot tune: {result.workload.name} ({len(result.workload)} rows), P99 <= "
              f"{result.sla_p99_s:g} s\n# predicted capacity: rate scale {b.capacity:.3f} = "
              f"{b.rps:.2f} req/s; {b.label}\n")
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    return dump_spec((spec or DeploymentSpec()).replace(encoder=b.config), p, header)


def result_table(result: TuneResult, limit: int = 12) -> Any:
    from rich.table import Table

    t = Table(title=f"capacity at P99 <= {result.sla_p99_s:g} s ({result.workload.name}, "
                    f"{len(result.workload)} rows)")
    for col in ("rank", "config", "kind", "req/s", "scale", "vs best", "batch/req", "pad eff", "queue %",
                "P99 ms"):
        t.add_column(col, justify="left" if col in ("config", "kind") else "right")
    shown = [c for c in result.candidates if c.kind == "search"][:limit]
    shown += [c for c in result.candidates if c.kind != "search"]
    order = {id(c): i + 1 for i, c in enumerate(result.candidates)}
    for c in shown:
        r = c.report
        t.add_row(str(order[id(c)]), c.label, c.kind, f"{c.rps:.2f}", f"{c.capacity:.3f}",
                  f"{c.rps / result.best.rps:.2f}" if result.best.rps else "-",
                  f"{r.request_batch_size:.1f}" if r else "-", f"{r.padding_efficiency:.0%}" if r else "-",
                  f"{r.queue_share:.0%}" if r else "-", f"{r.p99_all * 1e3:.0f}" if r else "-")
    return t
