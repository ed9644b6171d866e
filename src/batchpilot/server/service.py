"""What every model route shares: one served model's executor, Batcher, metrics and tokenizer pool,
and the path of a request through them.

    count(route, status, seconds)          the route's HTTP metrics, on this model's series
    tokenize_off_loop(fn, cheap)           on the loop when cheap, else on the pool of
                                           ``tokenizer_workers`` threads; InvalidInput -> 400
    run_group(payloads, lengths, ...)      Batcher.submit_group (the core admits all inputs or none)
                                           ─▶ wait for all, the client's disconnect, or the request
                                           timeout; the core's rejection mapped by reason

A model serves one task (``models.tasks``): ``embed`` (``server/embeddings.py``), ``score`` or
``classify`` (``server/scoring.py``). Core rejections map by reason: too long 400, infeasible deadline
and rate limit 429, queue full and shutting down 503 with Retry-After, expired deadline 504. A client
that disconnects while its inputs wait has them withdrawn from the queue.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import orjson
from fastapi import Request
from fastapi.responses import Response
from prometheus_client import Counter, Histogram

from batchpilot.core.admission import RejectReason
from batchpilot.core.config import SchedulerConfig
from batchpilot.core.costmodel import CostModel
from batchpilot.core.request import DEFAULT_TENANT
from batchpilot.core.stall import StallRule
from batchpilot.models.tokens import InvalidInput
from batchpilot.runtime.batcher import Batcher, BatcherWatchdog, StageTimes
from batchpilot.runtime.errors import ExecutionError, RequestRejected
from batchpilot.runtime.executor import EncoderPath, FallbackExecutor, ModelExecutor, primary_of
from batchpilot.server.config import ServerConfig
from batchpilot.server.errors import APIError, request_id_of
from batchpilot.server.metrics import ServerMetrics
from batchpilot.server.schemas import PRIORITY_MAX, DetokenizeRequest, TokenizeRequest
from batchpilot.server.tenants import Tenancy, tenant_of

log = logging.getLogger("batchpilot.server")

T = TypeVar("T")
Num = TypeVar("Num", int, float)  # a numeric header's kind

_REJECT_STATUS = {RejectReason.TOO_LONG: 400, RejectReason.INFEASIBLE_DEADLINE: 429,
                  RejectReason.RATE_LIMITED: 429, RejectReason.QUOTA_TOKENS: 429,
                  RejectReason.QUOTA_CONCURRENCY: 429, RejectReason.QUEUE_FULL: 503,
                  RejectReason.SHUTTING_DOWN: 503, RejectReason.DEADLINE_EXPIRED: 504,
                  RejectReason.CANCELLED: 499}
# refusals that waiting does not cure when the core gives no retry time (a request over its tenant's
# token burst): no Retry-After
_PERMANENT = (RejectReason.INFEASIBLE_DEADLINE, RejectReason.QUOTA_TOKENS)


# A request whose texts total at most this many characters (or token-id lists this many ids) is
# tokenised on the event loop: a fast tokenizer does that in about the time of the hand-off to a thread
# and back, so the loop is held no longer than a hand-off would hold it.
INLINE_TOKENIZE_CHARS = 64
RECEIVED_KEY = "batchpilot.received"  # scope key: when an armed request first reached a model (monotonic)
INLINE_TOKENIZE_IDS = 512


def tokenizer_workers(settings: ServerConfig) -> int:
    """Threads tokenising inputs, per model: the setting, else one per core this process may use (the
    simulator's serial stage has as many servers: ``RequestCost.serial_servers``)."""
    return settings.serving.tokenizer_workers or len(os.sched_getaffinity(0))


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


def rejection_error(exc: RequestRejected) -> APIError:
    status = _REJECT_STATUS.get(exc.reason, 503)
    code = "context_length_exceeded" if exc.reason is RejectReason.TOO_LONG else exc.reason.value
    retry = exc.retry_after_s if status in (429, 503) else None
    if status in (429, 503) and retry is None and exc.reason not in _PERMANENT:
        retry = 1.0  # overload: always tell the client when to come back
    return APIError(status, exc.message, code=code, retry_after_s=retry)


class ModelService:
    """One served model: its executor (tokenizer + model), its Batcher (its own scheduler and slots),
    its metrics (labelled ``model=<name>`` on the server's /metrics) and its tokenizer threads."""

    task = "embed"
    dim: int | None = None  # the width /v1/models shows: an embedding model's

    def __init__(self, settings: ServerConfig, executor: ModelExecutor, config: SchedulerConfig,
                 cost_model: CostModel, name: str | None = None) -> None:
        self.settings = settings
        self.executor = executor
        self.metrics = ServerMetrics(config.num_slots)
        self.batcher = Batcher(executor, config, cost_model, observer=self.metrics)
        self.metrics.bind(self.batcher.scheduler, lambda: self.batcher.num_pending)
        model = primary_of(executor)
        if isinstance(model, EncoderPath):
            self.metrics.set_precision(model.precision.chosen, model.precision.min_cosine)
        if isinstance(executor, FallbackExecutor):
            self.metrics.bind_fallback(executor)
        stall = StallRule(timeout_s=settings.encoder_stall_timeout_s)
        self.watchdog = BatcherWatchdog(self.batcher, stall)  # started with the app (its event loop)
        self.metrics.bind_watchdog(self.watchdog)
        self.model_name = name or executor.model_name
        self.max_length = executor.max_length
        # the deployment's timeout (core/deployment.py fills it from the server's when the config has
        # none): the core drops a queued input at it, and this answers 504 at it for one still running
        self.timeout_s = config.admission.timeout_s or settings.serving.request_timeout_s
        # a thread per core: the executors' tokenizers are called with fixed settings (a fast tokenizer
        # is shared safely then) and release the GIL while they work
        self.tokenizer_pool = ThreadPoolExecutor(tokenizer_workers(settings),
                                                 thread_name_prefix="batchpilot-tokenize")
        self.created = int(time.time())
        self._answered: dict[tuple[str, int], Counter] = {}  # (route, status) -> its counter child
        self._latency: dict[str, Histogram] = {}

    def use_tenancy(self, tenancy: Tenancy) -> None:
        """Serve the server's tenants: their table in this model's scheduler (and every reload's), their
        bounded labels on its metrics."""
        scheduler, clock = self.batcher.scheduler, self.batcher.clock
        scheduler.set_tenants(tenancy.table, clock())
        tenancy.on_table.append(lambda table: scheduler.set_tenants(table, clock()))
        self.metrics.tenant_label = tenancy.label

    def tenant(self, request: Request, user: str | None, num_inputs: int) -> str:
        """The request's tenant (``server.tenants.tenant_of``), checked against its quotas before its
        inputs are tokenised (each input is at least one token: the core checks the exact count again
        at admission); over a quota, the 429."""
        tenant = tenant_of(request, user)
        try:
            self.batcher.check_tenant(tenant, num_inputs)
        except RequestRejected as exc:
            raise rejection_error(exc) from None
        return tenant

    def count(self, route: str, status: int, seconds: float) -> None:
        counter = self._answered.get((route, status))
        if counter is None:
            counter = self._answered[route, status] = self.metrics.http_requests.labels(
                route=route, status=str(status))
        counter.inc()
        latency = self._latency.get(route)
        if latency is None:
            latency = self._latency[route] = self.metrics.http_latency.labels(route=route)
        latency.observe(seconds)

    async def tokenize_off_loop(self, fn: Callable[[], T], cheap: bool = False,
                                request: Request | None = None) -> T:
        """``fn()``: on the event loop when ``cheap`` (less work than the hand-off to a thread),
        else on the tokenizer pool. The executor's typed refusals are 400s with their code; any other
        tokenizer error is a fixed 400 (its text only in the log)."""
        try:
            if cheap:
                return fn()
            return await asyncio.get_running_loop().run_in_executor(self.tokenizer_pool, fn)
        except InvalidInput as exc:
            raise APIError(400, str(exc), code=exc.code, param="input") from None
        except ValueError as exc:
            rid = request_id_of(request) if request is not None else None
            log.warning("request %s: the tokenizer refused the input: %s", rid, exc)
            raise APIError(400, "the input could not be tokenised", code="invalid_input",
                           param="input") from None

    async def run_group(self, payloads: list[Any], lengths: list[int], request: Request,
                        priority: int | None, deadline: float | None,
                        times: StageTimes | None = None, tenant: str = DEFAULT_TENANT) -> list[Any]:
        """The inputs of one request through the core and the executor: a result per input, in order."""
        futures: list[asyncio.Future[Any]] = []
        try:  # the core admits or refuses the request's inputs together
            futures = self.batcher.submit_group_nowait(payloads, lengths, priority or 0, deadline,
                                                       times=times, tenant=tenant)
            return await self._wait(futures, request)
        except RequestRejected as exc:
            raise rejection_error(exc) from None
        except ExecutionError as exc:
            raise APIError(500, str(exc), code="model_error") from None
        finally:
            for f in futures:
                f.cancel()  # no-op when done; withdraws the rest when one failed or the client left

    def deadline(self, request: Request, priority: int | None, deadline_ms: float | None,
                 received: float) -> tuple[int | None, float | None]:
        """The request's priority and absolute deadline: the body's fields, else the ``X-Priority`` /
        ``X-Deadline-Ms`` headers; measured from when the request first reached a model (a request
        retried on the primary arm keeps its deadline)."""
        received = request.scope.get(RECEIVED_KEY, received)
        if priority is None:
            priority = header_num(request, "x-priority", int)
        budget_ms = deadline_ms if deadline_ms is not None else header_num(request, "x-deadline-ms", float)
        if budget_ms is not None and budget_ms <= 0:
            raise APIError(400, "deadline_ms must be > 0", param="deadline_ms")
        return priority, received + budget_ms / 1000.0 if budget_ms is not None else None

    async def _wait(self, futures: list[asyncio.Future[Any]], request: Request) -> list[Any]:
        work = futures[0] if len(futures) == 1 else asyncio.gather(*futures)
        watch = asyncio.ensure_future(_disconnected(request))
        try:
            done, _ = await asyncio.wait({work, watch}, timeout=self.timeout_s,
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
        if work in done:
            return [work.result()] if len(futures) == 1 else list(work.result())
        work.cancel()  # withdraws every input still queued
        work.add_done_callback(lambda f: None if f.cancelled() else f.exception())  # mark it retrieved
        if watch in done:
            raise ClientGone
        raise APIError(504, f"not answered within {self.timeout_s:g} s", code="timeout")

    async def tokenize_text(self, body: TokenizeRequest, request: Request) -> Response:
        """``POST /tokenize``: the ids the model would see for ``prompt`` (vLLM's body)."""
        ids = await self._tokenizer_call("token_ids", request, "prompt", len(body.prompt),
                                         self.settings.max_input_chars, "characters", INLINE_TOKENIZE_CHARS,
                                         body.prompt, body.add_special_tokens)
        out = {"count": len(ids), "max_model_len": self.max_length, "tokens": ids}
        return Response(orjson.dumps(out), media_type="application/json")

    async def detokenize(self, body: DetokenizeRequest, request: Request) -> Response:
        """``POST /detokenize``: the text of ``tokens`` (ids outside the vocabulary are a 400)."""
        text = await self._tokenizer_call("detokenize", request, "tokens", len(body.tokens),
                                          self.settings.max_input_tokens, "ids", INLINE_TOKENIZE_IDS,
                                          body.tokens)
        return Response(orjson.dumps({"prompt": text}), media_type="application/json")

    async def _tokenizer_call(self, method: str, request: Request, param: str, size: int, limit: int,
                              unit: str, inline: int, *args: Any) -> Any:
        """The executor's tokenizer ``method(*args)``, refused when the model has none or the input is
        over ``limit``; on the loop when ``size`` is at most ``inline``."""
        fn = getattr(self.executor, method, None)
        if fn is None:
            raise APIError(400, f"{self.model_name} has no tokenizer", code="unsupported_task", param="model")
        if size > limit:
            raise APIError(400, f"{param} has {size} {unit}; at most {limit}", code="input_too_long",
                           param=param)
        return await self.tokenize_off_loop(functools.partial(fn, *args), cheap=size <= inline,
                                            request=request)

    async def close(self) -> None:
        await self.watchdog.stop()
        await self.batcher.shutdown(self.settings.drain_timeout_s)
        self.tokenizer_pool.shutdown(wait=False, cancel_futures=True)


def header_num(request: Request, name: str, kind: type[Num]) -> Num | None:
    """A numeric header: an int within the priority range, or a finite float; anything else is 400."""
    raw = request.headers.get(name)
    if raw is None:
        return None
    value: Num | None = None
    try:
        value = kind(raw)
        ok = -PRIORITY_MAX <= value <= PRIORITY_MAX if kind is int else math.isfinite(value)
    except (ValueError, OverflowError):
        ok = False
    if not ok:
        shown = raw if len(raw) <= 40 else raw[:40] + "..."
        what = f"an integer in [-{PRIORITY_MAX}, {PRIORITY_MAX}]" if kind is int else "a finite number"
        raise APIError(400, f"header {name} must be {what}, got {shown!r}", code="invalid_value", param=name)
    return value


async def _disconnected(request: Request) -> None:
    """Returns when the client goes away (the body is already read, so the next message is a disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
