"""The app ``batchpilot serve`` runs, built from its settings: each model's executor loaded (with its
padded float32 fallback where its path is another), its cost model chosen, its deployment and its
arms' resolved by ``core.deployment.resolve_deployment``, and the LLM routes behind the engine's
failover when ``--llm``.

Cost model of each model, in order: its ``--profile`` (``CostModel.load``); else a brief bounded
start-up profile of the loaded model (``profile.encoder.profile_encoder``) unless
``--no-startup-profile``; else the stated default ``CostModel.default_cpu_minilm()``. The log says
which was used.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from batchpilot.core.config import SchedulerConfig
from batchpilot.core.costmodel import BatchShape, CostModel
from batchpilot.core.deployment import DeploymentSpec, ModelLimits, resolve_deployment
from batchpilot.core.rollout import RolloutSpec
from batchpilot.server.config import ModelSpec, ServerConfig

log = logging.getLogger("batchpilot.server")


def build_app(settings: ServerConfig, spec: DeploymentSpec | SchedulerConfig | None = None,
              rollout: RolloutSpec | None = None) -> Any:
    """Load each model's executor and cost model, resolve its deployment (``core.deployment``: the
    same function ``simulate`` runs) and its arms' (``rollout``), mount the optional LLM routes."""
    from batchpilot.server.app import ServedModel, create_app

    if not isinstance(spec, DeploymentSpec):
        spec = DeploymentSpec(encoder=spec or SchedulerConfig())
    served = []
    for model in settings.models:
        profiled = CostModel.load(model.profile) if model.profile else None
        dtype = spec.model.dtype
        if dtype == "auto" and profiled is not None and profiled.meta.get("dtype"):
            dtype = str(profiled.meta["dtype"])  # measured by `batchpilot profile`: what it predicts
            log.info("precision: %s, chosen by the profile %s", dtype, model.profile)
        cache = str(Path(model.profile).resolve().parent) if model.profile else None  # onnx exports
        plan = profiled_threads(profiled, dtype) if profiled is not None else None
        executor = load_executor(settings, model, dtype, spec.model.min_cosine, spec.model.backend, cache,
                                 plan)
        limits = model_limits(executor)
        padding = spec.encoder.planner.padding if limits.supports_padding_free else "dynamic"
        cost_model = choose_cost_model(settings, model, executor, padding, profiled)
        deployment = resolve_deployment(spec, cost_model, limits)
        name = model.name or getattr(executor, "model_name", "model")
        for note in deployment.notes:
            log.info("deployment %s: %s", name, note)
        log.info("deployment %s: %s", name, deployment.describe())
        arms = tuple(served_arm(settings, model, arm.spec, spec, executor, cost_model, limits, cache, name,
                                arm.name) for arm in (rollout.arms if rollout else ()))
        served.append(ServedModel(executor, deployment.scheduler, cost_model, name, rollout, arms))
    if not settings.llm:
        return create_app(settings, models=served)
    engine, router, hooks = _llm_router(settings, spec, rollout)
    app = create_app(settings, models=served, routers=[router], extra_models=[engine.model_name],
                     on_shutdown=hooks, health_checks=[lambda: bool(engine.is_alive)],
                     extra_arms=router.armed)
    stop_all = hooks[0]  # the engine's shutdown, or every arm's

    async def stop_engine() -> None:  # its open streams end with an SSE error event
        await asyncio.get_running_loop().run_in_executor(None, stop_all, 5.0)

    app.state.drain_timeout_hooks.append(stop_engine)
    return app


def served_arm(settings: ServerConfig, model: ModelSpec, arm: DeploymentSpec, primary: DeploymentSpec,
               executor: Any, cost_model: CostModel, limits: ModelLimits, cache: str | None, name: str,
               arm_name: str) -> Any:
    """A candidate arm of ``model``: the primary's executor (the same weights) unless the arm asks for
    another precision or backend, and its deployment resolved by the same function as the primary's."""
    from batchpilot.server.app import ServedArm

    if arm.model != primary.model:
        executor = load_executor(settings, model, arm.model.dtype, arm.model.min_cosine, arm.model.backend,
                                 cache)
        log.info("arm %s of %s: its own executor (model: %s)", arm_name, name, arm.model)
    deployment = resolve_deployment(arm, cost_model, limits)
    for note in deployment.notes:
        log.info("deployment %s arm %s: %s", name, arm_name, note)
    log.info("deployment %s arm %s: %s", name, arm_name, deployment.describe())
    return ServedArm(executor, deployment.scheduler)


def model_limits(executor: Any) -> ModelLimits:
    """What a loaded executor allows, for ``core.deployment.resolve_deployment``."""
    supports = getattr(executor, "supports_padding_free", lambda: True)()
    return ModelLimits(int(executor.max_length), bool(supports), device_memory_bytes(executor))


def device_memory_bytes(executor: Any) -> float:
    """The memory a batch budget is a share of: the executor's device's (``models.device.memory_bytes``),
    or this machine's for an executor without torch (the no-op model); 0 where it cannot be read."""
    device = getattr(executor, "device", None)
    if device is not None:
        from batchpilot.models.device import memory_bytes

        return memory_bytes(device)
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0.0


def load_executor(settings: ServerConfig, model: ModelSpec | None = None, dtype: str = "float32",
                  min_cosine: float = 0.999, backend: str = "torch", cache_dir: str | None = None,
                  thread_plan: Any = None) -> Any:
    model = model or settings.models[0]
    if settings.noop:
        from batchpilot.runtime.executor import NoopExecutor

        log.info("model: no-op (%.1f ms per batch)", settings.noop_delay_s * 1e3)
        return NoopExecutor(dim=384, delay_s=settings.noop_delay_s, max_length=settings.max_length or 512)
    from batchpilot.models.tasks import load_model

    executor = load_model(model.path, model.name, model.task, settings.max_length, settings.num_threads,
                          dtype, min_cosine, backend, cache_dir, thread_plan)
    report = getattr(executor, "precision", None)
    if report is not None:
        log.info("precision: %s", report.describe())
    threads = getattr(executor, "threads", None)
    if threads is not None:
        log.info("threads: %s (%s)", threads.describe(), "--threads" if settings.num_threads else
                 "the profile's" if thread_plan is not None else "measured at start-up")
    if settings.encoder_fallback:
        executor = with_fallback(executor, settings.warmup)
    log.info("model: %s from %s (%s, dim %d, max %d tokens, %s forward, %d threads)", executor.model_name,
             executor.model_path, executor.task, executor.dim, executor.max_length,
             getattr(executor, "forward_impl", "hf"), executor.num_threads)
    if settings.warmup:
        executor.warmup()
    return executor


def profiled_threads(profiled: CostModel, dtype: str) -> Any:
    """The thread plan ``batchpilot profile`` measured, when it profiled the precision served: its
    prices hold only for the counts it ran."""
    data = profiled.meta.get("thread_plan")
    if not data or (dtype != "auto" and profiled.meta.get("dtype", "float32") != dtype):
        return None
    from batchpilot.models.encoder import ThreadPlan

    return ThreadPlan.from_json(data)


def with_fallback(executor: Any, warmup: bool = True) -> Any:
    """A torch embedding executor whose path is not padded float32 (lean or padding-free forward, a lower
    precision) behind ``FallbackExecutor``, with the padded float32 path of the same checkpoint to fall
    back to; any other executor as it is."""
    from batchpilot.models.encoder import EncoderExecutor

    if type(executor) is not EncoderExecutor:
        return executor
    cfg = executor.config
    if cfg.dtype == "float32" and getattr(executor, "forward_impl", "hf") != "lean":
        return executor  # it is the padded float32 path already (the lean forward off or not loaded)
    from batchpilot.runtime.executor import FallbackExecutor

    plain = EncoderExecutor(dataclasses.replace(cfg, dtype="float32", lean_forward=False))
    if warmup:  # its first batch would otherwise pay the cold start in the middle of an incident
        plain.warmup()
    log.info("encoder fallback: the padded float32 path of %s stands by (--no-encoder-fallback: none)",
             executor.model_name)
    return FallbackExecutor(executor, plain)


def choose_cost_model(settings: ServerConfig, model: ModelSpec, executor: Any,
                      padding: str = "dynamic", profiled: CostModel | None = None) -> CostModel:
    if profiled is not None:
        log.info("cost model: loaded from %s", model.profile)
        served = getattr(getattr(executor, "precision", None), "chosen", None)
        backend = getattr(executor, "backend", "torch")
        if profiled.meta.get("backend", "torch") != backend:
            log.warning("cost model: %s was profiled on the %s backend but the model runs on %s: profile "
                        "with --backend %s", model.profile, profiled.meta.get("backend", "torch"), backend,
                        backend)
        if served and profiled.meta.get("dtype", "float32") != served:
            log.warning("cost model: %s was profiled at %s but the model runs at %s: its predictions "
                        "(batch budgets, admission) are for another speed; profile at --dtype %s",
                        model.profile, profiled.meta.get("dtype", "float32"), served, served)
        return profiled
    if settings.noop and settings.noop_delay_s > 0:  # its cost is exactly its delay: the limits follow it
        log.info("cost model: the no-op model's fixed %.1f ms per batch", settings.noop_delay_s * 1e3)
        return CostModel(latency_coef=(settings.noop_delay_s, 0.0, 0.0, 0.0), meta={"source": "noop"})
    if settings.startup_profile and not settings.noop:
        try:
            from batchpilot.profile.encoder import profile_encoder
        except ImportError as exc:
            log.warning("cost model: start-up profiling unavailable (%s)", exc)
        else:
            log.info("cost model: no --profile; measuring a brief start-up profile "
                     "(--no-startup-profile skips it)")
            return startup_profile(profile_encoder, executor, padding)
    log.info("cost model: the built-in default (CostModel.default_cpu_minilm: MiniLM on 2 CPU cores); "
             "run `batchpilot profile` and pass --profile for this machine's numbers")
    return CostModel.default_cpu_minilm()


STARTUP_PROFILE = {"batch_sizes": (1, 8), "lengths": (16, 128, 512), "repeats": 2, "budget_s": 15.0}


def startup_profile(profile_encoder: Any, executor: Any, padding: str) -> CostModel:
    """The encoder profile (`profile.encoder.profile_encoder`) bounded to ~15 s, padded as served."""
    model, points = profile_encoder(executor, padding="none" if padding == "none" else "dynamic",
                                    **STARTUP_PROFILE)
    log.info("cost model: start-up profile of %d shapes; batch 1 x 128 tokens predicted %.1f ms", len(points),
             1e3 * model.latency(BatchShape.padded([128], 128)))
    return model


def _llm_router(settings: ServerConfig, spec: DeploymentSpec, rollout: RolloutSpec | None = None
                ) -> tuple[Any, Any, list[Callable[[], Any]]]:
    """The started engine behind its failover (``runtime/llm/failover.py``), a factory the app calls with
    its registry (``make_llm_router``), and what to run at shutdown, in order. With ``rollout``
    candidates, each is an engine of its own over the same weights (``llm_arms``), behind its own
    failover, its ``llm:`` settings where they differ from the primary's."""
    from batchpilot.runtime.llm.build import build_llm_engine as build
    extra = {"memory_profile": settings.llm_profile} if settings.llm_profile else {}
    engine = build(settings.llm_model, spec=spec, tokenizer_threads=settings.tokenizer_workers or 0,
                   threads=settings.num_threads or 0, **extra)
    from batchpilot.runtime.llm.build import build_failover, build_llm_arm

    fallback, stall_s = settings.llm_fallback, settings.llm_stall_timeout_s
    candidates = [build_failover(build_llm_arm(engine, **arm_overrides(spec, a.spec)), fallback, stall_s)
                  for a in (rollout.arms if rollout else ())]
    engine = build_failover(engine, fallback, stall_s)
    log.info("llm: watchdog on (stall bound: %s), fallback: %s",
             "measured" if stall_s is None else f"{stall_s} s", fallback)
    hooks: list[Callable[[], Any]] = [engine.shutdown]
    if settings.llm_step_log:
        from batchpilot.runtime.llm.engine import StepLog

        step_log = StepLog(settings.llm_step_log)
        engine.step_observers.append(step_log)
        hooks.append(step_log.close)  # after the engine has stopped: no step writes after it
        log.info("llm: logging every engine step to %s", settings.llm_step_log)
    log.info("llm: mounted the LLM routes (%s)", getattr(engine, "model_name", settings.llm_model))
    if not candidates:
        return engine, LLMRouter(engine, limits=settings.llm_limits), hooks
    from batchpilot.server.arms import LLMArms

    assert rollout is not None
    arms = LLMArms([engine, *candidates], rollout)
    for a in rollout.arms:
        log.info("llm arm %s (share %.2f): %s", a.name, a.share,
                 arm_overrides(spec, a.spec) or "the primary's settings")
    hooks[:1] = [arms.shutdown]
    return engine, LLMRouter(engine, arms, settings.llm_limits), hooks


class LLMRouter:
    """What the app calls with its registry to mount the LLM routes (``make_llm_router``, with the
    request-size ``limits``, default ``LLMLimits()``); ``armed``, the LLM's arms for ``/v1/arms`` and
    ``/health``, when it has candidates."""

    def __init__(self, engine: Any, arms: Any | None = None, limits: Any | None = None) -> None:
        self.engine, self.arms, self.limits = engine, arms, limits
        self.armed = [arms.armed] if arms is not None else []

    def __call__(self, registry: Any) -> Any:
        from batchpilot.server.llm.routes import make_llm_router

        return make_llm_router(self.engine, registry, limits=self.limits, arms=self.arms)


def arm_overrides(primary: DeploymentSpec, arm: DeploymentSpec) -> dict[str, Any]:
    """The ``llm:`` settings of an arm that differ from the primary's."""
    return {f.name: getattr(arm.llm, f.name) for f in dataclasses.fields(arm.llm)
            if getattr(arm.llm, f.name) != getattr(primary.llm, f.name)}
