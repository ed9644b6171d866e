"""One live run of the fidelity check: warm the server, replay a slice, read its own histograms."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from batchpilot.bench.capacity import wait_idle
from batchpilot.bench.loadgen import KEEPALIVE_EXPIRY_S, LoadGenConfig, build_plan, replay
from batchpilot.bench.records import RequestRecord, Summary, summarize
from batchpilot.bench.scrape import MetricsSeries
from batchpilot.sim.traces import Workload


@dataclass
class Measurement:
    summary: Summary
    records: list[RequestRecord]
    metrics: MetricsSeries | None
    server: dict[str, float] = field(default_factory=dict)  # means from the server's histograms
    origin_s: float = math.nan  # ``time.monotonic()`` of the replay's zero (``ReplayResult.origin_s``)

    def sent_monotonic(self) -> list[float]:
        """Every sent request's send time on ``time.monotonic()`` (the server's batch-log clock)."""
        return [self.origin_s + r.sent_s for r in self.records if math.isfinite(r.sent_s)]


# server histogram -> the name used in the diagnosis
SERVER_HISTOGRAMS = {
    "batch_size": "batchpilot_batch_size",
    "batch_run_s": "batchpilot_batch_run_seconds",
    "queue_s": "batchpilot_queue_time_seconds",
    "batcher_latency_s": "batchpilot_request_latency_seconds",
    "http_handler_s": "batchpilot_http_request_duration_seconds{route=/v1/embeddings}",
}


def histogram_mean(series: MetricsSeries, name: str) -> float:
    base, _, labels = name.partition("{")
    return series.histogram_mean(base, labels.rstrip("}"))


def measure(url: str, workload: Workload, texts: list[str], sla_s: float, warmup_requests: int,
            progress: bool, label: str, keepalive_s: float = KEEPALIVE_EXPIRY_S) -> Measurement:
    """Warm the server with a few unmeasured requests, let it drain, then replay ``workload`` exactly
    (idle pooled connections closed after ``keepalive_s``: ``LoadGenConfig.keepalive_s``)."""
    if warmup_requests:
        warm_up(url, workload, texts, warmup_requests, keepalive_s)
    plan = build_plan(workload, texts=texts[: len(workload)])  # a cut slice is a prefix of the texts' rows
    res = replay(plan, LoadGenConfig(url, progress=progress, keepalive_s=keepalive_s), description=label)
    m = Measurement(summarize(res.records, sla_s), res.records, res.metrics, origin_s=res.origin_s)
    if res.metrics is not None:
        m.server = {k: histogram_mean(res.metrics, v) for k, v in SERVER_HISTOGRAMS.items()}
        batches = res.metrics.delta("batchpilot_batch_size_count")
        for key, counter in (("computed_tokens_per_batch", "batchpilot_computed_tokens_total"),
                             ("useful_tokens_per_batch", "batchpilot_useful_tokens_total")):
            m.server[key] = res.metrics.delta(counter) / batches if batches > 0 else math.nan
    return m


def warm_up(url: str, workload: Workload, texts: list[str], n: int,
            keepalive_s: float = KEEPALIVE_EXPIRY_S) -> None:
    """Send the first ``n`` rows (unmeasured) and wait for the queue to drain: the first calls of a fresh
    server are slow (allocator, kernels for new shapes), which is not what a fidelity check measures."""
    warm = workload.slice(0, min(n, len(workload)))
    replay(build_plan(warm, texts=texts[: len(warm)], warmup_requests=len(warm)),
           LoadGenConfig(url, progress=False, scrape_interval_s=0, keepalive_s=keepalive_s))
    wait_idle(url, 10.0)
