"""``batchpilot serve``: load the model, pick the cost model, build the app, run uvicorn.

    batchpilot serve                                   # embedded all-MiniLM-L6-v2 on 127.0.0.1:8000
    batchpilot serve --model PATH --config tuned.yaml --profile profile.json --port 8080
    batchpilot serve --model EMBEDDER --model RERANKER # two models, each with its own scheduler
    batchpilot serve --noop                            # a model that costs nothing (serving-path benchmarks)

Each ``--model`` is served with its own scheduler, slots and metrics (label ``model``); its task
(embed, score, classify) is read from the checkpoint (``models.tasks``) unless ``--task`` says.
``--model-name``, ``--task`` and ``--profile`` are given once per ``--model``, in the same order (a
single ``--task`` or ``--profile`` with several models is refused: say it for each).

Cost model of each model, in order: its ``--profile`` (``CostModel.load``); else a brief bounded
start-up profile of the loaded model (``models.profiler.profile_encoder``) unless
``--no-startup-profile``; else the stated default ``CostModel.default_cpu_minilm()``. The log says
which was used. The API key may also come from ``$BATCHPILOT_API_KEY`` (keeps it out of the process
list).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..config_file import (
    add_deployment_args,
    add_llm_args,
    add_precision_args,
    add_rollout_args,
    rollout_from_args,
    spec_from_args,
)
from ..core.config import SchedulerConfig
from ..core.costmodel import BatchShape, CostModel
from ..core.deployment import DeploymentSpec, ModelLimits, resolve_deployment
from ..core.rollout import RolloutSpec
from .config import TASKS, ModelSpec, ServerConfig

log = logging.getLogger("batchpilot.server")


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("serve", help="serve a model behind the batching layer (OpenAI-compatible)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", action="append", default=None, metavar="PATH",
                   help="local HF model folder (default: the embedded MiniLM); repeat to serve several")
    p.add_argument("--model-name", action="append", default=None, metavar="NAME",
                   help="name clients use, one per --model (default: the folder's name)")
    p.add_argument("--task", action="append", default=None, choices=TASKS,
                   help="what a --model serves, one per --model (default auto: from its config)")
    p.add_argument("--max-length", type=int, default=None, help="max tokens per input (default: model limit)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads (default: all cores; 1 is faster when oversubscribed)")
    p.add_argument("--tokenizer-workers", type=int, default=None,
                   help="threads tokenising inputs and prompts off the event loop, per model "
                        "(default: one per core)")
    add_deployment_args(p)
    add_precision_args(p)
    add_rollout_args(p)
    add_llm_args(p)
    p.add_argument("--profile", action="append", default=None, metavar="PATH",
                   help="cost-model profile JSON (`batchpilot profile -o`), one per --model")
    p.add_argument("--no-startup-profile", action="store_true",
                   help="without --profile, use the built-in default cost model instead of measuring")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("BATCHPILOT_API_KEY"),
                   help="require Authorization: Bearer KEY on every route but /health")
    p.add_argument("--drain-timeout-s", type=float, default=30.0)
    limits = p.add_argument_group("request limits (docs/reliability.md)")
    limits.add_argument("--max-body-bytes", type=int, default=ServerConfig.max_body_bytes,
                        help="request bodies over this get 413 (default: %(default)s, 16 MiB)")
    limits.add_argument("--body-timeout-s", type=float, default=ServerConfig.body_timeout_s,
                        help="a body not fully arrived this long after its headers gets 408 and the "
                             "connection closed (default: %(default)s)")
    limits.add_argument("--send-timeout-s", type=float, default=ServerConfig.send_timeout_s,
                        help="a client that reads none of its response for this long is dropped "
                             "(default: %(default)s)")
    limits.add_argument("--max-json-values", type=int, default=ServerConfig.max_json_values,
                        help="JSON values per body, checked before parsing; over it: 413 "
                             "(default: %(default)s)")
    limits.add_argument("--max-json-containers", type=int, default=ServerConfig.max_json_containers,
                        help="JSON objects and arrays per body, checked before parsing; over it: 413 "
                             "(default: %(default)s)")
    limits.add_argument("--max-inputs", type=int, default=ServerConfig.max_inputs,
                        help="embedding inputs per request (default: %(default)s, as OpenAI)")
    limits.add_argument("--max-input-chars", type=int, default=ServerConfig.max_input_chars,
                        help="characters per embedding text, truncated or not (default: %(default)s)")
    limits.add_argument("--max-input-tokens", type=int, default=ServerConfig.max_input_tokens,
                        help="token ids per embedding token-id input, before truncation "
                             "(default: %(default)s, as OpenAI)")
    p.add_argument("--noop", action="store_true", help="serve a no-op model (benchmarks of the serving path)")
    p.add_argument("--noop-delay-ms", type=float, default=0.0, help="--noop: fixed time per batch")
    p.add_argument("--no-warmup", action="store_true")
    p.add_argument("--llm", action="store_true", help="also mount the LLM completion routes")
    p.add_argument("--llm-model", default=None, help="--llm: local HF causal-LM folder")
    p.add_argument("--batch-log", default=None, metavar="PATH",
                   help="append one JSON line per executed encoder batch (start, slot seconds, size, "
                        "cost-model features) to PATH: how `bench fidelity` reports the run's speed "
                        "against the profile")
    p.add_argument("--llm-step-log", default=None, metavar="PATH",
                   help="--llm: append one JSON line per engine step (shape features, wall and forward "
                        "seconds) to PATH")
    failover = p.add_argument_group("fallback and watchdog (docs/reliability.md)")
    failover.add_argument("--no-encoder-fallback", action="store_true",
                          help="an embedding model served padding-free or below float32 gets no padded "
                               "float32 copy to fall back to when that path fails repeatedly (saves its "
                               "memory)")
    failover.add_argument("--encoder-stall-timeout-s", type=float, default=None, metavar="S",
                          help="an encoder batch running longer than S makes /health 503 until it ends "
                               "(default: measured, 10x the p99 batch time, at least 5 s)")
    failover.add_argument("--llm-fallback", choices=("static", "off"), default="static",
                          help="--llm: what serves while the engine is failed (died, stalled, out of "
                               "memory): static = HF generate in static batches on the same weights "
                               "(default); off = 503 engine_unavailable")
    failover.add_argument("--llm-stall-timeout-s", type=float, default=None, metavar="S",
                          help="--llm: a step running longer than S counts as stalled (default: measured, "
                               "10x the p99 step time, at least 5 s)")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    p.add_argument("--log-format", default="text", choices=("text", "json"),
                   help="json: one JSON object per line (time, level, logger, message, exc_info)")
    p.add_argument("--access-log", action="store_true", help="log every request (off: it costs throughput)")
    from .ray_app import add_ray_args  # --ray: flags only; ray itself loads with --ray

    add_ray_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from . import lifecycle, logs

    if getattr(args, "ray", False):  # the same app, as a Ray Serve deployment (server/ray_app.py)
        from .ray_app import run_ray

        return run_ray(args)
    logs.configure(args.log_level, args.log_format)
    spec = spec_from_args(args)
    settings = server_config(args, spec)
    app = build_app(settings, spec, rollout_from_args(args, spec))
    if settings.host not in ("127.0.0.1", "localhost", "::1") and settings.api_key is None:
        log.warning("binding %s without --api-key: anyone who can reach this port can use the model",
                    settings.host)
    # SIGTERM: 503 to new requests while in-flight work drains, then exit 0 (lifecycle.py)
    return lifecycle.serve(app, host=settings.host, port=settings.port,
                           drain_timeout_s=settings.drain_timeout_s, log_level=settings.log_level,
                           access_log=args.access_log, log_format=args.log_format)


def server_config(args: argparse.Namespace, spec: DeploymentSpec) -> ServerConfig:
    """The server settings the parsed `serve` flags ask for (shared by `serve` and `serve --ray`)."""
    return ServerConfig(
        host=args.host, port=args.port, models=model_specs(args),
        max_length=args.max_length, num_threads=args.threads, tokenizer_workers=args.tokenizer_workers,
        noop=args.noop, noop_delay_s=args.noop_delay_ms / 1000.0,
        startup_profile=not args.no_startup_profile, api_key=args.api_key,
        max_body_bytes=args.max_body_bytes, body_timeout_s=args.body_timeout_s,
        send_timeout_s=args.send_timeout_s, max_json_values=args.max_json_values,
        max_json_containers=args.max_json_containers, max_inputs=args.max_inputs,
        max_input_chars=args.max_input_chars, max_input_tokens=args.max_input_tokens,
        request_timeout_s=spec.server.request_timeout_s,
        drain_timeout_s=args.drain_timeout_s, warmup=not args.no_warmup, llm=args.llm,
        llm_model=args.llm_model, llm_step_log=args.llm_step_log, batch_log=args.batch_log,
        llm_fallback=args.llm_fallback, llm_stall_timeout_s=args.llm_stall_timeout_s,
        encoder_fallback=not args.no_encoder_fallback, encoder_stall_timeout_s=args.encoder_stall_timeout_s,
        log_level=args.log_level)


def model_specs(args: argparse.Namespace) -> tuple[ModelSpec, ...]:
    """One ``ModelSpec`` per ``--model`` (or the embedded model), with its name, task and profile."""
    paths: list[str | None] = list(args.model or [None])
    per_model = {"--model-name": args.model_name, "--task": args.task, "--profile": args.profile}
    for flag, values in per_model.items():
        if values is not None and len(values) != len(paths):
            raise SystemExit(f"batchpilot serve: {flag} was given {len(values)} times for {len(paths)} "
                             f"model(s); give it once per --model, in the same order")
    return tuple(ModelSpec(path=path, name=(args.model_name or [None] * len(paths))[i],
                           task=(args.task or ["auto"] * len(paths))[i],
                           profile=(args.profile or [None] * len(paths))[i])
                 for i, path in enumerate(paths))


def build_app(settings: ServerConfig, spec: DeploymentSpec | SchedulerConfig | None = None,
              rollout: RolloutSpec | None = None) -> Any:
    """Load each model's executor and cost model, resolve its deployment (``core.deployment``: the
    same function ``simulate`` runs) and its arms' (``rollout``), mount the optional LLM routes."""
    from .app import ServedModel, create_app

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
        executor = load_executor(settings, model, dtype, spec.model.min_cosine, spec.model.backend, cache)
        supports = getattr(executor, "supports_padding_free", lambda: True)()
        padding = spec.encoder.planner.padding if supports else "dynamic"
        cost_model = choose_cost_model(settings, model, executor, padding, profiled)
        limits = ModelLimits(int(executor.max_length), bool(supports), device_memory_bytes(executor))
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
    engine, router, hooks = _llm_router(settings, spec)
    app = create_app(settings, models=served, routers=[router], extra_models=[engine.model_name],
                     on_shutdown=hooks, health_checks=[lambda: bool(engine.is_alive)])

    async def stop_engine() -> None:  # its open streams end with an SSE error event
        await asyncio.get_running_loop().run_in_executor(None, engine.shutdown, 5.0)

    app.state.drain_timeout_hooks.append(stop_engine)
    return app


def served_arm(settings: ServerConfig, model: ModelSpec, arm: DeploymentSpec, primary: DeploymentSpec,
               executor: Any, cost_model: CostModel, limits: ModelLimits, cache: str | None, name: str,
               arm_name: str) -> Any:
    """A candidate arm of ``model``: the primary's executor (the same weights) unless the arm asks for
    another precision or backend, and its deployment resolved by the same function as the primary's."""
    from .app import ServedArm

    if arm.model != primary.model:
        executor = load_executor(settings, model, arm.model.dtype, arm.model.min_cosine, arm.model.backend,
                                 cache)
        log.info("arm %s of %s: its own executor (model: %s)", arm_name, name, arm.model)
    deployment = resolve_deployment(arm, cost_model, limits)
    for note in deployment.notes:
        log.info("deployment %s arm %s: %s", name, arm_name, note)
    log.info("deployment %s arm %s: %s", name, arm_name, deployment.describe())
    return ServedArm(executor, deployment.scheduler)


def device_memory_bytes(executor: Any) -> float:
    """The memory a batch budget is a share of: the executor's device's (``models.device.memory_bytes``),
    or this machine's for an executor without torch (the no-op model); 0 where it cannot be read."""
    device = getattr(executor, "device", None)
    if device is not None:
        from ..models.device import memory_bytes

        return memory_bytes(device)
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0.0


def load_executor(settings: ServerConfig, model: ModelSpec | None = None, dtype: str = "float32",
                  min_cosine: float = 0.999, backend: str = "torch", cache_dir: str | None = None) -> Any:
    model = model or settings.models[0]
    if settings.noop:
        from ..runtime.executor import NoopExecutor

        log.info("model: no-op (%.1f ms per batch)", settings.noop_delay_s * 1e3)
        return NoopExecutor(dim=384, delay_s=settings.noop_delay_s, max_length=settings.max_length or 512)
    from ..models.tasks import load_model

    executor = load_model(model.path, model.name, model.task, settings.max_length, settings.num_threads,
                          dtype, min_cosine, backend, cache_dir)
    report = getattr(executor, "precision", None)
    if report is not None:
        log.info("precision: %s", report.describe())
    if settings.encoder_fallback:
        executor = with_fallback(executor)
    log.info("model: %s from %s (%s, dim %d, max %d tokens, %s forward, %d threads)", executor.model_name,
             executor.model_path, executor.task, executor.dim, executor.max_length,
             getattr(executor, "forward_impl", "hf"), executor.num_threads)
    if settings.warmup:
        executor.warmup()
    return executor


def with_fallback(executor: Any) -> Any:
    """A torch embedding executor whose path is not padded float32 (lean or padding-free forward, a lower
    precision) behind ``FallbackExecutor``, with the padded float32 path of the same checkpoint to fall
    back to; any other executor as it is."""
    from ..models.encoder import EncoderExecutor

    if type(executor) is not EncoderExecutor:
        return executor
    cfg = executor.config
    if cfg.dtype == "float32" and not cfg.lean_forward:
        return executor
    from ..runtime.fallback_executor import FallbackExecutor

    plain = EncoderExecutor(dataclasses.replace(cfg, dtype="float32", lean_forward=False))
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
            from ..models.profiler import profile_encoder
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
    """The encoder profile (`models.profiler.profile_encoder`) bounded to ~15 s, padded as served."""
    model, points = profile_encoder(executor, padding="none" if padding == "none" else "dynamic",
                                    **STARTUP_PROFILE)
    log.info("cost model: start-up profile of %d shapes; batch 1 x 128 tokens predicted %.1f ms", len(points),
             1e3 * model.latency(BatchShape.padded([128], 128)))
    return model


def _llm_router(settings: ServerConfig, spec: DeploymentSpec) -> tuple[Any, Any, list[Callable[[], Any]]]:
    """The started engine behind its failover (``runtime/llm_failover.py``), a factory the app calls with
    its registry (``make_llm_router``), and what to run at shutdown, in order."""
    from . import llm_routes  # lazy: the LLM stack loads only with --llm

    build = getattr(llm_routes, "build_llm_engine", None)
    if build is None:
        from ..runtime.llm_engine import build_llm_engine as build
    engine = build(settings.llm_model, tokenizer_threads=settings.tokenizer_workers or 0,
                   threads=settings.num_threads or 0,
                   **llm_overrides(spec))
    from ..runtime.llm_build import build_failover

    fallback, stall_s = settings.llm_fallback, settings.llm_stall_timeout_s
    engine = build_failover(engine, fallback, stall_s)
    log.info("llm: watchdog on (stall bound: %s), fallback: %s",
             "measured" if stall_s is None else f"{stall_s} s", fallback)
    hooks: list[Callable[[], Any]] = [engine.shutdown]
    if settings.llm_step_log:
        from ..runtime.llm_engine import StepLog

        step_log = StepLog(settings.llm_step_log)
        engine.step_observers.append(step_log)
        hooks.append(step_log.close)  # after the engine has stopped: no step writes after it
        log.info("llm: logging every engine step to %s", settings.llm_step_log)
    log.info("llm: mounted the LLM routes (%s)", getattr(engine, "model_name", settings.llm_model))
    return engine, lambda registry: llm_routes.make_llm_router(engine, registry), hooks


def llm_overrides(spec: DeploymentSpec) -> dict[str, Any]:
    """The ``llm:`` settings that differ from ``LLMSchedulerConfig``'s defaults: the engine's own
    defaults (the model's position limit and EOS tokens) stand for the rest."""
    from ..core.llm_scheduler import LLMSchedulerConfig

    default = LLMSchedulerConfig()
    return {f.name: getattr(spec.llm, f.name) for f in dataclasses.fields(spec.llm)
            if getattr(spec.llm, f.name) != getattr(default, f.name)}


def main(argv: list[str] | None = None) -> int:
    """``python -m batchpilot.server.cli [serve options]``: serve, without the other subcommands."""
    parser = argparse.ArgumentParser(prog="batchpilot-serve")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["serve", *(sys.argv[1:] if argv is None else argv)])
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
