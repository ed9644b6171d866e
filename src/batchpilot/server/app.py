"""The HTTP app: one or more served models, each behind its own Batcher, plus /v1/models, /health
and /metrics, behind the request middleware (``server/middleware.py``).

    embed models       POST /v1/embeddings                         (server/embeddings.py)
    score models       POST /v1/rerank, /v1/score (and aliases)    (server/scoring.py)
    classify models    POST /v1/classify                           (server/scoring.py)
    every model        POST /tokenize, /detokenize                 (server/service.py)

A request names its model in the body's ``model``; without it the first model of the route's task
answers (``routing.Models``). Every per-model metric carries ``model=<name>`` (``metrics.ModelLabels``).
Errors are OpenAI-shaped (``server/errors.py``). ``create_app`` takes ready executors, so tests and
benchmarks can serve any executor (the no-op one included) without the CLI.
"""

from __future__ import annotations

import asyncio
import gc
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from pydantic import BaseModel
from starlette.types import Receive, Scope, Send

from batchpilot.core.config import SchedulerConfig
from batchpilot.core.costmodel import CostModel
from batchpilot.core.rollout import RolloutSpec
from batchpilot.runtime.executor import ModelExecutor
from batchpilot.runtime.journal import BatchLog
from batchpilot.server.arms import AnyArmed, ArmedModel, arms_router
from batchpilot.server.config import ServerConfig
from batchpilot.server.embeddings import EmbeddingService
from batchpilot.server.errors import install_error_handlers
from batchpilot.server.gc_pauses import GCPauses, freeze_heap
from batchpilot.server.llm.served import ServedEngine
from batchpilot.server.metrics import ModelLabels
from batchpilot.server.middleware import RequestLifecycle
from batchpilot.server.routing import TASK_ROUTES, ModelRoute, Models
from batchpilot.server.schemas import (
    ClassifyRequest,
    ClassifyResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    EmbeddingRequest,
    EmbeddingResponse,
    Health,
    ModelCard,
    ModelList,
    RerankRequest,
    RerankResponse,
    ScoreRequest,
    ScoreResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from batchpilot.server.scoring import ScoringService
from batchpilot.server.service import ModelService
from batchpilot.server.tenants import Tenancy, tenants_router

log = logging.getLogger("batchpilot.server")

_ALL_TASKS = ("embed", "score", "classify")
# path -> (body, response, tasks, service method)
_ROUTES: dict[str, tuple[type[BaseModel], type[BaseModel], tuple[str, ...], str]] = {
    "/v1/embeddings": (EmbeddingRequest, EmbeddingResponse, ("embed",), "answer"),
    **{p: (RerankRequest, RerankResponse, ("score",), "rerank")
       for p in ("/v1/rerank", "/rerank", "/v2/rerank")},
    **{p: (ScoreRequest, ScoreResponse, ("score",), "score") for p in ("/v1/score", "/score")},
    **{p: (ClassifyRequest, ClassifyResponse, ("classify",), "classify")
       for p in ("/v1/classify", "/classify")},
    "/tokenize": (TokenizeRequest, TokenizeResponse, _ALL_TASKS, "tokenize_text"),
    "/detokenize": (DetokenizeRequest, DetokenizeResponse, _ALL_TASKS, "detokenize"),
}
assert {p for paths in TASK_ROUTES.values() for p in paths} <= set(_ROUTES)
_HEALTH_ORDER = ("stopped", "draining", "degraded", "ok")  # the worst model's state is the server's


@dataclass(frozen=True)
class ServedArm:
    """A candidate arm of a served model: its executor (the primary's where the precision is the
    same) and its resolved scheduler config."""

    executor: ModelExecutor
    config: SchedulerConfig


@dataclass(frozen=True)
class ServedModel:
    """A model to serve: its executor, its resolved scheduler config (``core.deployment``), its cost
    model and the name clients use (default: the executor's ``model_name``); with ``rollout``
    candidates, one ``ServedArm`` per candidate, in the same order."""

    executor: ModelExecutor
    config: SchedulerConfig | None = None
    cost_model: CostModel | None = None
    name: str | None = None
    rollout: RolloutSpec | None = None
    arms: tuple[ServedArm, ...] = ()


def _alive() -> bool:
    return True


@dataclass(frozen=True)
class MountedEngine:
    """Another engine's routes beside the models' (the LLM's with ``--llm``): ``router``, given the
    metrics registry, makes them; ``model_name`` is listed by /v1/models; /health is 503 unless
    ``alive()``; ``arms`` show in /v1/arms and /health; ``on_shutdown`` run (in a thread, in order)
    after the drain; ``on_drain_timeout`` run when the drain times out."""

    router: Callable[[CollectorRegistry], APIRouter]
    model_name: str | None = None
    alive: Callable[[], bool] = _alive
    arms: tuple[ArmedModel[ServedEngine], ...] = ()
    on_shutdown: tuple[Callable[[], object], ...] = ()
    on_drain_timeout: tuple[Callable[[], Awaitable[None]], ...] = ()
    # the server's tenants (the keys file's quotas, reloaded on SIGHUP; bounded metric labels), and the
    # engine's per-tenant usage for GET /v1/tenants
    use_tenancy: Callable[[Tenancy], None] | None = None
    tenant_usage: Callable[[], list[dict[str, object]]] | None = None


def make_service(settings: ServerConfig, model: ServedModel, executor: ModelExecutor | None = None,
                 config: SchedulerConfig | None = None) -> ModelService:
    executor = executor or model.executor
    kind = EmbeddingService if executor.task == "embed" else ScoringService
    return kind(settings, executor, config or model.config or SchedulerConfig(),
                model.cost_model or CostModel.default_cpu_minilm(), model.name)


def make_arms(settings: ServerConfig, model: ServedModel, primary: ModelService
              ) -> ArmedModel[ModelService] | None:
    """The model's arms (``server/arms.py``), or None when it has no candidates."""
    if model.rollout is None or not model.rollout.arms:
        return None
    if len(model.arms) != len(model.rollout.arms):
        raise ValueError(f"{len(model.arms)} served arms for {len(model.rollout.arms)} candidates")
    services = [primary, *(make_service(settings, model, a.executor, a.config) for a in model.arms)]
    return ArmedModel.of_services(services, model.rollout)


def serve_models(settings: ServerConfig, models: Sequence[ServedModel]) -> Models:
    """Each model's service (``ModelService``) and its arms'."""
    primaries = [make_service(settings, m) for m in models]
    armed = [a for m, p in zip(models, primaries, strict=True) if (a := make_arms(settings, m, p))]
    return Models(primaries, armed)


def create_app(settings: ServerConfig, models: Sequence[ServedModel],
               engines: Sequence[MountedEngine] = (), tenancy: Tenancy | None = None) -> RequestLifecycle:
    """The ASGI app to hand to uvicorn: the request middleware (``middleware.RequestLifecycle``) around
    the FastAPI app (``.app`` is the FastAPI instance, ``.state.service`` the first model's service,
    ``.state.models`` all of them, ``.state.tenancy`` the keys and tenants, whose ``reload`` SIGHUP
    calls), serving ``models`` (the first is the default) and the ``engines`` mounted beside them. A
    model's ``config`` is the resolved deployment's scheduler config: every admission rule is in it."""
    tenancy = tenancy or Tenancy.of(settings.api_keys, settings.api_key)
    served = serve_models(settings, models)
    for service in served.all_services:
        service.use_tenancy(tenancy)
    registry = CollectorRegistry()
    registry.register(ModelLabels(metric_sources(served)))
    hooks = [hook for e in engines for hook in e.on_shutdown]
    if settings.batch_log:  # the first model's batches (what `bench fidelity` reads)
        batch_log = BatchLog(settings.batch_log)
        served.primary.batcher.batch_observers.append(batch_log)
        hooks.append(batch_log.close)  # after the drain: no batch writes after it
    app = FastAPI(title="batchpilot", version="0.1.0", lifespan=lifespan(served, GCPauses(registry), hooks))
    app.state.service = served.primary
    app.state.models = served
    app.state.tenancy = tenancy
    # run when the shutdown drain times out: what is still queued or running gets an answer, not a cut
    # connection (an engine's stop ends its open streams with an error event)
    app.state.drain_timeout_hooks = [*(lambda s=s: s.batcher.shutdown(0.0) for s in served.all_services),
                                     *(hook for e in engines for hook in e.on_drain_timeout)]
    install_error_handlers(app)
    for engine in engines:
        if engine.use_tenancy is not None:
            engine.use_tenancy(tenancy)
        app.include_router(engine.router(registry))
    direct = model_routes(app, served)
    armed: list[AnyArmed] = [*served.arms.values(), *(a for e in engines for a in e.arms)]
    add_info_routes(app, served, engines, armed, registry)
    clock = served.primary.batcher.clock
    llm_usage = [e for e in engines if e.tenant_usage is not None and e.model_name]
    app.include_router(tenants_router(tenancy, lambda: [(s.model_name, s.batcher.scheduler)
                                                        for s in served.services], clock,
                                      lambda: {"llm": {e.model_name: e.tenant_usage() for e in llm_usage
                                                       if e.tenant_usage is not None}}))
    if armed:
        app.include_router(arms_router(armed))
    return RequestLifecycle(DirectRoutes(app, direct), settings, registry, tenancy)


def lifespan(served: Models, pauses: GCPauses, hooks: Sequence[Callable[[], object]]
             ) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:
    """Start-up: the heap frozen out of collections, the GC pause gauge and the watchdogs started; after
    the drain: the services closed, then ``hooks`` run in a thread, in order."""
    @asynccontextmanager
    async def run(_: FastAPI) -> AsyncIterator[None]:
        log.info("gc: %d objects frozen out of collections (startup's heap)", freeze_heap())
        pauses.start()
        for s in served.all_services:
            s.watchdog.start()
        yield
        pauses.close()
        gc.unfreeze()  # back to normal for whatever outlives the server in this process (tests)
        await asyncio.gather(*(s.close() for s in served.all_services))
        for hook in hooks:
            await asyncio.get_running_loop().run_in_executor(None, hook)

    return run


Handler = Callable[[Request], Awaitable[Response]]


def model_routes(app: FastAPI, served: Models) -> dict[tuple[str, str], Handler]:
    """The model routes, for ``DirectRoutes``: they are served before FastAPI's middleware and routing
    (on short requests those cost more than everything batchpilot does). The FastAPI routes of the
    tasks served declare them in the OpenAPI schema and are the same handlers."""
    direct: dict[tuple[str, str], Handler] = {}
    for path, (body, response, tasks, method) in _ROUTES.items():
        handler = ModelRoute(served, path, body, tasks, method)
        direct["POST", path] = handler
        if served.of_task(tasks):
            app.add_api_route(path, handler, methods=["POST"], response_model=response,
                              openapi_extra={"requestBody": {"required": True, "content": {
                                  "application/json": {"schema": body.model_json_schema()}}}})
    return direct


def add_info_routes(app: FastAPI, served: Models, engines: Sequence[MountedEngine],
                    armed: Sequence[AnyArmed], registry: CollectorRegistry) -> None:
    """``GET /v1/models``, ``/health`` and ``/metrics``."""
    svc = served.primary

    @app.get("/v1/models", response_model=ModelList)
    async def list_models() -> ModelList:
        cards = [ModelCard(id=s.model_name, created=s.created, max_model_len=s.max_length, dimensions=s.dim,
                           task=s.task) for s in served.services]
        return ModelList(data=cards + [ModelCard(id=e.model_name, created=svc.created, task="generate")
                                       for e in engines if e.model_name is not None])

    @app.get("/health", response_model=Health, responses={503: {"model": Health}})
    async def health() -> JSONResponse:
        # the primaries' (a candidate arm's trouble shows under ``arms`` and is what rollback is for)
        status = min((s.batcher.health for s in served.services), key=_HEALTH_ORDER.index)
        stalled = any(s.watchdog.stuck for s in served.services)
        if status == "ok" and (stalled or not all(e.alive() for e in engines)):
            status = "degraded"
        batchers = [s.batcher for s in served.all_services]
        body = Health(status=status, model=svc.model_name,  # type: ignore[arg-type]
                      models=[s.model_name for s in served.services],
                      queued=sum(b.scheduler.num_waiting for b in batchers),
                      running=sum(b.num_running for b in batchers),
                      pending=sum(b.num_pending for b in batchers),
                      arms={a.model_name: a.states() for a in armed} or None)
        return JSONResponse(body.model_dump(exclude_none=True), status_code=200 if status == "ok" else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


def metric_sources(models: Models) -> list[tuple[dict[str, str], CollectorRegistry]]:
    """Each service's registry with its labels: ``model``, and ``arm`` for a model served in arms (whose
    arm gauges come labelled ``model`` only)."""
    out: list[tuple[dict[str, str], CollectorRegistry]] = []
    for s in models.services:
        armed = models.arms.get(s.model_name)
        if armed is None:
            out.append(({"model": s.model_name}, s.metrics.registry))
            continue
        out += [({"model": s.model_name, "arm": arm}, a.metrics.registry)
                for arm, a in armed.backends.items()]
        out.append(({"model": s.model_name}, armed.registry))
    return out


class DirectRoutes:
    """ASGI: the hot routes straight to their handlers (``handler(request) -> Response``, errors
    included), the rest to FastAPI. Inside the request middleware, so auth, body limits, request ids
    and the last-resort 500 apply to both alike."""

    def __init__(self, app: FastAPI, routes: dict[tuple[str, str], Callable[[Request], Awaitable[Response]]]
                 ) -> None:
        self.app = app
        self.state = app.state
        self.routes = routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        handler = None
        if scope["type"] == "http":
            handler = self.routes.get((scope["method"], scope["path"]))
        if handler is None:
            await self.app(scope, receive, send)
            return
        response = await handler(Request(scope, receive))
        await response(scope, receive, send)

