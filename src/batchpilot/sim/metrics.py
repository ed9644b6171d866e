"""From a run's flat records to the numbers people ask for (numpy only).

Definitions (requests arriving before ``warmup_s`` are left out of every request metric; batches
started before it are left out of the batch metrics):

* latency = finish - arrival (end-to-end), queue = dispatch - arrival; P50/P90/P99/P99.9 and mean,
  over completed requests. ``p99_all`` counts rejected, dropped and unfinished requests as infinitely
  late: a policy cannot look good by shedding load, so the tuner uses this one.
* SLA attainment = completed within ``sla_s`` / all measured requests; goodput = those per second.
* throughput = completed requests (and useful tokens) per second of the measured span
  (first measured arrival to last finish).
* padding efficiency = useful tokens / computed tokens over the measured batches.
* utilisation = busy slot-seconds / (slots x span of the whole run).
* request batch size = sum(n^2) / sum(n): the batch size the average *request* rode in (bursts, where
  batching matters, weigh in proportion to the requests they hold); tail queue share = queue wait /
  latency over the slowest 1% (what sets P99).
* peak memory = the largest sum of predicted memory over batches running at the same time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from batchpilot.sim.target import DONE, DROPPED, PENDING, REJECTED, SimRun

QUANTILES = (50.0, 90.0, 99.0, 99.9)
_FAILED = 1e300


@dataclass
class SimReport:
    num_requests: int
    num_measured: int
    num_completed: int
    num_rejected: int
    num_dropped: int
    num_unfinished: int
    failures_by_reason: dict[str, int]
    latency: dict[str, float]  # p50 p90 p99 p99.9 mean (seconds)
    queue: dict[str, float]
    p99_all: float
    sla_s: float
    sla_attainment: float
    goodput_rps: float
    throughput_rps: float
    throughput_tokens_s: float
    offered_rps: float
    padding_efficiency: float
    mean_batch_size: float
    mean_padded_len: float
    num_batches: int
    batch_size_hist: dict[int, int]
    padded_len_hist: dict[int, int]
    utilisation: float
    peak_memory_bytes: float
    queue_share: float  # mean queue wait / mean latency
    tail_queue_share: float  # the same over the slowest 1% of completed requests (what sets P99)
    request_batch_size: float  # batch size as requests see it: sum(n^2) / sum(n) (bursts weigh more)
    extra: dict[str, Any] = field(default_factory=dict)

    def meets(self, sla_p99_s: float) -> bool:
        return self.p99_all <= sla_p99_s


def _pcts(x: np.ndarray) -> dict[str, float]:
    if x.size == 0:
        return {"p50": math.nan, "p90": math.nan, "p99": math.nan, "p99.9": math.nan, "mean": math.nan}
    q = np.percentile(x, QUANTILES)
    return {"p50": float(q[0]), "p90": float(q[1]), "p99": float(q[2]), "p99.9": float(q[3]),
            "mean": float(x.mean())}


def _hist(values: np.ndarray) -> dict[int, int]:
    if values.size == 0:
        return {}
    uniq, counts = np.unique(values, return_counts=True)
    return {int(u): int(c) for u, c in zip(uniq, counts, strict=True)}


def peak_concurrent(start: np.ndarray, end: np.ndarray, amount: np.ndarray) -> float:
    """Largest running sum of ``amount`` over overlapping ``[start, end)`` intervals (ends before starts)."""
    if start.size == 0:
        return 0.0
    times = np.concatenate([end, start])
    deltas = np.concatenate([-amount, amount])
    kinds = np.concatenate([np.zeros(end.size), np.ones(start.size)])  # at a tie, release first
    order = np.lexsort((kinds, times))
    return float(np.max(np.cumsum(deltas[order]), initial=0.0))


def batch_memory(run: SimRun) -> np.ndarray:
    """Predicted peak bytes of every batch (the service model's memory over the recorded shapes)."""
    rec = run.record
    n, tokens, attn = (np.asarray(x, dtype=float) for x in (rec.b_size, rec.b_tokens, rec.b_attn))
    return np.asarray(run.service_model.batch_memory(n, tokens, attn), dtype=float) * np.ones_like(n)


def summarize(run: SimRun, sla_s: float = 1.0, warmup_s: float = 0.0) -> SimReport:
    rec, wl = run.record, run.workload
    arrival = wl.arrival_s
    status = np.asarray(rec.status, dtype=np.int8)
    finish = np.asarray(rec.finish_s, dtype=float)
    dispatch = np.asarray(rec.dispatch_s, dtype=float)
    measured = arrival >= warmup_s
    done = measured & (status == DONE)
    lat = finish[done] - arrival[done]
    wait = dispatch[done] - arrival[done]  # queue time in the batcher, as the server measures it
    n_meas = int(measured.sum())
    # failures as a huge finite latency (inf would make the interpolation inf - inf = nan)
    lat_all = np.where(done, finish - arrival, _FAILED)[measured]
    p99_all = float(np.percentile(lat_all, 99.0)) if n_meas else math.nan
    p99_all = math.inf if p99_all >= 1e200 else p99_all  # interpolated toward a failure
    within = int((lat <= sla_s).sum())
    t0 = float(arrival[measured][0]) if n_meas else 0.0
    t_end = float(np.nanmax(finish[measured])) if done.any() else t0
    span = max(t_end - t0, 1e-12)

    b_start = np.asarray(rec.b_start, dtype=float)
    b_dur = np.asarray(rec.b_duration, dtype=float)
    bm = b_start >= warmup_s
    size = np.asarray(rec.b_size, dtype=np.int64)[bm]
    padded = np.asarray(rec.b_padded_len, dtype=np.int64)[bm]
    tokens = np.asarray(rec.b_tokens, dtype=np.int64)[bm]
    useful = np.asarray(rec.b_useful, dtype=np.int64)[bm]
    lat_stats, wait_stats = _pcts(lat), _pcts(wait)
    run_span = max(run.stats.end_s - float(arrival[0]) if len(arrival) else 0.0, 1e-12)
    mean_lat = lat_stats["mean"]
    reasons = dict(sorted(rec.reasons.items()))
    return SimReport(
        num_requests=len(wl),
        num_measured=n_meas,
        num_completed=int(done.sum()),
        num_rejected=int((measured & (status == REJECTED)).sum()),
        num_dropped=int((measured & (status == DROPPED)).sum()),
        num_unfinished=int((measured & (status == PENDING)).sum()),
        failures_by_reason=reasons,
        latency=lat_stats,
        queue=wait_stats,
        p99_all=p99_all,
        sla_s=sla_s,
        sla_attainment=within / n_meas if n_meas else math.nan,
        goodput_rps=within / span,
        throughput_rps=float(done.sum()) / span,
        throughput_tokens_s=float(wl.input_tokens[done].sum()) / span,
        offered_rps=(n_meas - 1) / max(float(arrival[measured][-1]) - t0, 1e-12) if n_meas > 1 else 0.0,
        padding_efficiency=float(useful.sum() / tokens.sum()) if tokens.sum() else math.nan,
        mean_batch_size=float(size.mean()) if size.size else math.nan,
        mean_padded_len=float(padded.mean()) if padded.size else math.nan,
        num_batches=int(size.size),
        batch_size_hist=_hist(size),
        padded_len_hist=_hist(padded),
        utilisation=float(sum(run.stats.busy_s)) / (run.config.num_slots * run_span),
        peak_memory_bytes=peak_concurrent(b_start, b_start + b_dur, batch_memory(run)),
        queue_share=wait_stats["mean"] / mean_lat if mean_lat and mean_lat > 0 else math.nan,
        tail_queue_share=_tail_share(lat, wait),
        request_batch_size=float((size * size).sum() / size.sum()) if size.size else math.nan,
    )


def _tail_share(lat: np.ndarray, wait: np.ndarray) -> float:
    if lat.size == 0:
        return math.nan
    tail = lat >= np.percentile(lat, 99.0)
    total = float(lat[tail].sum())
    return float(wait[tail].sum()) / total if total > 0 else math.nan


def queue_length_series(run: SimRun) -> tuple[np.ndarray, np.ndarray]:
    """Requests waiting (admitted, not yet dispatched or dropped) just after each event time."""
    rec, wl = run.record, run.workload
    status = np.asarray(rec.status)
    admitted = status != REJECTED
    arr = wl.arrival_s[admitted]
    dispatch = np.asarray(rec.dispatch_s, dtype=float)
    leave = np.where(np.isnan(dispatch), np.asarray(rec.finish_s, dtype=float), dispatch)[admitted]
    leave = leave[~np.isnan(leave)]
    times = np.concatenate([arr, leave])
    deltas = np.concatenate([np.ones(arr.size), -np.ones(leave.size)])
    order = np.lexsort((deltas, times))
    return times[order], np.cumsum(deltas[order])


# The simulator's report as a rich table (``batchpilot simulate``).

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
