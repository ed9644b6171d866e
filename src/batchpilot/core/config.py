"""One config dataclass per component, validated at construction, loadable from the config file.

``SchedulerConfig.from_dict`` reads the ``encoder:`` section of the one config file
(``batchpilot.settings``, ``core.deployment.DeploymentSpec``) that ``serve``, ``simulate``, ``tune``
and ``bench`` read and ``tune`` writes (``to_dict``). Unknown keys are errors: a typo in a config must
not silently fall back to a default.

Byte sizes as people write them (``parse_bytes``) are the file's first section.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Literal, TypeVar, cast

# -- Byte sizes ------------------------------------------------------------------------------------
# Byte sizes as people write them: ``parse_bytes("4GiB")``, ``"512MiB"``, ``"1.5GB"``, ``"1e9"``.

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_bytes(text: str | int | float, default_unit: str = "") -> int:
    """Bytes in ``text``: a number with an optional unit (B, KB/MB/GB/TB powers of 1000, KiB/MiB/GiB/TiB
    powers of 1024, case-insensitive); a bare number is in ``default_unit`` (bytes unless given).
    Raises ``ValueError`` naming the accepted forms."""
    if isinstance(text, (int, float)):
        return int(text * _UNITS[default_unit.lower()])
    m = _SIZE.match(text)
    unit = (m.group(2) if m else "").lower() or default_unit.lower()
    if m is None or unit not in _UNITS:
        raise ValueError(f"{text!r} is not a size; write a number with an optional unit, e.g. 4GiB, "
                         f"512MiB, 2GB or 1073741824")
    return int(float(m.group(1)) * _UNITS[unit])


PolicyName = Literal["static", "window", "backlog", "hybrid", "adaptive", "sla", "aimd"]
Grouping = Literal["fifo", "bucket", "sorted", "dp"]
Padding = Literal["max", "dynamic", "bucket", "none"]
RequestOrder = Literal["fcfs", "priority", "edf"]  # the orders of one queue of requests
QueueOrder = Literal["fcfs", "priority", "edf", "fair"]  # fair: among tenants, then a RequestOrder
BucketMethod = Literal["fixed", "quantile", "kmeans", "dp"]

POLICIES = ("static", "window", "backlog", "hybrid", "adaptive", "sla", "aimd")
GROUPINGS = ("fifo", "bucket", "sorted", "dp")
PADDINGS = ("max", "dynamic", "bucket", "none")
REQUEST_ORDERS = ("fcfs", "priority", "edf")
QUEUE_ORDERS = (*REQUEST_ORDERS, "fair")
BUCKET_METHODS = ("fixed", "quantile", "kmeans", "dp")


def _choice(component: str, name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{component}.{name} = {value!r}; choose one of {', '.join(allowed)}")


def _positive(component: str, name: str, value: float, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{component}.{name} must be {bound}, got {value}")


@dataclass(frozen=True)
class PolicyConfig:
    """When to dispatch. ``max_wait_s`` is measured from the oldest waiting request (Triton)."""

    # Defaults = the tuner's winner on conv-embed (docs/benchmarks.md): short window, modest batches.
    # "flag": the deployment flags that override these (settings.add_field_flags)
    name: PolicyName = field(default="hybrid", metadata={"flag": {"name": "--policy", "choices": POLICIES}})
    max_batch_size: int = field(default=16, metadata={"flag": {}})
    max_wait_s: float = field(default=0.005, metadata={"flag": {"name": "--max-wait-ms", "unit": "ms"}})
    # backlog / hybrid: fire early once this much is waiting (0 = off for tokens)
    backlog_requests: int = 16
    backlog_tokens: int = 0
    # hybrid patience: keep waiting past max_wait_s (up to patience_s more) when arrivals are imminent
    patience_s: float = 0.0
    # window, backlog, hybrid, adaptive, aimd: with a slot free, wait for more requests only while the
    # next arrival (the EWMA gap) is expected sooner than the break-even gap of the cost model
    # (``Policy.break_even_gap``): at light load a lone request goes at once. False: the fixed window.
    wait_only_if_it_pays: bool = True
    # adaptive window from the EWMA of inter-arrival times
    min_wait_s: float = 0.0
    ewma_alpha: float = 0.2
    # sla-aware
    sla_s: float = 1.0
    on_infeasible: Literal["dispatch", "drop"] = "dispatch"
    # aimd (Clipper)
    aimd_target_s: float = 0.25
    aimd_add: int = 1
    aimd_mult: float = 0.5
    aimd_min_batch: int = 1

    def __post_init__(self) -> None:
        _choice("policy", "name", self.name, POLICIES)
        if self.max_batch_size < 1:
            raise ValueError(f"policy.max_batch_size must be >= 1, got {self.max_batch_size}")
        _positive("policy", "max_wait_s", self.max_wait_s, allow_zero=True)
        _positive("policy", "patience_s", self.patience_s, allow_zero=True)
        _positive("policy", "min_wait_s", self.min_wait_s, allow_zero=True)
        if self.min_wait_s > self.max_wait_s:
            raise ValueError(
                f"policy.min_wait_s ({self.min_wait_s}) must be <= policy.max_wait_s ({self.max_wait_s})"
            )
        if self.backlog_requests < 1:
            raise ValueError(f"policy.backlog_requests must be >= 1, got {self.backlog_requests}")
        _positive("policy", "backlog_tokens", self.backlog_tokens, allow_zero=True)
        if not 0.0 < self.ewma_alpha <= 1.0:
            raise ValueError(f"policy.ewma_alpha must be in (0, 1], got {self.ewma_alpha}")
        _positive("policy", "sla_s", self.sla_s)
        _choice("policy", "on_infeasible", self.on_infeasible, ("dispatch", "drop"))
        _positive("policy", "aimd_target_s", self.aimd_target_s)
        if self.aimd_add < 1 or not 0.0 < self.aimd_mult < 1.0 or self.aimd_min_batch < 1:
            raise ValueError("policy: aimd_add must be >= 1, aimd_mult in (0, 1), aimd_min_batch >= 1")


@dataclass(frozen=True)
class BucketingConfig:
    """Length buckets. Boundaries are upper edges (inclusive); the last is the model's max length."""

    method: BucketMethod = "fixed"
    boundaries: tuple[int, ...] = (64, 128, 256, 512)
    num_buckets: int = 4
    refit_every_requests: int = 1000
    refit_every_s: float = 60.0
    history: int = 4096

    def __post_init__(self) -> None:
        _choice("bucketing", "method", self.method, BUCKET_METHODS)
        object.__setattr__(self, "boundaries", tuple(int(b) for b in self.boundaries))
        if not self.boundaries or list(self.boundaries) != sorted(set(self.boundaries)):
            raise ValueError(f"bucketing.boundaries must be strictly increasing, got {self.boundaries}")
        if self.boundaries[0] < 1:
            raise ValueError("bucketing.boundaries must be >= 1 token")
        if self.num_buckets < 1:
            raise ValueError(f"bucketing.num_buckets must be >= 1, got {self.num_buckets}")
        if self.refit_every_requests < 1 or self.history < 1:
            raise ValueError("bucketing.refit_every_requests and bucketing.history must be >= 1")
        _positive("bucketing", "refit_every_s", self.refit_every_s)


@dataclass(frozen=True)
class PlannerConfig:
    """Which waiting requests form a batch, and how they are padded."""

    grouping: Grouping = "sorted"
    # Padding-free by default: padding mixed lengths to the longest costs more than batching saves
    # (simulated and measured in docs/benchmarks.md); executors without a ragged path fall back.
    padding: Padding = field(default="none", metadata={"flag": {"choices": PADDINGS}})
    max_len: int = 512
    max_batch_tokens: int = 0  # 0 = no token budget
    max_batch_memory_bytes: float = 0.0  # 0 = no memory budget
    pad_to_multiple_of: int = 1
    lookahead: int = 4  # sorted/dp: look at the oldest lookahead * max_batch_size requests

    def __post_init__(self) -> None:
        _choice("planner", "grouping", self.grouping, GROUPINGS)
        _choice("planner", "padding", self.padding, PADDINGS)
        if self.max_len < 1 or self.pad_to_multiple_of < 1 or self.lookahead < 1:
            raise ValueError("planner.max_len, planner.pad_to_multiple_of and planner.lookahead must be >= 1")
        _positive("planner", "max_batch_tokens", self.max_batch_tokens, allow_zero=True)
        _positive("planner", "max_batch_memory_bytes", self.max_batch_memory_bytes, allow_zero=True)
        if self.padding in ("max", "bucket") and 0 < self.max_batch_tokens < self.max_len:
            raise ValueError(
                f"planner.max_batch_tokens ({self.max_batch_tokens}) must be >= planner.max_len "
                f"({self.max_len}) with padding {self.padding!r}: one request padded to max_len would not fit"
            )


@dataclass(frozen=True)
class AdmissionConfig:
    """What gets in. 0 means unlimited (or off) for every limit here.

    Every limit applies to a *request* (a group of inputs admitted or refused as a whole,
    ``BatchScheduler.submit_group``), never to part of one. ``core/deployment.py`` fills the server's
    defaults (concurrency, timeout, a declared SLA) into the zeros, the same for ``serve`` and
    ``simulate``.
    """

    rate: float = 0.0  # token bucket refill, requests per second (one token per request)
    burst: int = 0
    max_queued_requests: int = 0  # inputs waiting (a request is admitted whole into an empty queue)
    max_queued_tokens: int = 0
    # predicted seconds of model work waiting (each input: its share of a full batch of its length,
    # ``AdmissionController.work_s``); a request is always admitted into an empty queue
    max_backlog_s: float = 0.0
    # requests admitted and not yet finished (queued or in a batch): the server's concurrency limit
    max_concurrent_requests: int = 0
    # an input still waiting this long after its arrival is dropped (DEADLINE_EXPIRED: the server's 504)
    timeout_s: float = 0.0
    # a declared latency SLA: refuse a request whose predicted completion (work ahead + its own) misses
    # it; 0 = none declared, so no latency-based shedding (requests queue within the other bounds)
    latency_sla_s: float = 0.0
    max_length: int = 512
    reject_infeasible: bool = True

    def __post_init__(self) -> None:
        _positive("admission", "rate", self.rate, allow_zero=True)
        _positive("admission", "max_backlog_s", self.max_backlog_s, allow_zero=True)
        _positive("admission", "timeout_s", self.timeout_s, allow_zero=True)
        _positive("admission", "latency_sla_s", self.latency_sla_s, allow_zero=True)
        if (self.burst < 0 or self.max_queued_requests < 0 or self.max_queued_tokens < 0
                or self.max_concurrent_requests < 0):
            raise ValueError("admission.burst, max_queued_requests, max_queued_tokens and "
                             "max_concurrent_requests must be >= 0")
        if self.rate > 0 and self.burst < 1:
            raise ValueError("admission.burst must be >= 1 when admission.rate is set")
        if self.max_length < 1:
            raise ValueError(f"admission.max_length must be >= 1, got {self.max_length}")


@dataclass(frozen=True)
class SchedulerConfig:
    """Everything the encoder scheduling core needs; the tuner's YAML is ``to_dict()`` of this."""

    policy: PolicyConfig = field(default_factory=PolicyConfig)
    planner: PlannerConfig = field(default_factory=PlannerConfig)
    bucketing: BucketingConfig = field(default_factory=BucketingConfig)
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    queue_order: QueueOrder = field(default="fcfs", metadata={"flag": {"choices": QUEUE_ORDERS}})
    # under queue_order "fair" (core/fair.py): the order of one tenant's own requests
    tenant_order: RequestOrder = "fcfs"
    # under queue_order "fair", while more than one tenant is active (core/fair.py), a batch's predicted
    # time is at most this: a batch cannot be preempted, so what a tenant's new request waits behind is
    # bounded by it. 0: the deployment derives it from the cost model (core/deployment.py); a scheduler
    # whose config was not resolved runs 0 as no bound
    fair_quantum_s: float = 0.0
    # under queue_order "fair": a tenant whose queue was empty is served ahead of the tenants already
    # waiting for this many of its own input tokens (its burst, repaid later: core/fair.py)
    fair_burst_tokens: int = 8192
    # executor slots (model instances / worker threads)
    num_slots: int = field(default=1, metadata={"flag": {}})
    # Pipelining: a busy slot takes its next batch ``pipeline_lead_s`` before its running batch is
    # predicted to end, so the next batch is collated while this one runs (``next_batch_at``). "auto":
    # the deployment turns it on only where collation is a measurable share of a batch (the profile's
    # ``prepare_share``, ``core/deployment.py``); "off": a slot takes its next batch when it is free.
    pipeline: Literal["auto", "on", "off"] = "auto"
    # 0: the deployment derives the lead from the profile's measured collation time
    pipeline_lead_s: float = 0.0

    def __post_init__(self) -> None:
        _choice("scheduler", "queue_order", self.queue_order, QUEUE_ORDERS)
        _choice("scheduler", "tenant_order", self.tenant_order, REQUEST_ORDERS)
        _positive("scheduler", "fair_quantum_s", self.fair_quantum_s, allow_zero=True)
        _positive("scheduler", "fair_burst_tokens", self.fair_burst_tokens, allow_zero=True)
        if self.num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {self.num_slots}")
        _positive("scheduler", "pipeline_lead_s", self.pipeline_lead_s, allow_zero=True)
        _choice("scheduler", "pipeline", self.pipeline, ("auto", "on", "off"))

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["bucketing"]["boundaries"] = list(self.bucketing.boundaries)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> SchedulerConfig:
        data = dict(data or {})
        sections = {"policy": PolicyConfig, "planner": PlannerConfig, "bucketing": BucketingConfig,
                    "admission": AdmissionConfig}
        kwargs: dict[str, Any] = {}
        for key, value in data.items():
            if key in sections:
                kwargs[key] = _build(sections[key], key, value or {})
            elif key in _TOP_LEVEL:
                kwargs[key] = value
            else:
                allowed = ", ".join([*sections, *_TOP_LEVEL])
                raise ValueError(f"config: unknown key {key!r}; allowed top-level keys: {allowed}")
        return cls(**kwargs)


_TOP_LEVEL = ("queue_order", "tenant_order", "fair_quantum_s", "fair_burst_tokens",
              "num_slots", "pipeline", "pipeline_lead_s")
T = TypeVar("T")


def _build(kind: type[T], section: str, values: dict[str, Any]) -> T:
    names = {f.name for f in fields(cast(Any, kind))}
    unknown = sorted(set(values) - names)
    if unknown:
        raise ValueError(f"config: unknown key(s) {unknown} in {section!r}; allowed: {sorted(names)}")
    return kind(**values)
