"""The HTTP app: OpenAI-compatible embeddings (``server/embeddings.py``) over a Batcher, plus
/v1/models, /health and /metrics, behind the request middleware (``server/middleware.py``).

Errors are OpenAI-shaped (``server/errors.py``): an unknown model is 404, malformed bodies 422, the
core's rejections as ``embeddings.rejection_error`` maps them. ``create_app`` takes a ready executor,
so tests and benchmarks can serve any executor (the no-op one included) without the CLI.
"""

from __future__ import annotations

import asyncio
import gc
import logging
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from contextlib import asynccontextmanager
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry

from ..core.config import SchedulerConfig
from ..core.costmodel import CostModel
from ..runtime.batch_log import BatchLog
from ..runtime.executor import Executor
from .config import ServerConfig
from .embeddings import EMBEDDING_BODY, EmbeddingService
from .errors import install_error_handlers
from .gc_pauses import GCPauses, freeze_heap
from .middleware import RequestLifecycle
from .schemas import EmbeddingResponse, Health, ModelCard, ModelList

log = logging.getLogger("batchpilot.server")

def create_app(settings: ServerConfig, executor: Executor, config: SchedulerConfig | None = None,
               cost_model: CostModel | None = None,
               routers: Sequence[Callable[[CollectorRegistry], APIRouter]] = (),
               extra_models: Sequence[str] = (),
               on_shutdown: Sequence[Callable[[], Any]] = (),
               health_checks: Sequence[Callable[[], bool]] = ()) -> RequestLifecycle:
    """The ASGI app to hand to uvicorn: the request middleware (``middleware.RequestLifecycle``) around
    the FastAPI app (``.app`` is the FastAPI instance, ``.state.service`` the service).
    ``routers`` are factories given the metrics registry (how the LLM routes are mounted with ``--llm``);
    ``extra_models`` are listed by /v1/models too; ``on_shutdown`` run (in a thread) after the drain;
    ``health_checks`` say whether the other engines (the LLM's) are alive: /health is 503 unless all are.
    ``config`` is the resolved deployment's scheduler config (``core.deployment``): every admission
    rule is in it."""
    svc = EmbeddingService(settings, executor, config or SchedulerConfig(),
                           cost_model or CostModel.default_cpu_minilm())
    hooks = list(on_shutdown)
    if settings.batch_log:
        batch_log = BatchLog(settings.batch_log)
        svc.batcher.batch_observers.append(batch_log)
        hooks.append(batch_log.close)  # after the drain: no batch writes after it

    pauses = GCPauses(svc.metrics.registry)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> Any:
        log.info("gc: %d objects frozen out of collections (startup's heap)", freeze_heap())
        pauses.start()
        yield
        pauses.close()
        gc.unfreeze()  # back to normal for whatever outlives the server in this process (tests)
        await svc.close()
        for hook in hooks:
            await asyncio.get_running_loop().run_in_executor(None, hook)

    app = FastAPI(title="batchpilot", version="0.1.0", lifespan=lifespan)
    app.state.service = svc
    # run when the shutdown drain times out: what is still queued or running gets an answer, not a cut
    # connection (the LLM routes add their engine's stop: open streams end with an error event)
    app.state.drain_timeout_hooks = [lambda: svc.batcher.shutdown(0.0)]
    install_error_handlers(app)
    for make_router in routers:
        app.include_router(make_router(svc.metrics.registry))

    # POST /v1/embeddings is served by ``DirectRoutes`` below, before FastAPI's middleware and routing
    # (on short requests they cost more than everything batchpilot does); this route declares it in
    # the OpenAPI schema and is the same handler.
    @app.post("/v1/embeddings", response_model=EmbeddingResponse, openapi_extra=EMBEDDING_BODY)
    async def create_embeddings(request: Request) -> Response:
        return await svc.handle(request)

    @app.get("/v1/models", response_model=ModelList)
    async def list_models() -> ModelList:
        cards = [ModelCard(id=svc.model_name, created=svc.created, max_model_len=svc.max_length,
                           dimensions=svc.dim)]
        return ModelList(data=cards + [ModelCard(id=m, created=svc.created) for m in extra_models])

    @app.get("/health", response_model=Health, responses={503: {"model": Health}})
    async def health() -> JSONResponse:
        b = svc.batcher
        status = b.health if b.health != "ok" or all(alive() for alive in health_checks) else "degraded"
        body = Health(status=status, model=svc.model_name, queued=b.scheduler.num_waiting,  # type: ignore[arg-type]
                      running=b.num_running, pending=b.num_pending)
        return JSONResponse(body.model_dump(), status_code=200 if status == "ok" else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(svc.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return RequestLifecycle(DirectRoutes(app, {("POST", "/v1/embeddings"): svc.handle}), settings,
                            svc.metrics.registry)


class DirectRoutes:
    """ASGI: the hot routes straight to their handlers (``handler(request) -> Response``, errors
    included), the rest to FastAPI. Inside the request middleware, so auth, body limits, request ids
    and the last-resort 500 apply to both alike."""

    def __init__(self, app: FastAPI, routes: dict[tuple[str, str], Callable[[Request], Awaitable[Response]]]
                 ) -> None:
        self.app = app
        self.state = app.state
        self.routes = routes

    async def __call__(self, scope: MutableMapping[str, Any], receive: Callable[[], Awaitable[Any]],
                       send: Callable[[Any], Awaitable[None]]) -> None:
        handler = None
        if scope["type"] == "http":
            handler = self.routes.get((scope["method"], scope["path"]))
        if handler is None:
            await self.app(scope, receive, send)
            return
        response = await handler(Request(scope, receive))
        await response(scope, receive, send)

