"""Prometheus metrics on the server's own CollectorRegistry, fed by the Batcher's observer hooks.

Names (all prefixed ``batchpilot_``):

    queue_length / queue_tokens / pending_requests   gauges read at scrape time from the scheduler
    requests_in_progress                             gauge: requests admitted, not finished (concurrency)
    backlog_seconds                                  gauge: predicted model seconds ahead of a new request
    queue_time_seconds                               histogram: arrival -> dispatched in a batch
    request_latency_seconds                          histogram: arrival -> result, per input
    http_request_duration_seconds{route}             histogram: HTTP handler time, per request
    http_requests_total{route,status}                counter
    batch_size                                       histogram: requests per dispatched batch
    batch_run_seconds                                histogram: executor wall time per call
    useful_tokens_total / computed_tokens_total      counters: real vs computed (padded) tokens
    padding_efficiency                               gauge: useful / computed since start
    executor_busy_seconds_total / executor_busy_slots / executor_utilization
    rejections_total{reason}                         counter: core RejectReason values
    tenant_requests_total{tenant} / tenant_tokens_total{tenant}
                                                     counters: requests and input tokens admitted
    tenant_rejections_total{tenant,reason}           counter: refused or dropped, by tenant
    tenant_request_latency_seconds{tenant}           histogram: arrival -> result, per input
                                                     (``tenant``: a keys-file tenant, ``default``, or
                                                     ``other``: bounded, ``server/tenants.py``)
    cancellations_total{stage}                       counter: queued | running
    batch_failures_total                             counter: executor calls that raised
    health                                           gauge: 1 ok, 0.5 degraded, 0 draining/stopped
    precision_info{dtype} / precision_min_cosine     gauges: the precision served, and its accuracy
                                                     guard's minimum cosine to float32 (models/precision.py)
    executor_fallback_active / _fallback_batches     gauges: batches on the padded float32 fallback path
    executor_stalls / executor_stalled               gauges: batches past the watchdog's stall bound, and
                                                     1 while one is

Utilisation is ``busy seconds / (uptime × slots)``; over a window use
``rate(batchpilot_executor_busy_seconds_total[1m]) / slots``.

Each served model has its own ``ServerMetrics`` (its own registry); the server's /metrics shows them
all through ``ModelLabels``, every sample labelled ``model=<name>``, beside the server-wide series
(the request middleware's, GC pauses, the LLM's).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics_core import Metric

from batchpilot.core.admission import RejectReason
from batchpilot.core.batch import Batch
from batchpilot.core.request import DEFAULT_TENANT, Request
from batchpilot.runtime.batcher import BatcherObserver
from batchpilot.server.tenants import OTHER

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.35, 0.5, 0.75, 1.0, 1.5, 2.5, 5.0,
                   10.0)
BATCH_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 128, 256)
_HEALTH = {"ok": 1.0, "degraded": 0.5, "draining": 0.0, "stopped": 0.0}


class ServerMetrics(BatcherObserver):
    def __init__(self, num_slots: int = 1, registry: CollectorRegistry | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.registry = r = registry or CollectorRegistry()
        self.clock = clock
        self.num_slots = num_slots
        self._started = clock()
        self._busy_since: dict[int, float] = {}
        self._busy_total = 0.0
        self._useful = 0
        self._computed = 0
        self.queue_length = Gauge("batchpilot_queue_length", "Requests waiting in the scheduler", registry=r)
        self.queue_tokens = Gauge("batchpilot_queue_tokens", "Tokens waiting in the scheduler", registry=r)
        self.backlog = Gauge("batchpilot_backlog_seconds",
                                "Predicted model seconds ahead of a new request (in flight + queued, per "
                                "slot; what a declared latency SLA is checked against)", registry=r)
        self.pending = Gauge("batchpilot_pending_requests", "Accepted inputs, not yet answered", registry=r)
        self.in_progress = Gauge("batchpilot_requests_in_progress",
                                 "Requests admitted and not finished (what max_concurrency limits)",
                                 registry=r)
        self.queue_time = Histogram("batchpilot_queue_time_seconds", "Arrival to dispatch",
                                    buckets=LATENCY_BUCKETS, registry=r)
        self.latency = Histogram("batchpilot_request_latency_seconds", "Arrival to result, per input",
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.http_latency = Histogram("batchpilot_http_request_duration_seconds", "HTTP handler time",
                                      ["route"], buckets=LATENCY_BUCKETS, registry=r)
        self.http_requests = Counter("batchpilot_http_requests", "HTTP requests by route and status",
                                     ["route", "status"], registry=r)
        self.batch_size = Histogram("batchpilot_batch_size", "Requests per dispatched batch",
                                    buckets=BATCH_BUCKETS, registry=r)
        self.batch_run = Histogram("batchpilot_batch_run_seconds", "Executor wall time per call",
                                   buckets=LATENCY_BUCKETS, registry=r)
        self.useful_tokens = Counter("batchpilot_useful_tokens", "Real input tokens dispatched", registry=r)
        self.computed_tokens = Counter("batchpilot_computed_tokens", "Tokens computed including padding",
                                       registry=r)
        Gauge("batchpilot_padding_efficiency", "Useful / computed tokens since start", registry=r
              ).set_function(lambda: self._useful / self._computed if self._computed else 1.0)
        self.busy_seconds = Counter("batchpilot_executor_busy_seconds", "Seconds executor slots were busy",
                                    registry=r)
        self.busy_slots = Gauge("batchpilot_executor_busy_slots", "Slots executing now", registry=r)
        Gauge("batchpilot_executor_utilization", "Busy fraction of all slots since start", registry=r
              ).set_function(self._utilization)
        self.rejections = Counter("batchpilot_rejections", "Requests refused or dropped, by reason",
                                  ["reason"], registry=r)
        self.cancellations = Counter("batchpilot_cancellations", "Callers that went away", ["stage"],
                                     registry=r)
        self.batch_failures = Counter("batchpilot_batch_failures", "Executor calls that raised", registry=r)
        self.health = Gauge("batchpilot_health", "1 ok, 0.5 degraded, 0 draining or stopped", registry=r)
        self.health.set(1.0)
        self.precision = Gauge("batchpilot_precision_info", "1 for the precision the model runs at",
                               ["dtype"], registry=r)
        self.precision_cosine = Gauge(
            "batchpilot_precision_min_cosine", "Accuracy guard: minimum cosine of the served precision's "
            "embeddings to float32 on the probe set (1 for float32)", registry=r)
        for reason in RejectReason:  # export zeros so dashboards see every reason before it happens
            self.rejections.labels(reason=reason.value)
        self.tenant_requests = Counter("batchpilot_tenant_requests", "Requests admitted, by tenant",
                                       ["tenant"], registry=r)
        self.tenant_tokens = Counter("batchpilot_tenant_tokens", "Input tokens admitted, by tenant",
                                     ["tenant"], registry=r)
        self.tenant_rejections = Counter("batchpilot_tenant_rejections",
                                         "Requests refused or dropped, by tenant and reason",
                                         ["tenant", "reason"], registry=r)
        self.tenant_latency = Histogram("batchpilot_tenant_request_latency_seconds",
                                        "Arrival to result, per input, by tenant", ["tenant"],
                                        buckets=LATENCY_BUCKETS, registry=r)
        # a tenant's label: bounded (the keys file's tenants, default, other); the server sets it
        # (``server.tenants.Tenancy.label``)
        self.tenant_label: Callable[[str], str] = _default_label
        self._tenant_counts: dict[tuple[str, str], Counter] = {}  # (series, label) -> its child
        self._tenant_latency: dict[str, Histogram] = {}

    def bind(self, scheduler: Any, num_pending: Callable[[], int]) -> None:
        """Read queue gauges from the live scheduler at scrape time (no per-request updates)."""
        self.queue_length.set_function(lambda: scheduler.num_waiting)
        self.queue_tokens.set_function(lambda: scheduler.num_waiting_tokens)
        self.backlog.set_function(lambda: scheduler.predicted_backlog_s(time.monotonic()))
        self.pending.set_function(num_pending)
        self.in_progress.set_function(lambda: scheduler.num_requests)

    def bind_fallback(self, executor: Any) -> None:
        """The fallback executor's state (``runtime/executor.py``), read at scrape time."""
        Gauge("batchpilot_executor_fallback_active", "1 while batches run on the padded float32 fallback",
              registry=self.registry).set_function(lambda: float(executor.fallback_active))
        Gauge("batchpilot_executor_fallback_batches", "Batches the fallback path ran since start",
              registry=self.registry).set_function(lambda: executor.num_fallback_batches)

    def bind_watchdog(self, watchdog: Any) -> None:
        """The Batcher watchdog's stalls (``runtime/batcher.py``), read at scrape time."""
        Gauge("batchpilot_executor_stalls", "Batches that ran past the stall bound since start",
              registry=self.registry).set_function(lambda: watchdog.num_stalls)
        Gauge("batchpilot_executor_stalled", "1 while a batch is past the stall bound",
              registry=self.registry).set_function(lambda: float(watchdog.stuck))

    def set_precision(self, dtype: str, min_cosine: float) -> None:
        self.precision.labels(dtype=dtype).set(1.0)
        self.precision_cosine.set(min_cosine)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def _utilization(self) -> float:
        now = self.clock()
        busy = self._busy_total + sum(now - t for t in self._busy_since.values())
        elapsed = (now - self._started) * self.num_slots
        return busy / elapsed if elapsed > 0 else 0.0

    def _count(self, kind: str, tenant: str, amount: float = 1.0) -> None:
        """Add to the ``kind`` counter (requests, tokens) of ``tenant``'s label (children cached per
        label: a bounded set)."""
        label = self.tenant_label(tenant)
        child = self._tenant_counts.get((kind, label))
        if child is None:
            family = self.tenant_requests if kind == "requests" else self.tenant_tokens
            child = self._tenant_counts[kind, label] = family.labels(tenant=label)
        child.inc(amount)

    # -- BatcherObserver ---------------------------------------------------------------------
    def on_admit(self, request: Request) -> None:
        if request.group < 0 or request.group == request.id:  # once per request, at its first input
            self._count("requests", request.tenant)
        self._count("tokens", request.tenant, request.length)

    def on_reject(self, reason: RejectReason, tenant: str = DEFAULT_TENANT) -> None:
        self.rejections.labels(reason=reason.value).inc()
        self.tenant_rejections.labels(tenant=self.tenant_label(tenant), reason=reason.value).inc()

    def on_dispatch(self, batch: Batch, now: float) -> None:
        self.batch_size.observe(batch.size)
        observe = self.queue_time.observe
        for r in batch.requests:
            observe(now - r.arrival)
        useful, computed = batch.shape.useful_tokens, batch.shape.tokens
        self._useful += useful
        self._computed += computed
        self.useful_tokens.inc(useful)
        self.computed_tokens.inc(computed)

    def on_batch_done(self, batch: Batch, run_s: float, ok: bool) -> None:
        self.batch_run.observe(run_s)
        if not ok:
            self.batch_failures.inc()

    def on_request_done(self, request: Request, latency_s: float, ok: bool) -> None:
        self.latency.observe(latency_s)
        label = self.tenant_label(request.tenant)
        child = self._tenant_latency.get(label)
        if child is None:
            child = self._tenant_latency[label] = self.tenant_latency.labels(tenant=label)
        child.observe(latency_s)

    def on_cancel(self, request: Request, queued: bool) -> None:
        self.cancellations.labels(stage="queued" if queued else "running").inc()

    def on_slot_busy(self, slot: int, busy: bool) -> None:
        now = self.clock()
        if busy:
            self._busy_since[slot] = now
        else:
            since = self._busy_since.pop(slot, None)
            if since is not None:
                self._busy_total += now - since
                self.busy_seconds.inc(now - since)
        self.busy_slots.set(len(self._busy_since))

    def on_health(self, state: str) -> None:
        self.health.set(_HEALTH.get(state, 0.0))


def _default_label(tenant: str) -> str:
    return DEFAULT_TENANT if tenant == DEFAULT_TENANT else OTHER


class ModelLabels:
    """A collector showing several models' registries as one set of families, each sample labelled
    with its registry's labels (``model=<name>``, and ``arm=<arm>`` for a model served in arms;
    registered on the server's registry)."""

    def __init__(self, registries: dict[str, CollectorRegistry]
                 | list[tuple[dict[str, str], CollectorRegistry]]) -> None:
        self.registries = ([({"model": m}, r) for m, r in registries.items()]
                           if isinstance(registries, dict) else list(registries))

    def describe(self) -> list[Metric]:
        return []  # names are checked per model registry; the families are built at scrape time

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        for labels, registry in self.registries:
            for fam in registry.collect():
                out = families.get(fam.name)
                if out is None:
                    out = families[fam.name] = Metric(fam.name, fam.documentation, fam.type, fam.unit)
                out.samples += [s._replace(labels={**labels, **s.labels}) for s in fam.samples]
        yield from families.values()
