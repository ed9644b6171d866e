"""The deployment a server runs, resolved once: what ``serve``, ``simulate``, ``tune`` and ``bench`` all run.

A user gives a config file (``encoder:``, ``llm:`` and ``server:`` sections, ``DeploymentSpec``),
command-line flags on top of it, and a profile; the model adds its limits (``ModelLimits``). One pure
function turns that into the effective deployment::

    resolve_deployment(spec, cost_model, model) -> Deployment(scheduler, spec, notes)

Rules, in order (each change is written into ``notes``, which the server logs and the simulator prints):

1. Lengths: ``planner.max_len`` and ``admission.max_length`` are clamped to the model's limit.
2. Padding: a model without a padding-free path serves ``padding: none`` configs padded per batch
   (``dynamic``).
3. Memory: with no batch memory budget of its own, one batch may use ``server.memory_share`` of the
   device memory the model reports (``ModelLimits.memory_bytes``), priced by the cost model.
4. Admission, from ``server:``: the concurrency limit (requests in progress), the request timeout (an
   input not started by then is dropped: 504), and, only when the user declares one, the latency SLA
   (refuse a request whose predicted completion misses it). A value set in ``encoder.admission``
   wins over the ``server:`` one. Without a declared SLA nothing is refused for latency: requests queue
   within the count bounds and the timeout, as TEI and Triton do by default.
5. Pipelining: ``pipeline: auto`` is on only where the profile's collation is at least
   ``MIN_PIPELINE_SHARE`` of a batch's run (``cost_model.meta["prepare_share"]``; on when a profile
   does not say). On, a slot takes its next batch ``pipeline_lead_s`` before the running one is
   predicted to end; unless set, twice the profile's measured collation time
   (``cost_model.meta["prepare_s"]``), at least ``MIN_PIPELINE_LEAD_S``.
6. The fair order's quantum (``queue_order: fair``, ``core/fair.py``): unless set, the shortest batch
   that spends at most ``1 - FAIR_BATCH_EFFICIENCY`` of its predicted time on the cost model's fixed
   cost per batch (``c0 / (1 - FAIR_BATCH_EFFICIENCY)``); where the model has no fixed cost, 0: no bound.

Nothing here reads a clock, a file or the machine: the driver passes in what it measured.

The LLM deployment (``resolve_llm_deployment``) is the file's last section.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from batchpilot.core.config import SchedulerConfig, _build, _positive, parse_bytes
from batchpilot.core.costmodel import CostModel
from batchpilot.core.llm.config import KVPlan, KVPlanError, LLMSchedulerConfig, MemoryProfile, plan_kv

MIN_PIPELINE_LEAD_S = 0.0005  # covers the thread hand-off even when collation is nearly free
# Pipelining saves at most the collation per batch and costs the requests that arrive while a batch
# formed early waits: "auto" keeps it only where collation is at least this share of a batch's run.
MIN_PIPELINE_SHARE = 0.02
# The fair order's quantum bounds a batch while tenants contend: the shorter, the less a tenant's new
# request waits behind another's batch, and the larger the share of the machine spent on batches'
# fixed cost. The default quantum keeps that share at 10%.
FAIR_BATCH_EFFICIENCY = 0.9
SECTIONS = ("encoder", "llm", "server", "model")
PRECISIONS = ("auto", "float32", "bfloat16", "float16", "int8")
LLM_PRECISIONS = ("auto", "float32", "bfloat16", "float16")  # the LLM engine's (models/llm/precision.py)
BACKENDS = ("torch", "onnx")


@dataclass(frozen=True)
class ServingOptions:
    """The ``server:`` section: what the server promises every request, whatever the scheduler config."""

    # "flag": the deployment flag that overrides the field (settings.add_field_flags; {key} is
    # server.<field>)

    # requests (each with all its inputs) admitted and not yet answered; more get 503 + Retry-After.
    # TEI's default; 0 = no limit
    max_concurrency: int = field(default=512, metadata={"flag": {
        "help": "requests in progress at once before 503 ({key}, default {default}; 0 = no limit); given, "
                "it also bounds the LLM engine's admitted sequences unless llm.max_waiting_seqs is set "
                "(core/llm/config.py)"}})
    # not answered by then: 504 (queued inputs are dropped by the core)
    request_timeout_s: float = field(default=60.0, metadata={"flag": {
        "help": "answer 504 when a request is not done by then ({key}, default {default:g}); given, it also "
                "applies to the LLM routes unless llm.request_timeout_s is set (their own default: 600)"}})
    # a declared SLA (seconds): latency-based shedding; 0 = none declared
    latency_sla_s: float = field(default=0.0, metadata={"flag": {
        "name": "--latency-sla", "metavar": "S",
        "help": "declare a latency SLA in seconds: refuse (503) a request whose predicted completion would "
                "miss it ({key}; default none: no shedding)"}})
    memory_share: float = 0.25  # one batch may use this share of device memory (0 = no budget)
    # threads tokenising inputs and prompts off the event loop, per model: the servers of the simulator's
    # serial stage (sim.service); 0 = one per core the server may run on (what the profile recorded)
    tokenizer_workers: int = field(default=0, metadata={"flag": {
        "help": "threads tokenising inputs and prompts off the event loop, per model ({key}; default: one "
                "per core the server may run on); the simulator's serial stage has as many servers"}})

    def __post_init__(self) -> None:
        if self.tokenizer_workers < 0:
            raise ValueError(f"server.tokenizer_workers must be >= 0 (0 = one per core), "
                             f"got {self.tokenizer_workers}")
        if self.max_concurrency < 0:
            raise ValueError(f"server.max_concurrency must be >= 0 (0 = no limit), "
                             f"got {self.max_concurrency}")
        _positive("server", "request_timeout_s", self.request_timeout_s)
        _positive("server", "latency_sla_s", self.latency_sla_s, allow_zero=True)
        if not 0.0 <= self.memory_share <= 1.0:
            raise ValueError(f"server.memory_share must be in [0, 1], got {self.memory_share}")


@dataclass(frozen=True)
class ModelOptions:
    """The ``model:`` section: how the encoder runs. ``backend`` torch (padded and padding-free
    forwards) or onnx (ONNX Runtime, padded). ``dtype`` ``auto`` takes the fastest precision the
    backend supports on this machine whose embeddings keep a cosine of at least ``min_cosine`` to
    float32 on a fixed probe set (``models/precision.py``; a profile's measured choice when serving
    with one)."""

    # "flag": serve's flag that overrides the field (settings.add_field_flags)
    dtype: str = field(default="auto", metadata={"flag": {
        "choices": PRECISIONS,
        "help": "encoder precision (default {default}: the fastest this machine supports that passes the "
                "accuracy guard; a --profile's measured choice when given one)"}})
    min_cosine: float = field(default=0.999, metadata={"flag": {
        "help": "accuracy guard: least cosine to float32 embeddings on the probe set (default {default})"}})
    backend: str = field(default="torch", metadata={"flag": {
        "choices": BACKENDS,
        "help": "encoder backend: {default} (default) or onnx (ONNX Runtime, padded batches)"}})

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"model.backend = {self.backend!r}; choose one of {', '.join(BACKENDS)}")
        if self.dtype not in PRECISIONS:
            raise ValueError(f"model.dtype = {self.dtype!r}; choose one of {', '.join(PRECISIONS)}")
        if not 0.0 < self.min_cosine <= 1.0:
            raise ValueError(f"model.min_cosine must be in (0, 1], got {self.min_cosine}")


@dataclass(frozen=True)
class DeploymentSpec:
    """One config file, four sections: ``encoder`` (``SchedulerConfig``), ``llm``
    (``LLMSchedulerConfig``), ``server`` (``ServingOptions``) and ``model`` (``ModelOptions``).
    Unknown keys are errors. ``llm_given`` and ``server_given``: the ``llm:`` and ``server:`` keys the
    user set (in the file or by a flag), even to their default value; the LLM deployment needs to know,
    e.g., whether ``max_model_len`` was asked for or is the model's own, and whether
    ``request_timeout_s`` was set for every route (``core/llm/config.py``)."""

    encoder: SchedulerConfig = field(default_factory=SchedulerConfig)
    llm: LLMSchedulerConfig = field(default_factory=LLMSchedulerConfig)
    server: ServingOptions = field(default_factory=ServingOptions)
    model: ModelOptions = field(default_factory=ModelOptions)
    llm_given: frozenset[str] = field(default=frozenset(), compare=False)  # provenance, not a setting
    server_given: frozenset[str] = field(default=frozenset(), compare=False)

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> DeploymentSpec:
        data = dict(data or {})
        unknown = sorted(set(data) - set(SECTIONS))
        if unknown:
            hint = ""
            if set(unknown) & {"policy", "planner", "bucketing", "admission", "queue_order", "num_slots"}:
                hint = " (scheduler settings go under 'encoder:')"
            raise ValueError(f"config: unknown top-level key(s) {unknown}{hint}; "
                             f"the sections are {', '.join(SECTIONS)}")
        llm = dict(data.get("llm") or {})
        if "eos_token_ids" in llm:
            llm["eos_token_ids"] = tuple(llm["eos_token_ids"])
        # sizes may be written with a unit (4GiB); a bare swap_space is GiB, as --swap-space (and vLLM's)
        for key, unit in (("kv_cache_memory", ""), ("swap_space", "gib")):
            if isinstance(llm.get(key), str | int | float) and not isinstance(llm.get(key), bool):
                try:
                    llm[key] = parse_bytes(llm[key], unit)
                except ValueError as exc:
                    raise ValueError(f"config: llm.{key}: {exc}") from exc
        server = dict(data.get("server") or {})
        return cls(encoder=SchedulerConfig.from_dict(data.get("encoder")),
                   llm=_build(LLMSchedulerConfig, "llm", llm),
                   server=_build(ServingOptions, "server", server),
                   model=_build(ModelOptions, "model", dict(data.get("model") or {})),
                   llm_given=frozenset(llm), server_given=frozenset(server))

    def to_dict(self) -> dict[str, Any]:
        llm = dataclasses.asdict(self.llm)
        llm["eos_token_ids"] = list(self.llm.eos_token_ids)
        if self.llm.swap_space:
            llm["swap_space"] = f"{self.llm.swap_space}B"  # a bare number reads back as GiB
        return {"encoder": self.encoder.to_dict(), "llm": llm, "server": dataclasses.asdict(self.server),
                "model": dataclasses.asdict(self.model)}

    def replace(self, *, encoder: SchedulerConfig | None = None, llm: LLMSchedulerConfig | None = None,
                model: ModelOptions | None = None, llm_given: frozenset[str] = frozenset(),
                **server: Any) -> DeploymentSpec:
        """A copy with some sections replaced and some ``server`` options changed (flags on top of a file;
        ``None`` values are ignored, so unset flags keep the file's); ``llm_given`` joins the given keys,
        and so do the ``server`` options changed."""
        changed = {k: v for k, v in server.items() if v is not None}
        return DeploymentSpec(encoder or self.encoder, llm or self.llm,
                              dataclasses.replace(self.server, **changed) if changed else self.server,
                              model or self.model, self.llm_given | llm_given,
                              self.server_given | frozenset(changed))


@dataclass(frozen=True)
class ModelLimits:
    """What the loaded model (or the simulated one) allows."""

    max_length: int = 512
    supports_padding_free: bool = True
    memory_bytes: float = 0.0  # the device memory a batch budget is a share of (0: no budget)

    @classmethod
    def from_meta(cls, meta: dict[str, Any]) -> ModelLimits:
        """The limits a profile recorded of its model (``batchpilot profile`` writes them into
        ``cost_model.meta``): what the simulator resolves a deployment with, when no model is loaded."""
        return cls(int(meta.get("max_length", 512)), bool(meta.get("supports_padding_free", True)),
                   float(meta.get("device_memory_bytes", 0.0)))


@dataclass(frozen=True)
class Deployment:
    """The effective deployment: the scheduler config every driver runs, and why it differs from the file."""

    scheduler: SchedulerConfig
    spec: DeploymentSpec
    notes: tuple[str, ...] = ()

    def describe(self) -> str:
        """One line for logs and reports."""
        s = self.scheduler
        a, p = s.admission, s.planner
        mem = f"{p.max_batch_memory_bytes / 2**20:.0f} MiB" if p.max_batch_memory_bytes else "none"
        sla = f"{a.latency_sla_s * 1e3:.0f} ms (shedding on)" if a.latency_sla_s else "none (no shedding)"
        return (f"policy={s.policy.name} max_batch_size={s.policy.max_batch_size} "
                f"max_wait={s.policy.max_wait_s * 1e3:.1f} ms padding={p.padding} grouping={p.grouping}"
                f"{' (queue order: padding-free)' if p.padding == 'none' and p.grouping != 'fifo' else ''} "
                f"slots={s.num_slots} pipelining {s.pipeline}"
                f"{f' (lead {s.pipeline_lead_s * 1e3:.2f} ms)' if s.pipeline == 'on' else ''}; admission: "
                f"concurrency <= {a.max_concurrent_requests or 'inf'}, queue <= "
                f"{a.max_queued_requests or 'inf'} inputs / {a.max_queued_tokens or 'inf'} tokens, timeout "
                f"{a.timeout_s or 'inf'} s, latency SLA {sla}, rate {a.rate or 'inf'}/s; batch memory {mem}")


def resolve_deployment(spec: DeploymentSpec, cost_model: CostModel,
                       model: ModelLimits | None = None) -> Deployment:
    """The effective encoder deployment (see the module docstring for the rules)."""
    model = model or ModelLimits()
    cfg = spec.encoder
    opts = spec.server
    notes: list[str] = []
    planner, adm = cfg.planner, cfg.admission
    if planner.max_len > model.max_length:
        notes.append(f"planner.max_len {planner.max_len} -> {model.max_length} (the model's limit)")
        planner = dataclasses.replace(planner, max_len=model.max_length)
    if adm.max_length > model.max_length:
        adm = dataclasses.replace(adm, max_length=model.max_length)
    if planner.padding == "none" and not model.supports_padding_free:
        notes.append("padding 'none' is not supported by this model: serving with padding 'dynamic'")
        planner = dataclasses.replace(planner, padding="dynamic")
    if not planner.max_batch_memory_bytes and opts.memory_share and model.memory_bytes \
            and any(cost_model.encoder_memory_coef):
        budget = opts.memory_share * model.memory_bytes
        notes.append(f"batch memory budget {budget / 2**20:.0f} MiB ({opts.memory_share:.0%} of memory)")
        planner = dataclasses.replace(planner, max_batch_memory_bytes=budget)
    fill: dict[str, Any] = {}
    if not adm.max_concurrent_requests and opts.max_concurrency:
        fill["max_concurrent_requests"] = opts.max_concurrency
    if not adm.timeout_s:
        fill["timeout_s"] = opts.request_timeout_s
    if not adm.latency_sla_s and opts.latency_sla_s:
        fill["latency_sla_s"] = opts.latency_sla_s
    if fill:
        adm = dataclasses.replace(adm, **fill)
    lead = cfg.pipeline_lead_s
    if not lead:
        prepare = float(cost_model.meta.get("prepare_s", 0.0) or 0.0)
        lead = max(2.0 * prepare, MIN_PIPELINE_LEAD_S)
    pipeline = cfg.pipeline
    if pipeline == "auto":
        raw = cost_model.meta.get("prepare_share")
        share = float(raw) if raw is not None else math.inf  # a profile that does not say: keep it on
        pipeline = "on" if share >= MIN_PIPELINE_SHARE else "off"
        if pipeline == "off":
            notes.append(f"pipelining off: collation is {share:.2%} of a batch in the profile "
                         f"(it pays from {MIN_PIPELINE_SHARE:.0%}); set pipeline: on to force it")
    quantum = cfg.fair_quantum_s
    if not quantum:  # derived whatever the order: a comparison of orders swaps only the order
        c0 = cost_model.encoder_latency_coef[0]
        quantum = c0 / (1.0 - FAIR_BATCH_EFFICIENCY) if c0 > 0 else 0.0
        if cfg.queue_order == "fair":
            notes.append(f"fair quantum {quantum * 1e3:.1f} ms: a batch spends at most "
                         f"{1 - FAIR_BATCH_EFFICIENCY:.0%} of its time on the fixed cost per batch"
                         if quantum else "fair quantum: none (the cost model has no fixed cost per batch)")
    resolved = dataclasses.replace(cfg, planner=planner, admission=adm, pipeline=pipeline,
                                   pipeline_lead_s=lead, fair_quantum_s=quantum)
    return Deployment(resolved, spec, tuple(notes))


# -- The LLM deployment ----------------------------------------------------------------------------
# The LLM deployment, resolved once: the ``LLMSchedulerConfig`` an engine runs, and its KV plan.
#
#     resolve_llm_deployment(spec, model, memory, free_bytes, swap_on_device)
#         -> LLMDeployment(config, plan, notes)
#
# ``serve --llm`` and ``bench fidelity --workload conv-llm`` (both through
# ``runtime/llm/build.build_llm_engine``) and ``simulate --target llm`` (``sim/llm.py``, from the
# profile) all call it, so the engine the simulator runs is the one the server builds. Rules, in order
# (each change is written into ``notes``, which the server logs and the simulator prints):
#
# 1. Deadline: ``llm.request_timeout_s`` when the user set it; else ``server.request_timeout_s`` when the
#    user set that (in the file or with ``--request-timeout-s``); else the LLM's own default (600 s: a
#    generation runs far longer than an embedding). The routes' deadline and the engine's expiry use it.
# 2. Concurrency: ``llm.max_waiting_seqs`` when the user set it; else, when the user set
#    ``server.max_concurrency`` (``--max-concurrency``) above 0, the engine admits that many sequences
#    (one per prompt): ``max_waiting_seqs = max_concurrency - max_num_seqs``, at least 0 (an engine always
#    admits the ``max_num_seqs`` it runs). ``max_concurrency: 0`` (no limit) leaves the LLM's bound as it is.
# 3. The model: unless set, ``max_model_len`` is the model's position count and ``eos_token_ids`` its EOS
#    tokens (``LLMModelLimits``; a value the model does not give leaves the section's).
# 4. Memory: with a ``MemoryProfile``, ``core.llm.config.plan_kv`` sizes the pool and checks it; where
#    ``max_model_len`` is the model's own, a pool too small for it lowers it to the pool's capacity.
#    Without one, ``num_kv_blocks`` stands, and a memory budget is an error that says how to get one.
#
# Pure: the drivers pass in what they measured (the memory profile and free bytes, the model's limits).

@dataclass(frozen=True)
class LLMModelLimits:
    """What the model says: its position count (None: not known) and its EOS token ids."""

    max_model_len: int | None = None
    eos_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class LLMDeployment:
    """The effective LLM engine: the config its scheduler and runner are built with, the KV plan (None
    when no memory profile was given), and why the config differs from the ``llm:`` section."""

    config: LLMSchedulerConfig
    plan: KVPlan | None = None
    notes: tuple[str, ...] = ()

    def describe(self) -> str:
        """One line for logs and reports."""
        c = self.config
        return (f"max_num_seqs {c.max_num_seqs}, {c.max_num_batched_tokens} tokens per step, max_model_len "
                f"{c.max_model_len}, policy {c.policy}; admits at most {c.max_num_seqs + c.max_waiting_seqs} "
                f"sequences ({c.max_num_seqs} running + {c.max_waiting_seqs} waiting), request timeout "
                f"{c.request_timeout_s:g} s")


def llm_settings(spec: DeploymentSpec) -> tuple[LLMSchedulerConfig, list[str]]:
    """The ``llm:`` section with the server-wide settings applied (rules 1 and 2), and the notes."""
    c, given, server = spec.llm, spec.llm_given, spec.server
    fill: dict[str, Any] = {}
    notes: list[str] = []
    if "request_timeout_s" not in given and "request_timeout_s" in spec.server_given:
        fill["request_timeout_s"] = server.request_timeout_s
        notes.append(f"llm request timeout {server.request_timeout_s:g} s (server.request_timeout_s; set "
                     f"llm.request_timeout_s to give the LLM routes their own)")
    if "max_waiting_seqs" not in given and "max_concurrency" in spec.server_given:
        if server.max_concurrency:
            waiting = max(0, server.max_concurrency - c.max_num_seqs)
            fill["max_waiting_seqs"] = waiting
            floor = (f", not fewer than the {c.max_num_seqs} it runs (max_num_seqs)"
                     if server.max_concurrency < c.max_num_seqs else "")
            notes.append(f"llm admits at most {c.max_num_seqs + waiting} sequences (server.max_concurrency "
                         f"{server.max_concurrency}{floor}): max_waiting_seqs {waiting}; set "
                         f"llm.max_waiting_seqs to give the LLM engine its own bound")
        else:
            notes.append(f"server.max_concurrency 0 (no limit) leaves the LLM engine's bound at "
                         f"{c.max_num_seqs + c.max_waiting_seqs} sequences (max_num_seqs + max_waiting_seqs)")
    return (dataclasses.replace(c, **fill) if fill else c), notes


def resolve_llm_deployment(spec: DeploymentSpec, model: LLMModelLimits | None = None,
                           memory: MemoryProfile | None = None, free_bytes: float | None = None,
                           swap_on_device: bool = True) -> LLMDeployment:
    """The effective LLM deployment (see the module docstring for the rules). ``free_bytes``: the
    device's free memory before the model loaded (None: unknown); ``swap_on_device``: host swap space
    is the same memory as the pool (CPU). Raises ``KVPlanError`` (a ``ValueError``) with what to change."""
    model = model or LLMModelLimits()
    config, notes = llm_settings(spec)
    given = spec.llm_given
    own: dict[str, Any] = {}
    if "max_model_len" not in given and model.max_model_len:
        own["max_model_len"] = int(model.max_model_len)
    if "eos_token_ids" not in given and model.eos_token_ids:
        own["eos_token_ids"] = tuple(model.eos_token_ids)
    if own:
        config = dataclasses.replace(config, **own)
    if memory is None:
        needs = [k for k in ("kv_cache_memory", "memory_utilization", "swap_space") if getattr(config, k)]
        if needs:
            raise KVPlanError(f"{', '.join(needs)} needs a profile with a 'memory' section to be planned: "
                              f"`batchpilot profile --llm -o llm.json`, then --profile llm.json")
        return LLMDeployment(config, None, tuple(notes))
    plan = plan_kv(config, memory, free_bytes, swap_on_device=swap_on_device,
                   cap_max_model_len="max_model_len" not in given)
    if plan.max_model_len != config.max_model_len:
        notes.append(f"max_model_len lowered to {plan.max_model_len}: the KV pool holds {plan.num_kv_tokens} "
                     f"tokens, fewer than the model's {config.max_model_len} positions (set max_model_len, "
                     f"or give more KV memory)")
    return LLMDeployment(plan.resolve(config), plan, tuple(notes))
