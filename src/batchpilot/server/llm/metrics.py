"""Prometheus metrics of the LLM engine, on the server's ``CollectorRegistry``.

Gauges and counters are read from ``engine.stats()`` at scrape time (a collector: no polling thread,
never stale); latencies are histograms fed by the engine thread through ``engine.observers``
(prometheus_client is thread-safe). Every engine metric starts with ``batchpilot_llm_``.
``batchpilot_llm_rejected_requests_total{reason}`` counts the requests the engine refused or ended at
their deadline, one per request, by the answer's error code: ``context_length_exceeded`` (400),
``queue_full`` (503), ``timeout`` (504); read from the core's counts (``runtime/llm/engine.py``), of
the engine and of its fallback together. Behind a failover
(``runtime/llm/failover.py``) the engine's health is read the same way, labelled
``engine="llm"``: ``batchpilot_engine_up``, ``batchpilot_engine_fallback_active``,
``batchpilot_engine_faults_total{kind}``, ``batchpilot_engine_recoveries_total``,
``batchpilot_engine_stall_timeout_seconds`` and ``batchpilot_fallback_requests_total``.

Per tenant (label ``tenant``, bounded as the encoder's: the keys file's tenants, ``default``, ``other``;
``Engine.set_tenants``): ``batchpilot_llm_tenant_requests_total`` and ``batchpilot_llm_tenant_tokens_total``
(admitted; tokens as the token quota charges them: prompts plus ``max_tokens``),
``batchpilot_llm_tenant_rejections_total{tenant,reason}`` (the refusals above and the quotas',
``quota_tokens`` and ``quota_concurrency``: 429), read from the core's ledger at scrape time, and the
histogram ``batchpilot_llm_tenant_time_to_first_token_seconds{tenant}``.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator
from typing import cast

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from batchpilot.runtime.llm.engine import REASONS, EngineStats, LLMEngine, TokenEvent
from batchpilot.runtime.llm.failover import LLMFailover
from batchpilot.server.llm.served import ServedEngine

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class _EngineCollector(Collector):
    def __init__(self, engine: ServedEngine) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        s = self.engine.stats()
        gauges = {
            "running_seqs": ("Sequences in the running batch", s.num_running),
            "waiting_seqs": ("Sequences waiting for admission (incl. preempted by recompute; swapped-out "
                             "ones are swapped_seqs)", s.num_waiting),
            "kv_blocks_used": ("KV cache blocks in use", s.num_blocks - s.num_free_blocks),
            "kv_blocks_free": ("KV cache blocks free", s.num_free_blocks),
            "kv_usage_ratio": ("Share of KV blocks in use", s.kv_usage),
            "kv_fragmentation_ratio": ("Share of allocated KV slots holding no token", s.fragmentation),
            "generation_tokens_per_second": ("Output tokens per second over the recent window",
                                             s.tokens_per_s),
            "swapped_seqs": ("Sequences swapped out now (KV in host blocks)", s.num_swapped),
            "swap_blocks_used": ("Host swap blocks in use", s.num_swap_blocks - s.num_free_swap_blocks),
            "swap_blocks_free": ("Host swap blocks free", s.num_free_swap_blocks),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(f"batchpilot_llm_{name}", doc, value=float(value))
        counters = {
            "preemptions": ("Sequences preempted for KV memory (swapped out or recomputed)",
                            s.num_preemptions),
            "recompute_preemptions": ("Preemptions that freed the KV, to prefill again",
                                      s.num_recompute_preemptions),
            "recomputed_tokens": ("Computed tokens recompute preemptions threw away",
                                  s.num_recomputed_tokens),
            "swapped_out": ("Preemptions that copied the KV to host blocks", s.num_swapped_out),
            "swapped_in": ("Swapped sequences copied back to device blocks", s.num_swapped_in),
            "swap_seconds": ("Wall time of KV block copies between device and host", s.swap_seconds),
            "steps": ("Engine steps run", s.num_steps),
            "generation_tokens": ("Output tokens generated", s.num_generated_tokens),
            "prefix_cache_hit_tokens": ("Prompt tokens served from the prefix cache",
                                        s.prefix_cache_hit_tokens),
            "step_seconds": ("Wall time of engine steps (schedule, forward, sample, detokenise, deliver)",
                             s.step_seconds),
            "step_forward_seconds": ("Part of the step time in forward + sampling", s.forward_seconds),
            "step_seqs": ("Sequences summed over engine steps (/ steps = mean batch)", s.step_seqs),
        }
        for name, (doc, value) in counters.items():
            yield CounterMetricFamily(f"batchpilot_llm_{name}", doc, value=float(value))
        feats = CounterMetricFamily("batchpilot_llm_step_feature",
                                    "Step cost-model features (StepShape) summed over engine steps",
                                    labels=["feature"])
        for name, value in sorted(s.step_features.items()):
            feats.add_metric([name], float(value))
        yield feats
        rejected = CounterMetricFamily("batchpilot_llm_rejected_requests", "Requests refused or ended at "
                                       "their deadline, by the answer's code: context_length_exceeded "
                                       "(400), queue_full (503), timeout (504)", labels=["reason"])
        counts = _refused(self.engine)
        for reason in REASONS:
            rejected.add_metric([reason], float(counts[reason]))
        yield rejected
        yield from _tenants(self.engine)
        yield from _memory(self.engine, s)


def _refused(engine: ServedEngine) -> collections.Counter[str]:
    """Requests refused by reason: the core's counts (``LLMAdmission.refused``) of the engine, and
    behind a failover of the engine it runs now and of its fallback (each keeps its counts across
    rebuilds). A stand-in without an admission counts nothing."""
    total: collections.Counter[str] = collections.Counter()
    for e in (getattr(engine, "main", engine), getattr(engine, "fallback", None)):
        counts = getattr(getattr(e, "admission", None), "refused", None)
        if counts is not None:
            total.update({reason: counts[reason] for reason in REASONS})
    return total


def _tenants(engine: ServedEngine) -> Iterator[Metric]:
    """The per-tenant counters of the engine's admission (``Engine.tenant_usage``), by bounded label."""
    usage = getattr(engine, "tenant_usage", None)
    if usage is None:  # a stand-in without tenants
        return
    label = getattr(engine, "tenant_label", str)
    requests: collections.Counter[str] = collections.Counter()
    tokens: collections.Counter[str] = collections.Counter()
    rejected: collections.Counter[tuple[str, str]] = collections.Counter()
    for name, st in usage():
        key = label(name)
        requests[key] += st.requests
        tokens[key] += st.tokens
        for reason, count in st.rejected.items():
            rejected[key, reason] += count
    families = (("requests", "LLM requests admitted, by tenant", requests),
                ("tokens", "Tokens admitted (prompts plus max_tokens), by tenant", tokens))
    for name, doc, counts in families:
        family = CounterMetricFamily(f"batchpilot_llm_tenant_{name}", doc, labels=["tenant"])
        for key, value in sorted(counts.items()):
            family.add_metric([key], float(value))
        yield family
    family = CounterMetricFamily("batchpilot_llm_tenant_rejections", "LLM requests refused, by tenant and "
                                 "reason", labels=["tenant", "reason"])
    for (key, reason), value in sorted(rejected.items()):
        family.add_metric([key, reason], float(value))
    yield family


def _memory(engine: ServedEngine, s: EngineStats) -> Iterator[Metric]:
    """The memory plan (``core/llm/config.py``) beside what is used: planned bytes by part, the KV bytes the
    blocks in use hold, and what the process holds on the device now."""
    # behind a failover: the engine it runs now; only an LLMEngine (or a stand-in for one) has a plan
    main = cast(LLMEngine, getattr(engine, "main", engine))
    plan = getattr(main, "memory_plan", None)
    if plan is None:
        return
    from batchpilot.models.device import free_memory_bytes, used_memory_bytes

    planned = GaugeMetricFamily("batchpilot_llm_memory_planned_bytes", "The engine's memory plan by part "
                                "(weights, overhead, activation peak, kv pool, host swap space)",
                                labels=["part"])
    parts = [("weights", plan.weights_bytes), ("overhead", plan.overhead_bytes), ("kv", plan.kv_bytes),
             ("swap", plan.swap_bytes)]
    if getattr(getattr(main, "memory_profile", None), "source", "none") != "none":  # measured, so planned
        parts.append(("activation", plan.activation_bytes))
    for part, value in parts:
        planned.add_metric([part], float(value))
    yield planned
    device = main.runner.device
    used = GaugeMetricFamily("batchpilot_llm_memory_used_bytes", "Memory in use: kv = KV blocks in use x "
                             "block bytes; device = what this process holds on the device (CUDA: torch's "
                             "allocations; CPU: the resident set)", labels=["part"])
    used.add_metric(["kv"], float((s.num_blocks - s.num_free_blocks) * plan.block_bytes))
    used.add_metric(["device"], used_memory_bytes(device))
    yield used
    free = free_memory_bytes(device)
    if free is not None:
        yield GaugeMetricFamily("batchpilot_llm_memory_free_bytes", "Device memory free now", value=free)


class _FailoverCollector(Collector):
    def __init__(self, failover: LLMFailover) -> None:
        self.failover = failover

    def collect(self) -> Iterator[Metric]:
        f, labels = self.failover, ["engine"]
        engines = {"llm": float(f.is_alive)}
        if f.fallback is not None:  # the fallback has a watchdog of its own
            engines["llm_fallback"] = float(bool(f.fallback.is_alive) and not f.fallback_failed)
        up = GaugeMetricFamily("batchpilot_engine_up", "1 while the engine serves, 0 from a fault until it "
                               "is back (the LLM engine: a probe; its fallback: rebuilt)", labels=labels)
        for engine, value in engines.items():
            up.add_metric([engine], value)
        yield up
        gauges = {
            "engine_fallback_active": ("1 while the fallback engine takes the traffic",
                                       float(f.fallback_active)),
            "engine_stall_timeout_seconds": ("How long a step may run before it counts as stalled",
                                             f.watchdog.timeout_s()),
        }
        for name, (doc, value) in gauges.items():
            g = GaugeMetricFamily(f"batchpilot_{name}", doc, labels=labels)
            g.add_metric(["llm"], value)
            yield g
        faults = CounterMetricFamily("batchpilot_engine_faults", "Engine faults (died, stalled, oom)",
                                     labels=["engine", "kind"])
        for kind in ("died", "stalled", "oom"):
            faults.add_metric(["llm", kind], float(f.faults[kind]))
            if f.fallback is not None:
                faults.add_metric(["llm_fallback", kind], float(f.fallback_faults[kind]))
        yield faults
        for name, doc, value in (
                ("engine_recoveries", "Returns to the engine after a successful probe", f.breaker.num_closed),
                ("fallback_requests", "Requests the fallback engine took", f.fallback_requests)):
            c = CounterMetricFamily(f"batchpilot_{name}", doc, labels=labels)
            c.add_metric(["llm"], float(value))
            yield c


class LLMMetrics:
    def __init__(self, engine: ServedEngine, registry: CollectorRegistry) -> None:
        registry.register(_EngineCollector(engine))
        if hasattr(engine, "breaker"):  # behind a failover (or a stand-in for one): its health too
            registry.register(_FailoverCollector(cast(LLMFailover, engine)))
        self.ttft = Histogram("batchpilot_llm_time_to_first_token_seconds", "Arrival to first token",
                              buckets=LATENCY_BUCKETS, registry=registry)
        self.itl = Histogram("batchpilot_llm_inter_token_latency_seconds", "Time between output tokens",
                             buckets=LATENCY_BUCKETS, registry=registry)
        self.requests = Counter("batchpilot_llm_requests", "Finished LLM requests",
                                ["route", "finish_reason"], registry=registry)
        self.prompt_tokens = Counter("batchpilot_llm_prompt_tokens", "Prompt tokens of finished requests",
                                     registry=registry)
        self.tenant_ttft = Histogram("batchpilot_llm_tenant_time_to_first_token_seconds",
                                     "Arrival to first token, by tenant", ["tenant"], buckets=LATENCY_BUCKETS,
                                     registry=registry)
        self.engine = engine
        engine.observers.append(self.on_token)

    def on_token(self, event: TokenEvent) -> None:
        if event.ttft_s is not None:
            self.ttft.observe(event.ttft_s)
            label = getattr(self.engine, "tenant_label", str)(event.tenant)
            self.tenant_ttft.labels(tenant=label).observe(event.ttft_s)
        if event.itl_s is not None:
            self.itl.observe(event.itl_s)
