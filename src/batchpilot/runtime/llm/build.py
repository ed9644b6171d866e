"""Building LLM engines: ``build_llm_engine(model_path, spec, BuildOptions(...))`` loads the model and
tokenizer, plans the KV pool and builds the paged KV runner, scheduler and engine;
``build_llm_arm(engine)`` another engine over the same weights (a rollout arm); ``build_fallback(engine)``
the static-batching fallback on the same weights; ``build_failover(engine)`` the engine behind its
watchdog and circuit breaker, with that fallback or none. First, the engine's memory plan at start-up,
which the builders and ``batchpilot profile --llm`` use.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict, Unpack

from batchpilot.core.deployment import DeploymentSpec, LLMDeployment, LLMModelLimits, resolve_llm_deployment
from batchpilot.core.llm.config import (
    KVPlan,
    LLMPolicy,
    LLMSchedulerConfig,
    MemoryProfile,
    PreemptionMode,
    largest_gather,
)
from batchpilot.models.seeded import LLMModelConfig  # a dataclass: importing it loads no torch

if TYPE_CHECKING:  # the builders import the model side when they run: torch loads only then
    from batchpilot.models.llm.precision import LLMPrecisionReport
    from batchpilot.runtime.llm.engine import LLMEngine
    from batchpilot.runtime.llm.failover import LLMFailover
    from batchpilot.runtime.llm.fallback import StaticFallback

log = logging.getLogger("batchpilot.llm")


# -- The memory plan at start-up ----------------------------------------------------------------------
# Which ``MemoryProfile`` feeds the deployment's KV plan
# (``core.deployment.resolve_llm_deployment``, which runs ``core.llm.config.plan_kv`` on it).
#
# * a profile file from ``batchpilot profile --llm`` (its ``"memory"`` section): measured before the
#   run, checked to be of this model and precision (same KV bytes per token);
# * else, when the pool is sized from a budget (``kv_cache_memory`` / ``memory_utilization``), the
#   activation peak is measured here, on a probe runner over the same weights with a small pool
#   (``models/llm/runner.measure_memory``, a second or two);
# * else the model's tensors alone (weights and KV bytes exact, no activation term): ``num_kv_blocks``
#   is kept and only checked.
#
# The deployment's notes and plan are logged; the plan is kept on the engine (``engine.memory_plan``) for
# ``/metrics``.

PROBE_TOKENS = 4096  # the probe runner's KV pool: enough for the measured shapes, small for big models


def load_memory_profile(path: str | Path) -> MemoryProfile:
    """The ``"memory"`` section of an LLM profile file."""
    data = json.loads(Path(path).read_text())
    if "memory" not in data:
        raise ValueError(f"{path}: no 'memory' section; write the profile with `batchpilot profile --llm`")
    return MemoryProfile.from_dict(data["memory"])


def profiled_precision(path: str | Path, kv_dtype: str | None = None) -> tuple[str, str | None]:
    """The precision a ``batchpilot profile --llm`` file was measured at (its ``meta``: ``dtype`` and
    ``kv_dtype``; float32 for a profile older than the LLM precisions), ``kv_dtype`` when given."""
    meta = json.loads(Path(path).read_text()).get("meta") or {}
    return str(meta.get("dtype", "float32")), kv_dtype or meta.get("kv_dtype")


def engine_memory(weights: Any, config: LLMSchedulerConfig, device: str, dtype: Any,
                  profile: MemoryProfile | str | Path | None = None, overhead_bytes: float = 0.0,
                  kv_dtype: Any = None, packed: bool = False) -> MemoryProfile:
    """The ``MemoryProfile`` the plan is made from (the rules in the comment above); ``overhead_bytes``: what
    loading this model cost beyond its weights, measured by the builder (a profile brings its own);
    ``kv_dtype`` the cache's (None: ``dtype``), ``packed`` whether the runner packs its matrices."""
    import dataclasses

    from batchpilot.models.llm.runner import LLMModelRunner, measure_memory, weights_memory

    exact = dataclasses.replace(weights_memory(weights, dtype, kv_dtype, packed),
                                overhead_bytes=overhead_bytes)
    if profile is not None:
        mem = profile if isinstance(profile, MemoryProfile) else load_memory_profile(profile)
        if mem.kv_bytes_per_token != exact.kv_bytes_per_token:
                raise ValueError(f"the memory profile has {mem.kv_bytes_per_token} KV bytes per token, this "
                                 f"model with a {kv_dtype or dtype} KV cache has {exact.kv_bytes_per_token}: "
                                 f"it was profiled for "
                                 f"another model or precision; profile this one with "
                                 f"`batchpilot profile --llm`")
        return mem
    if config.kv_cache_memory is None and config.memory_utilization is None:
        return exact
    probe = LLMModelRunner(weights, max(1, PROBE_TOKENS // config.block_size), config.block_size,
                           device=device, dtype=dtype, kv_dtype=kv_dtype, packed=packed)
    mem, _ = measure_memory(probe)
    del probe
    log.info("llm memory: measured the activation peak at start-up: %.0f B + %.0f B per batched token "
             "+ %.0f B per gathered context token", mem.activation_fixed_bytes,
             mem.activation_bytes_per_token, mem.activation_bytes_per_read_token)
    return dataclasses.replace(mem, overhead_bytes=overhead_bytes)


def plan_engine_memory(weights: Any, spec: DeploymentSpec, model: LLMModelLimits, device: str, dtype: Any,
                       free_bytes: float | None, profile: MemoryProfile | str | Path | None = None,
                       overhead_bytes: float = 0.0, kv_dtype: Any = None,
                       packed: bool = False) -> tuple[LLMDeployment, MemoryProfile]:
    """The engine's deployment (``core.deployment.resolve_llm_deployment`` on this memory), logged;
    raises ``core.llm.config.KVPlanError`` with what to change."""
    mem = engine_memory(weights, spec.llm, device, dtype, profile, overhead_bytes, kv_dtype, packed)
    dep = resolve_llm_deployment(spec, model, mem, free_bytes, swap_on_device=str(device).startswith("cpu"))
    for note in dep.notes:
        log.info("llm deployment: %s", note)
    log.info("llm deployment: %s", dep.describe())
    if dep.plan is not None:  # always: a memory profile was given
        log.info("llm memory: %s", dep.plan.describe())
    return dep, mem


def profile_engine_memory(engine: Any, burst_seqs: int = 32, burst_prompt: int = 128,
                          burst_output: int = 16) -> tuple[MemoryProfile, list[dict[str, float]]]:
    """What ``batchpilot profile --llm`` records of a built (not started) engine, in this order, each
    before the next leaves pages of its own resident:

    1. the built engine's overhead beyond weights and KV (``runtime.llm.build.built_overhead``);
    2. a burst of ``burst_seqs`` requests (token-id prompts, greedy, EOS ignored) through the started
       engine: on CPU, what it leaves resident beyond the activation peak the plan counts for such a
       burst (the engine thread's arena, the requests' Python state) joins the overhead;
    3. the activation terms (``models/llm/runner.measure_memory``) on its runner.

    The engine is shut down at the end; its runner stays usable (the step profile runs on it next)."""
    import asyncio
    import dataclasses

    from batchpilot.core.llm.scheduler import decode_groups
    from batchpilot.core.llm.sequence import SamplingParams
    from batchpilot.models.device import used_memory_bytes
    from batchpilot.models.llm.runner import measure_memory

    overhead = built_overhead(engine)
    device = engine.runner.device
    params = SamplingParams(max_tokens=burst_output, temperature=0.0, ignore_eos=True)

    async def burst() -> None:
        async def one(i: int) -> None:
            async for _ in engine.generate([7 + (i * 31 + j) % 256 for j in range(burst_prompt)], params):
                pass
        await asyncio.gather(*(one(i) for i in range(burst_seqs)))

    before = used_memory_bytes(device)
    engine.start()
    try:
        asyncio.run(burst())
    finally:
        engine.shutdown()
    grown = used_memory_bytes(device) - before
    memory, points = measure_memory(engine.runner)
    if device.type == "cpu":
        ctx = [burst_prompt + burst_output] * burst_seqs
        runs = decode_groups(ctx, engine.config.decode_run_tokens)
        group = max(b - a for a, b in runs)  # the largest gather, as the plan counts
        burst_activation = memory.activation_bytes(engine.config.max_num_batched_tokens, group * ctx[0])
        overhead += max(0.0, grown - burst_activation)
    return dataclasses.replace(memory, overhead_bytes=overhead), points


# -- The builders ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class BuildOptions:
    """How and where ``build_llm_engine`` builds an engine; what the engine schedules is the
    deployment's ``llm:`` section (its ``spec``), not these."""

    device: str = "cpu"  # "cpu", "cuda", "cuda:1"
    # weights and activations: float32 | bfloat16 | float16 | auto (the fastest that passes the guard,
    # measured at build: ``models/llm/precision.py``); a precision below float32 is checked by the guard
    dtype: str = "float32"
    kv_dtype: str | None = None  # the KV cache's: float32 | bfloat16 | float16 (None: ``dtype``'s)
    packed: bool | None = None  # dense matrices packed for oneDNN (``models/llm/dense.py``); None: measured
    model_name: str | None = None  # what clients send (None: the model folder, else batchpilot-tiny-llama)
    start: bool = True  # start the engine thread (False: built, for measuring its runner)
    sampler_seed: int = 0
    threads: int = 0  # torch intra-op threads of every thread that runs the model; 0 = every core allowed
    tokenizer_threads: int = 0  # the prompt tokenising pool; 0 = one per core
    # an LLM profile file (``batchpilot profile --llm``) or ``MemoryProfile`` the KV pool is planned from
    # (None: measured at start-up)
    memory_profile: MemoryProfile | str | Path | None = None
    # pad a step's token rows to the counts its matmuls run fastest at, measured at start-up
    # (``models/llm/runner.py``)
    plan_rows: bool = True
    model: LLMModelConfig = LLMModelConfig()  # the random default model's shape (no model folder given)


class BuildKeys(TypedDict, total=False):
    """``build_llm_engine``'s keyword form, typed: a ``BuildOptions`` field, an ``LLMModelConfig`` field
    (the random default model) or an ``LLMSchedulerConfig`` field (set on top of the spec's ``llm:``
    section, as given). The defaults are the dataclasses'; the assertion below keeps the keys theirs."""

    device: str
    dtype: str
    kv_dtype: str | None
    packed: bool | None
    model_name: str | None
    start: bool
    sampler_seed: int
    threads: int
    tokenizer_threads: int
    memory_profile: MemoryProfile | str | Path | None
    plan_rows: bool
    model: LLMModelConfig
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int
    rope_theta: float
    rms_norm_eps: float
    initializer_range: float
    seed: int
    max_num_seqs: int
    max_num_batched_tokens: int
    num_kv_blocks: int
    block_size: int
    max_model_len: int
    policy: LLMPolicy
    enable_chunked_prefill: bool
    enable_prefix_caching: bool
    eos_token_ids: tuple[int, ...]
    max_waiting_seqs: int
    request_timeout_s: float
    max_priority_wait_s: float
    fair_burst_tokens: int
    kv_cache_memory: int | None
    memory_utilization: float | None
    preemption: PreemptionMode
    swap_space: int | None
    num_swap_blocks: int
    decode_run_tokens: int


_OPTION_FIELDS = frozenset(f.name for f in dataclasses.fields(BuildOptions))
_MODEL_FIELDS = frozenset(f.name for f in dataclasses.fields(LLMModelConfig))
_SCHED_FIELDS = frozenset(f.name for f in dataclasses.fields(LLMSchedulerConfig))
assert set(BuildKeys.__annotations__) == _OPTION_FIELDS | _MODEL_FIELDS | _SCHED_FIELDS, \
    "BuildKeys names every BuildOptions, LLMModelConfig and LLMSchedulerConfig field"


def build_llm_engine(model_path: str | None = None, spec: DeploymentSpec | None = None,
                     options: BuildOptions | None = None, **keys: Unpack[BuildKeys]) -> LLMEngine:
    """Model, tokenizer, paged KV runner and scheduler, started (unless ``options.start`` is False)
    and ready for ``generate``.

    ``spec``: the deployment whose ``llm:`` section (and server-wide settings) the engine runs, as
    ``serve --llm`` resolves it (``core.deployment.resolve_llm_deployment``: request timeout,
    admission bound, the model's length and EOS, the KV plan). ``options``: how and where it is built
    (``BuildOptions``). ``keys``: the same, typed (``BuildKeys``), for short call sites such as tests:
    ``BuildOptions`` fields replace ``options``', ``LLMModelConfig`` fields shape the random default
    model, ``LLMSchedulerConfig`` fields are set on top of ``spec``'s ``llm:`` section.

    The KV pool is sized by ``core.llm.config.plan_kv`` (``kv_cache_memory``, ``memory_utilization`` of the
    free memory read before the model loads, or ``num_kv_blocks``) and checked there; a pool too small
    for the model's positions lowers ``max_model_len`` when it was not given, and is an error when it
    was (``KVPlanError`` says what to change). ``engine.deployment`` keeps the resolved deployment.
    """
    import torch

    from batchpilot.models.device import configure_threads, free_memory_bytes, used_memory_bytes
    from batchpilot.models.llm.runner import LLMModelRunner
    from batchpilot.models.llm.sampler import Sampler
    from batchpilot.models.llm.tokenizer import load_tokenizer
    from batchpilot.models.llm.weights import LlamaWeights, load_hf_llama
    from batchpilot.runtime.llm.engine import LLMEngine

    o, spec = build_options(options, spec, dict(keys))
    device, threads, model_cfg = o.device, o.threads, o.model

    if device == "cpu" or threads:  # 1 is steadier than every core when other jobs share them; set
        # here for the start-up measurements (row plan, preemption costs) and again by each thread that
        # runs the model (the runner's ``threads``, ``models.device.bind_threads``)
        configure_threads(threads or None)
    if device == "cpu":
        from batchpilot.models.llm.runner import keep_freed_memory

        keep_freed_memory()
    precision = engine_precision(model_path, o)  # may load a float32 copy for the guard, freed again
    dtype, kv_dtype = getattr(torch, precision.chosen), getattr(torch, precision.kv_dtype)
    free_bytes = free_memory_bytes(device)  # before the model loads: the plan's budget is a share of it
    held_before = used_memory_bytes(device)
    hf = load_hf_llama(model_path, model_cfg, dtype=dtype)
    weights = LlamaWeights.from_hf(hf)
    tokenizer = load_tokenizer(model_path, model_cfg.vocab_size)
    eos = set(weights.eos_token_ids)
    if tokenizer.eos_token_id is not None:
        eos.add(int(tokenizer.eos_token_id))
    from batchpilot.models.llm.runner import weights_memory

    # on CPU the process's growth while loading, beyond the weights, is memory the plan must leave room for
    overhead = 0.0 if device.startswith("cuda") else max(
        0.0, used_memory_bytes(device) - held_before - weights_memory(weights, dtype).weights_bytes)
    packed = engine_packing(weights, o, precision, device, dtype)
    limits = LLMModelLimits(weights.max_position_embeddings, tuple(sorted(eos)))
    deployment, memory = plan_engine_memory(weights, spec, limits, device, dtype, free_bytes,
                                            o.memory_profile, overhead, kv_dtype, packed)
    config, plan = deployment.config, deployment.plan
    assert plan is not None  # planned from a memory profile
    runner = LLMModelRunner(weights, config.num_kv_blocks, config.block_size, device=device, dtype=dtype,
                            num_swap_blocks=config.num_swap_blocks, kv_dtype=kv_dtype, packed=packed,
                            decode_run_tokens=config.decode_run_tokens)
    runner.precision = precision
    runner.max_gather_tokens = largest_gather(config)  # what core.llm.config reserves
    runner.threads = threads or None
    if o.plan_rows:
        log.info("llm rows: token rows padded (rows: padded to) %s", runner.plan_rows().padded() or "none")
    name = o.model_name or model_path or "batchpilot-tiny-llama"
    engine = LLMEngine(runner, tokenizer, config, model_name=name, sampler=Sampler(o.sampler_seed),
                       tokenizer_threads=o.tokenizer_threads)
    engine.memory_plan, engine.memory_profile = plan, memory
    engine.deployment = deployment
    # the fallback engine's model (runtime/llm/fallback.py): the HF module over the runner's tensors
    engine.hf_model = share_runner_weights(hf, runner.w)
    engine.memory_held_before = held_before
    check_built_overhead(engine, plan)
    return engine.start() if o.start else engine


def engine_precision(model_path: str | None, o: BuildOptions) -> LLMPrecisionReport:
    """The precision the engine serves at (``models/llm/precision.choose_llm_precision``), logged. Float32
    asked for is taken as is; otherwise the model is loaded once in float32 for the guard (and, for
    ``auto``, the timing), and every probe tensor is freed and handed back to the OS before the engine's
    own model loads (the memory plan then measures that load alone)."""
    import gc

    import torch

    from batchpilot.models.llm.precision import choose_llm_precision
    from batchpilot.models.llm.runner import release_freed_memory
    from batchpilot.models.llm.weights import LlamaWeights, load_hf_llama

    def weights() -> Any:
        return LlamaWeights.from_hf(load_hf_llama(model_path, o.model, dtype=torch.float32))

    report = choose_llm_precision(weights, o.dtype, torch.device(o.device), o.kv_dtype)
    gc.collect()
    release_freed_memory()
    log.info("llm precision: %s", report.describe())
    return report


def engine_packing(weights: Any, o: BuildOptions, precision: LLMPrecisionReport, device: str,
                   dtype: Any) -> bool:
    """Whether the runner multiplies by packed matrices: ``o.packed`` when set, else what the precision
    probe measured for the precision served, else measured here (``models/llm/dense.packing_pays``)."""
    if o.packed is not None:
        return o.packed
    report = precision.packing_report
    if report is None:
        import torch

        from batchpilot.models.llm.dense import packing_pays

        report = packing_pays(weights.dense_matrices(), torch.device(device), dtype)
        log.info("llm dense: %s", report.describe())
    return report.packed


def build_options(options: BuildOptions | None, spec: DeploymentSpec | None,
                  keys: dict[str, Any]) -> tuple[BuildOptions, DeploymentSpec]:
    """``options`` and ``spec`` with ``build_llm_engine``'s keyword form applied (``BuildKeys``); an
    unknown key is an error (for callers mypy does not check)."""
    unknown = sorted(set(keys) - _OPTION_FIELDS - _MODEL_FIELDS - _SCHED_FIELDS)
    if unknown:
        raise ValueError(f"build_llm_engine: unknown option(s) {unknown}; the keys are BuildKeys'")
    o = options or BuildOptions()
    given = {k: v for k, v in keys.items() if k in _OPTION_FIELDS}
    shape = {k: v for k, v in keys.items() if k in _MODEL_FIELDS}
    if shape:
        given["model"] = dataclasses.replace(given.get("model", o.model), **shape)
    if given:
        o = dataclasses.replace(o, **given)
    sched = {k: v for k, v in keys.items() if k in _SCHED_FIELDS}
    spec = spec or DeploymentSpec()
    if sched:
        spec = spec.replace(llm=dataclasses.replace(spec.llm, **sched), llm_given=frozenset(sched))
    return o, spec


def check_built_overhead(engine: LLMEngine, plan: KVPlan) -> None:
    """Log what the built engine holds beyond its weights and KV pool (``built_overhead``) against what
    the plan left for it; warn when a budgeted plan left too little (the pool may not fit)."""
    built = built_overhead(engine)
    log.info("llm memory: built, the engine holds %.1f MiB beyond its weights and KV pool (the plan left "
             "%.1f MiB)", built / (1 << 20), plan.overhead_bytes / (1 << 20))
    if plan.source != "num_kv_blocks" and built > plan.overhead_bytes + (16 << 20):
        log.warning("llm memory: the built engine holds %.1f MiB beyond its weights and KV pool, the plan "
                    "left %.1f MiB for it; profile with `batchpilot profile --llm` and serve with "
                    "--llm-profile to plan with the built figure", built / (1 << 20),
                    plan.overhead_bytes / (1 << 20))


def built_overhead(engine: LLMEngine) -> float:
    """CPU: what the built engine's process holds beyond its weights and KV pool, measured from before
    its model loaded (the tokenizer, the loader's kept pages, the runner's tables, the engine's pool);
    ``batchpilot profile --llm`` records it as the profile's overhead. 0 on CUDA."""
    from batchpilot.models.device import used_memory_bytes

    r = engine.runner
    if r.device.type != "cpu":
        return 0.0
    plan = engine.memory_plan
    if plan is None:
        raise ValueError("this engine has no memory plan; build it with build_llm_engine")
    held = used_memory_bytes(r.device) - engine.memory_held_before
    return float(max(0.0, held - plan.weights_bytes - r.kv_cache_bytes))


def build_llm_arm(engine: LLMEngine, start: bool = True, sampler_seed: int = 0,
                  **scheduler: Any) -> LLMEngine:
    """Another engine over ``engine``'s weights, tokenizer and HF module (no copy): ``engine``'s
    scheduler config with the ``scheduler`` fields replaced, its own paged KV cache and thread (an arm
    of ``server/arms.py``)."""
    from batchpilot.models.llm.runner import LLMModelRunner
    from batchpilot.models.llm.sampler import Sampler
    from batchpilot.runtime.llm.engine import LLMEngine

    unknown = sorted(set(scheduler) - _SCHED_FIELDS)
    if unknown:
        raise ValueError(f"build_llm_arm: unknown scheduler option(s) {unknown}")
    from batchpilot.core.llm.config import plan_kv
    from batchpilot.models.device import free_memory_bytes

    config = dataclasses.replace(engine.config, **scheduler)
    r = engine.runner
    # the arm's own pool, planned against what is free now; the weights are the primary's (no copy)
    from batchpilot.models.llm.runner import model_memory

    memory = getattr(engine, "memory_profile", None) or model_memory(r)
    budget = config.kv_cache_memory is not None or config.memory_utilization is not None
    if memory.source == "none" and budget:
        memory = engine_memory(r.w, config, str(r.device), r.dtype, kv_dtype=r.kv_dtype,
                               packed=r.packed)  # a budget: measure the activation
    # the weights are the primary's and so is the loading overhead: the arm adds its pool and activation
    memory = dataclasses.replace(memory, weights_bytes=0, overhead_bytes=0.0)
    plan = plan_kv(config, memory, free_memory_bytes(r.device), swap_on_device=r.device.type == "cpu")
    config = plan.resolve(config)
    runner = LLMModelRunner(r.w, config.num_kv_blocks, config.block_size, device=str(r.device), dtype=r.dtype,
                            num_swap_blocks=config.num_swap_blocks, kv_dtype=r.kv_dtype,
                            decode_run_tokens=config.decode_run_tokens)
    runner.share_dense(r)  # the primary's packed matrices, not a copy of them
    runner.max_gather_tokens = largest_gather(config)  # what core.llm.config reserves
    runner.threads = r.threads  # an arm runs as the primary does
    runner.precision = r.precision
    runner.row_plan = r.row_plan  # the same weights and device: the primary's measured plan
    arm = LLMEngine(runner, engine.tokenizer, config, model_name=engine.model_name,
                    sampler=Sampler(sampler_seed), tokenizer_threads=1)  # the routes tokenise on engine's
    arm.hf_model = getattr(engine, "hf_model", None)
    arm.memory_plan, arm.memory_profile = plan, memory
    return arm.start() if start else arm


def share_runner_weights(model: Any, weights: Any) -> Any:
    """Point the HF model's parameters at the runner's (fused, device-resident) tensors: views, no copy."""
    import torch

    from batchpilot.models.llm.weights import decoder_of

    H, KV, hd = weights.num_heads, weights.num_kv_heads, weights.head_dim
    decoder, _ = decoder_of(model)
    with torch.no_grad():
        for layer, w in zip(decoder.layers, weights.layers, strict=True):
            a, m = layer.self_attn, layer.mlp
            if hasattr(a, "qkv_proj"):  # a family that stores them fused (weights.FAMILIES)
                a.qkv_proj.weight.data, m.gate_up_proj.weight.data = w.qkv, w.gate_up
            else:
                q, k, v = w.qkv[: H * hd], w.qkv[H * hd : (H + KV) * hd], w.qkv[(H + KV) * hd :]
                a.q_proj.weight.data, a.k_proj.weight.data, a.v_proj.weight.data = q, k, v
                inter = w.gate_up.shape[0] // 2
                m.gate_proj.weight.data, m.up_proj.weight.data = w.gate_up[:inter], w.gate_up[inter:]
            if w.qkv_bias is not None:
                b = w.qkv_bias
                a.q_proj.bias.data, a.k_proj.bias.data = b[: H * hd], b[H * hd : (H + KV) * hd]
                a.v_proj.bias.data = b[(H + KV) * hd :]
            if w.q_norm is not None and w.k_norm is not None:
                a.q_norm.weight.data, a.k_norm.weight.data = w.q_norm, w.k_norm
            a.o_proj.weight.data = w.o
            m.down_proj.weight.data = w.down
            for name, role in weights.spec.norms:  # the family's norms (weights.DecoderSpec.norms)
                getattr(layer, name).weight.data = getattr(w, role)
        decoder.embed_tokens.weight.data = weights.embed
        decoder.norm.weight.data = weights.norm
        model.lm_head.weight.data = weights.lm_head
    return model.to(weights.embed.device).eval()  # the rest (RoPE buffers) follows the weights


def build_fallback(engine: LLMEngine, max_batch_size: int = 8, sampler_seed: int = 0) -> StaticFallback:
    """The static-batching fallback of an engine ``build_llm_engine`` made, on the same weights (started)."""
    from batchpilot.models.llm.sampler import Sampler
    from batchpilot.runtime.llm.fallback import StaticFallback

    model = getattr(engine, "hf_model", None)
    if model is None:
        raise ValueError("this engine keeps no HF model to fall back on; build it with build_llm_engine")
    if getattr(model.model, "language_model", None) is not None:  # weights.decoder_of: a multimodal model
        raise ValueError(f"llm fallback static: a multimodal checkpoint ({model.config.model_type}) has no "
                         "static fallback; serve it with --llm-fallback off")
    fallback = StaticFallback(model, engine.tokenizer, engine.config, engine.model_name, max_batch_size,
                              Sampler(sampler_seed))
    fallback.threads = getattr(engine.runner, "threads", None)
    return fallback.start()


FALLBACKS = ("static", "off")


def build_failover(engine: LLMEngine, fallback: str = "static", stall_timeout_s: float | None = None,
                   fallback_batch_size: int = 8) -> LLMFailover:
    """The engine behind its watchdog and circuit breaker (``runtime/llm/failover.py``), with the static
    fallback on its weights (``fallback="static"``) or none (``"off"``: 503 while it is failed).
    ``stall_timeout_s``: a fixed stall bound; None measures it from the engine's step times."""
    from batchpilot.core.stall import StallRule
    from batchpilot.runtime.llm.failover import LLMFailover

    if fallback not in FALLBACKS:
        raise ValueError(f"llm fallback {fallback!r}: choose one of {', '.join(FALLBACKS)}")
    seed = int(getattr(engine.sampler, "base_seed", 0))
    backup = build_fallback(engine, fallback_batch_size, seed) if fallback == "static" else None
    return LLMFailover(engine, backup, StallRule(timeout_s=stall_timeout_s))
