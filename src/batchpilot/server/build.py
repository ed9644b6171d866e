"""The app ``batchpilot serve`` runs, built from its settings: each model's executor loaded (with its
padded float32 fallback where its path is another), its cost model chosen, its deployment and its
arms' resolved by ``core.deployment.resolve_deployment``, and the LLM routes behind the engine's
failover when ``--llm``.

Cost model of each model, in order: its ``--profile`` (``CostModel.load``); else a brief bounded
start-up profile of the loaded model (``models.profiler.profile_encoder``) unless
``--no-startup-profile``; else the stated default ``CostModel.default_cpu_minilm()``. The log says
which was used.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from batchpilot.core.config import SchedulerConfig
from batchpilot.core.costmodel import BatchShape, CostModel
from batchpilot.core.deployment import DeploymentSpec, ModelLimits, resolve_deployment
from batchpilot.core.rollout import RolloutSpec
from batchpilot.core.tenants import TenantTable
from batchpilot.runtime.executor import (
    CheckpointExecutor,
    EncoderPath,
    ModelExecutor,
    NoopExecutor,
    primary_of,
)
from batchpilot.server.app import MountedEngine, ServedArm, ServedModel, create_app
from batchpilot.server.config import ModelSpec, ServerConfig
from batchpilot.server.middleware import RequestLifecycle
from batchpilot.server.tenants import Tenancy, engine_usage_json

if TYPE_CHECKING:
    from batchpilot.models.encoder import ThreadPlan
    from batchpilot.runtime.llm.engine import LLMEngine
    from batchpilot.runtime.llm.failover import LLMFailover

log = logging.getLogger("batchpilot.server")


def build_app(settings: ServerConfig, spec: DeploymentSpec | SchedulerConfig | None = None,
              rollout: RolloutSpec | None = None, tenancy: Tenancy | None = None) -> RequestLifecycle:
    """Load each model's executor and cost model, resolve its deployment (``core.deployment``: the
    same function ``simulate`` runs) and its arms' (``rollout``), mount the optional LLM routes."""
    if not isinstance(spec, DeploymentSpec):
        spec = DeploymentSpec(encoder=spec or SchedulerConfig())
    served = [served_model(settings, model, spec, rollout) for model in settings.models]
    return create_app(settings, served, [mount_llm(settings, spec, rollout)] if settings.llm else [], tenancy)


def served_model(settings: ServerConfig, model: ModelSpec, spec: DeploymentSpec,
                 rollout: RolloutSpec | None) -> ServedModel:
    """One model loaded, its cost model chosen, its deployment and its arms' resolved."""
    profiled = CostModel.load(model.profile) if model.profile else None
    dtype = spec.model.dtype
    if dtype == "auto" and profiled is not None and profiled.meta.get("dtype"):
        dtype = str(profiled.meta["dtype"])  # measured by `batchpilot profile`: what it predicts
        log.info("precision: %s, chosen by the profile %s", dtype, model.profile)
    cache = str(Path(model.profile).resolve().parent) if model.profile else None  # onnx exports
    plan = profiled_threads(profiled, dtype) if profiled is not None else None
    executor = load_executor(settings, model, dtype, spec.model.min_cosine, spec.model.backend, cache, plan)
    limits = model_limits(executor)
    padding = spec.encoder.planner.padding if limits.supports_padding_free else "dynamic"
    cost_model = choose_cost_model(settings, model, executor, padding, profiled)
    deployment = resolve_deployment(spec, cost_model, limits)
    name = model.name or executor.model_name
    for note in deployment.notes:
        log.info("deployment %s: %s", name, note)
    log.info("deployment %s: %s", name, deployment.describe())
    arms = tuple(served_arm(settings, model, arm.spec, spec, executor, cost_model, limits, cache, name,
                            arm.name) for arm in (rollout.arms if rollout else ()))
    return ServedModel(executor, deployment.scheduler, cost_model, name, rollout, arms)


def served_arm(settings: ServerConfig, model: ModelSpec, arm: DeploymentSpec, primary: DeploymentSpec,
               executor: ModelExecutor, cost_model: CostModel, limits: ModelLimits, cache: str | None,
               name: str, arm_name: str) -> ServedArm:
    """A candidate arm of ``model``: the primary's executor (the same weights) unless the arm asks for
    another precision or backend, and its deployment resolved by the same function as the primary's."""
    if arm.model != primary.model:
        executor = load_executor(settings, model, arm.model.dtype, arm.model.min_cosine, arm.model.backend,
                                 cache)
        log.info("arm %s of %s: its own executor (model: %s)", arm_name, name, arm.model)
    deployment = resolve_deployment(arm, cost_model, limits)
    for note in deployment.notes:
        log.info("deployment %s arm %s: %s", name, arm_name, note)
    log.info("deployment %s arm %s: %s", name, arm_name, deployment.describe())
    return ServedArm(executor, deployment.scheduler)


def model_limits(executor: ModelExecutor) -> ModelLimits:
    """What a loaded executor allows, for ``core.deployment.resolve_deployment``."""
    return ModelLimits(int(executor.max_length), bool(executor.supports_padding_free()),
                       device_memory_bytes(executor))


def device_memory_bytes(executor: ModelExecutor) -> float:
    """The memory a batch budget is a share of: the executor's device's (``models.device.memory_bytes``),
    or this machine's for an executor without torch (the no-op model); 0 where it cannot be read."""
    model = primary_of(executor)
    if isinstance(model, CheckpointExecutor):
        from batchpilot.models.device import memory_bytes

        return memory_bytes(model.device)
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0.0


def load_executor(settings: ServerConfig, model: ModelSpec | None = None, dtype: str = "float32",
                  min_cosine: float = 0.999, backend: str = "torch", cache_dir: str | None = None,
                  thread_plan: ThreadPlan | None = None) -> ModelExecutor:
    model = model or settings.models[0]
    if settings.noop:
        log.info("model: no-op (%.1f ms per batch)", settings.noop_delay_s * 1e3)
        return NoopExecutor(dim=384, delay_s=settings.noop_delay_s, max_length=settings.max_length or 512)
    from batchpilot.models.tasks import load_model

    loaded: CheckpointExecutor = load_model(model.path, model.name, model.task, settings.max_length,
                                            settings.num_threads, dtype, min_cosine, backend, cache_dir,
                                            thread_plan)
    path = loaded if isinstance(loaded, EncoderPath) else None
    if path is not None:
        log.info("precision: %s", path.precision.describe())
        if path.threads is not None:
            log.info("threads: %s (%s)", path.threads.describe(), "--threads" if settings.num_threads else
                     "the profile's" if thread_plan is not None else "measured at start-up")
    executor = with_fallback(loaded, settings.warmup) if settings.encoder_fallback else loaded
    log.info("model: %s from %s (%s, dim %d, max %d tokens, %s forward, %d threads)", loaded.model_name,
             loaded.model_path, loaded.task, loaded.dim, loaded.max_length,
             path.forward_impl if path is not None else "hf", loaded.num_threads)
    if settings.warmup:
        executor.warmup()
    return executor


def profiled_threads(profiled: CostModel, dtype: str) -> ThreadPlan | None:
    """The thread plan ``batchpilot profile`` measured, when it profiled the precision served: its
    prices hold only for the counts it ran."""
    data = profiled.meta.get("thread_plan")
    if not data or (dtype != "auto" and profiled.meta.get("dtype", "float32") != dtype):
        return None
    from batchpilot.models.encoder import ThreadPlan

    return ThreadPlan.from_json(data)


def with_fallback(executor: ModelExecutor, warmup: bool = True) -> ModelExecutor:
    """A torch embedding executor whose path is not padded float32 (lean or padding-free forward, a lower
    precision) behind ``FallbackExecutor``, with the padded float32 path of the same checkpoint to fall
    back to; any other executor as it is."""
    from batchpilot.models.encoder import EncoderExecutor

    if type(executor) is not EncoderExecutor:
        return executor
    cfg = executor.config
    if cfg.dtype == "float32" and executor.forward_impl != "lean":
        return executor  # it is the padded float32 path already (the lean forward off or not loaded)
    from batchpilot.runtime.executor import FallbackExecutor

    plain = EncoderExecutor(dataclasses.replace(cfg, dtype="float32", lean_forward=False))
    if warmup:  # its first batch would otherwise pay the cold start in the middle of an incident
        plain.warmup()
    log.info("encoder fallback: the padded float32 path of %s stands by (--no-encoder-fallback: none)",
             executor.model_name)
    return FallbackExecutor(executor, plain)


def choose_cost_model(settings: ServerConfig, model: ModelSpec, executor: ModelExecutor,
                      padding: str = "dynamic", profiled: CostModel | None = None) -> CostModel:
    if profiled is not None:
        log.info("cost model: loaded from %s", model.profile)
        check_profile(profiled, str(model.profile), primary_of(executor))
        return profiled
    if settings.noop and settings.noop_delay_s > 0:  # its cost is exactly its delay: the limits follow it
        log.info("cost model: the no-op model's fixed %.1f ms per batch", settings.noop_delay_s * 1e3)
        return CostModel(latency_coef=(settings.noop_delay_s, 0.0, 0.0, 0.0), meta={"source": "noop"})
    if settings.startup_profile and not settings.noop:
        try:
            from batchpilot.models.profiler import profile_encoder
        except ImportError as exc:
            log.warning("cost model: start-up profiling unavailable (%s)", exc)
        else:
            log.info("cost model: no --profile; measuring a brief start-up profile "
                     "(--no-startup-profile skips it)")
            return startup_profile(profile_encoder, executor, padding)
    log.info("cost model: the built-in default (CostModel.default_cpu_minilm: MiniLM on 2 CPU cores); "
             "run `batchpilot profile` and pass --profile for this machine's numbers")
    return CostModel.default_cpu_minilm()


def check_profile(profiled: CostModel, where: str, model: object) -> None:
    """Warn when the profile measured another backend or precision than the model runs: its predictions
    (batch budgets, admission) are for another speed."""
    path = model if isinstance(model, EncoderPath) else None
    served = path.precision.chosen if path is not None else None
    backend = path.backend if path is not None else "torch"
    if profiled.meta.get("backend", "torch") != backend:
        log.warning("cost model: %s was profiled on the %s backend but the model runs on %s: profile "
                    "with --backend %s", where, profiled.meta.get("backend", "torch"), backend, backend)
    if served and profiled.meta.get("dtype", "float32") != served:
        log.warning("cost model: %s was profiled at %s but the model runs at %s: its predictions "
                    "(batch budgets, admission) are for another speed; profile at --dtype %s",
                    where, profiled.meta.get("dtype", "float32"), served, served)


STARTUP_PROFILE = {"batch_sizes": (1, 8), "lengths": (16, 128, 512), "repeats": 2, "budget_s": 15.0}


def startup_profile(profile: Callable[..., tuple[CostModel, list[object]]], executor: ModelExecutor,
                    padding: str) -> CostModel:
    """The encoder profile (`models.profiler.profile_encoder`) bounded to ~15 s, padded as served."""
    model, points = profile(executor, padding="none" if padding == "none" else "dynamic", **STARTUP_PROFILE)
    log.info("cost model: start-up profile of %d shapes; batch 1 x 128 tokens predicted %.1f ms", len(points),
             1e3 * model.latency(BatchShape.padded([128], 128)))
    return model


def mount_llm(settings: ServerConfig, spec: DeploymentSpec, rollout: RolloutSpec | None = None
              ) -> MountedEngine:
    """The LLM routes over the started engine behind its failover (``runtime/llm/failover.py``), with
    what the app owes it: its name on /v1/models, its liveness on /health, its stop when the drain times
    out (its open streams end with an SSE error event) and its shutdown hooks, in order. With ``rollout``
    candidates, each is an engine of its own over the same weights (``llm_arms``), behind its own
    failover, its ``llm:`` settings where they differ from the primary's."""
    from batchpilot.runtime.llm.build import build_failover, build_llm_arm
    from batchpilot.server.arms import LLMArms
    from batchpilot.server.llm.routes import make_llm_router

    built = llm_engine(settings, spec)
    candidates = [build_failover(build_llm_arm(built, **arm_overrides(spec, a.spec)), settings.llm_fallback,
                                 settings.llm_stall_timeout_s) for a in (rollout.arms if rollout else ())]
    engine = llm_failover(settings, built)
    arms = LLMArms([engine, *candidates], rollout) if candidates and rollout is not None else None
    stop = arms.shutdown if arms is not None else engine.shutdown
    hooks: list[Callable[[], object]] = [stop, *step_log(settings, engine)]
    log.info("llm: mounted the LLM routes (%s)", engine.model_name)
    for a in rollout.arms if arms is not None and rollout is not None else ():
        log.info("llm arm %s (share %.2f): %s", a.name, a.share,
                 arm_overrides(spec, a.spec) or "the primary's settings")

    async def stop_engine() -> None:  # its open streams end with an SSE error event
        await asyncio.get_running_loop().run_in_executor(None, stop, 5.0)

    router = functools.partial(make_llm_router, engine, limits=settings.llm_limits, arms=arms)
    engines = [engine, *candidates]

    def use_tenancy(tenancy: Tenancy) -> None:
        def apply(table: TenantTable) -> None:
            for e in engines:
                e.set_tenants(table, tenancy.label)
        apply(tenancy.table)
        tenancy.on_table.append(apply)

    return MountedEngine(router, engine.model_name, lambda: bool(engine.is_alive),
                         (arms.armed,) if arms is not None else (), tuple(hooks), (stop_engine,),
                         use_tenancy, lambda: engine_usage_json(engine))


def llm_engine(settings: ServerConfig, spec: DeploymentSpec) -> LLMEngine:
    """The started engine ``--llm-model`` and the deployment ask for, at ``--llm-dtype`` (``auto`` with an
    ``--llm-profile``: the precision that profile measured, as the encoder takes its profile's)."""
    from batchpilot.runtime.llm.build import BuildOptions, build_llm_engine, profiled_precision

    dtype, kv_dtype = settings.llm_dtype, settings.llm_kv_dtype
    if dtype == "auto" and settings.llm_profile:
        dtype, kv_dtype = profiled_precision(settings.llm_profile, kv_dtype)
        log.info("llm precision: %s (KV cache %s), as profiled in %s", dtype, kv_dtype or dtype,
                 settings.llm_profile)
    return build_llm_engine(settings.llm_model, spec=spec, options=BuildOptions(
        tokenizer_threads=settings.serving.tokenizer_workers, threads=settings.num_threads or 0,
        memory_profile=settings.llm_profile, dtype=dtype, kv_dtype=kv_dtype))


def llm_failover(settings: ServerConfig, engine: LLMEngine) -> LLMFailover:
    """``engine`` behind its watchdog and the fallback ``--llm-fallback`` asks for."""
    from batchpilot.runtime.llm.build import build_failover

    fallback, stall_s = settings.llm_fallback, settings.llm_stall_timeout_s
    failover = build_failover(engine, fallback, stall_s)
    log.info("llm: watchdog on (stall bound: %s), fallback: %s",
             "measured" if stall_s is None else f"{stall_s} s", fallback)
    return failover


def step_log(settings: ServerConfig, engine: LLMFailover) -> list[Callable[[], None]]:
    """``--llm-step-log``: every engine step logged; its close, run after the engine has stopped (no
    step writes after it)."""
    if not settings.llm_step_log:
        return []
    from batchpilot.runtime.llm.engine import StepLog

    log_file = StepLog(settings.llm_step_log)
    engine.step_observers.append(log_file)
    log.info("llm: logging every engine step to %s", settings.llm_step_log)
    return [log_file.close]


def arm_overrides(primary: DeploymentSpec, arm: DeploymentSpec) -> dict[str, object]:
    """The ``llm:`` settings of an arm that differ from the primary's."""
    return {f.name: getattr(arm.llm, f.name) for f in dataclasses.fields(arm.llm)
            if getattr(arm.llm, f.name) != getattr(primary.llm, f.name)}
