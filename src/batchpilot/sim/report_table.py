"""The simulator's report as a rich table (``batchpilot simulate``)."""

from __future__ import annotations

import math
from typing import Any


def ms(x: float) -> str:
    return "-" if math.isnan(x) else ("inf" if math.isinf(x) else f"{x * 1e3:,.1f} ms")


def report_table(report: Any, title: str) -> Any:
    from rich.table import Table

    t = Table(title=title, show_header=True, header_style="bold")
    t.add_column("metric")
    t.add_column("value", justify="right")
    for key in ("p50", "p90", "p99", "p99.9", "mean"):
        t.add_row(f"latency {key}", ms(report.latency[key]))
    for key in ("p50", "p99", "mean"):
        t.add_row(f"queue wait {key}", ms(report.queue[key]))
    t.add_row("P99 incl. rejected/dropped", ms(report.p99_all))
    t.add_row(f"SLA attainment (<= {report.sla_s:g} s)", f"{report.sla_attainment:.2%}")
    t.add_row("goodput", f"{report.goodput_rps:,.2f} req/s")
    t.add_row("throughput", f"{report.throughput_rps:,.2f} req/s, {report.throughput_tokens_s:,.0f} tok/s")
    t.add_row("offered", f"{report.offered_rps:,.2f} req/s")
    t.add_row("padding efficiency", f"{report.padding_efficiency:.1%}")
    t.add_row("batches / mean size", f"{report.num_batches:,} / {report.mean_batch_size:.2f}")
    t.add_row("batch size per request (sum n^2 / sum n)", f"{report.request_batch_size:.2f}")
    t.add_row("mean padded length", f"{report.mean_padded_len:.1f}")
    t.add_row("queueing share of latency (slowest 1%)",
              f"{report.queue_share:.1%} ({report.tail_queue_share:.1%})")
    t.add_row("executor utilisation", f"{report.utilisation:.1%}")
    t.add_row("predicted peak memory", f"{report.peak_memory_bytes / 2**20:,.1f} MiB")
    t.add_row("completed / measured", f"{report.num_completed:,} / {report.num_measured:,}")
    failures = ", ".join(f"{k}: {v}" for k, v in report.failures_by_reason.items()) or "none"
    t.add_row("rejected / dropped / unfinished",
              f"{report.num_rejected} / {report.num_dropped} / {report.num_unfinished} ({failures})")
    t.add_row("batch sizes (size:count)", _top_hist(report.batch_size_hist))
    return t


def _top_hist(hist: dict[int, int], k: int = 6) -> str:
    top = sorted(hist.items(), key=lambda kv: -kv[1])[:k]
    return " ".join(f"{size}:{count}" for size, count in sorted(top))
