"""OpenAI-compatible ``POST /v1/completions`` and ``POST /v1/chat/completions`` over the LLM engine.

``make_llm_router(engine, registry, limits)`` returns a router the app includes (``serve --llm``);
``engine`` is an ``LLMEngine`` or the failover in front of one (``runtime/llm/failover.py``).

    body ─▶ size limits (llm_limits, 400) ─▶ room in the engine? (503 + Retry-After) ─▶ tokenise in the
    engine's pool, off the event loop ─▶ submit every prompt of the request together ─▶ answer

Streaming is SSE (``data: {chunk}`` lines, then ``data: [DONE]``); the first token is awaited before the
response starts, so a request that cannot run gets a normal error body instead of a broken stream. A
stream that fails later ends with an SSE error event (``data: {"error": {...}}``). Every request has a
deadline (``core.llm.admission.request_deadline``): the engine's resolved ``request_timeout_s``, or sooner
with ``deadline_ms`` (body) or ``X-Deadline-Ms``; past it the answer is 504 (or the error event) and the
sequences are aborted. Its priority is ``priority``
(body) or else ``X-Priority`` (an integer; lower is served first under the engine's ``priority`` policy;
a header that is not one is a 400). A request whose client leaves, or one of whose prompts fails, has
all its sequences aborted and their KV blocks freed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextvars import ContextVar
from typing import TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry

from batchpilot.core.llm.admission import request_deadline
from batchpilot.core.llm.sequence import SamplingParams, StructuredOutput
from batchpilot.core.request import DEFAULT_TENANT, IdCounter
from batchpilot.core.rollout import PRIMARY
from batchpilot.runtime.llm.engine import (
    EngineBusy,
    EngineStopped,
    EngineUnavailable,
    GenerationFailed,
    GenerationOutput,
    GenerationStream,
    OverQuota,
    RequestRejected,
    RequestTimedOut,
)
from batchpilot.runtime.llm.failover import LLMFailover
from batchpilot.server.arms import ARM_HEADER, LLMArms
from batchpilot.server.errors import APIError, error_body
from batchpilot.server.llm.answers import (
    Chunks,
    TokenText,
    best,
    chat_choice,
    collect,
    completion_choice,
    first_token_timing,
    usage_of,
)
from batchpilot.server.llm.metrics import LLMMetrics
from batchpilot.server.llm.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    LLMLimits,
    _SamplingFields,
    header_deadline_ms,
)
from batchpilot.server.llm.served import ServedEngine
from batchpilot.server.service import header_num
from batchpilot.server.tenants import tenant_of

# How an LLM request's failure reaches its client: an error body before the response starts, an SSE
# error event (``data: {"error": {...}}``) once a stream has. One fixed message per code; whatever an
# exception says about the internals goes to the log, never to the client. Only ``RequestRejected``
# (what the request asked for against what the engine allows) is passed on as written.

log = logging.getLogger("batchpilot.server")

MESSAGES = {
    "engine_stopped": (503, "the LLM engine is not running"),
    "engine_unavailable": (503, "the LLM engine is unavailable; retry later"),
    "queue_full": (503, "the LLM engine's queue is full; retry later"),
    "timeout": (504, "the request was not answered within its time limit"),
    "generation_failed": (500, "generation failed"),
    "internal_error": (500, "internal server error"),
}


def fixed(code: str, retry_after_s: float | None = None) -> APIError:
    status, message = MESSAGES[code]
    return APIError(status, message, code=code, retry_after_s=retry_after_s)


def to_api_error(exc: BaseException) -> APIError:
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, RequestRejected):
        return APIError(400, str(exc), code=exc.code, param=exc.param)
    if isinstance(exc, OverQuota):
        return APIError(429, str(exc), code=exc.code, retry_after_s=exc.retry_after_s)
    if isinstance(exc, EngineBusy):
        return fixed("queue_full", exc.retry_after_s)
    if isinstance(exc, EngineUnavailable):
        return fixed("engine_unavailable", exc.retry_after_s)
    if isinstance(exc, EngineStopped):
        return fixed("engine_stopped")
    if isinstance(exc, TimeoutError):
        return fixed("timeout")
    if isinstance(exc, GenerationFailed):
        return fixed("generation_failed")
    log.error("llm request failed", exc_info=exc)
    return fixed("internal_error")


def sse_error(exc: BaseException) -> bytes:
    err = to_api_error(exc)
    body = error_body(err.status, err.message, err.code, err.param, err.err_type)
    return f"data: {json.dumps(body)}\n\n".encode()


T = TypeVar("T")

# an engine's own failures: on a candidate arm, faults that the primary answers instead
_ENGINE_FAULTS = ("generation_failed", "engine_unavailable")
# the engine answering this request and its metrics (an arm's, with arms), set by the route's attempt
_served: ContextVar[tuple[ServedEngine, LLMMetrics]] = ContextVar("batchpilot_llm_served")
# who the request is for and the tenant's weight (the engine's fair order), set by the route's attempt
_tenant: ContextVar[tuple[str, float]] = ContextVar("batchpilot_llm_tenant", default=(DEFAULT_TENANT, 1.0))

# when the client gives no max_tokens: OpenAI's legacy completions default, and a bounded chat answer
# (OpenAI lets chat run to the context limit; a bound keeps one request from holding the engine)
DEFAULT_MAX_TOKENS = {"/v1/completions": 16, "/v1/chat/completions": 256}
# a route's work: (requests, received, deadline, priority)
Work = Callable[[list[GenerationStream], float, float, int], Awaitable[Response]]


def make_llm_router(engine: ServedEngine, registry: CollectorRegistry,
                    limits: LLMLimits | None = None, arms: LLMArms | None = None) -> APIRouter:
    """The routes over ``engine``, or over ``arms`` (``server/arms.py``: each request assigned an
    arm's engine, its outcome recorded for the comparison and rollback; a candidate that fails before
    its response starts is retried on the primary)."""
    routes = LLMRoutes(engine, registry, limits or LLMLimits(), arms)
    router = APIRouter(tags=["llm"])

    # ``object``, not ``Response``: the answer is JSON or an SSE stream, which FastAPI documents as an
    # untyped answer (the OpenAPI schema as it was under ``Any``); a returned Response is sent as it is
    @router.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> object:
        return await routes.answer("/v1/completions", body, request,
                                   functools.partial(routes.completions, body))

    @router.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> object:
        return await routes.answer("/v1/chat/completions", body, request,
                                   functools.partial(routes.chat_completions, body))

    return router


class LLMRoutes:
    """What the two routes share: the engine (or its arms), the metrics of each arm, the limits."""

    def __init__(self, engine: ServedEngine, registry: CollectorRegistry, limits: LLMLimits,
                 arms: LLMArms | None) -> None:
        self.engine, self.limits, self.arms = engine, limits, arms
        if arms is None:
            self.per_arm = {"": LLMMetrics(engine, registry)}
        else:
            regs = arms.register(registry)
            self.per_arm = {name: LLMMetrics(e, regs[name]) for name, e in arms.engines.items()}
        self.ids = IdCounter(1)
        self.max_len = int(engine.config.max_model_len)
        self.token_text = TokenText(engine.prompts.tokenizer)  # logprobs' token strings

    def served_model(self, name: str | None) -> str:
        # OpenAI clients must name a model; a name this server does not serve is a 404, not silently ours
        served = self.engine.model_name
        if name and name != served:
            raise APIError(404, f"model {name!r} does not exist; this server serves {served!r}",
                           code="model_not_found", param="model")
        return served

    def deadline_of(self, body: _SamplingFields, request: Request, received: float) -> float:
        ms = body.deadline_ms if body.deadline_ms is not None else header_deadline_ms(
            request.headers.get("x-deadline-ms"))
        return request_deadline(self.engine.config, received, None if ms is None else ms / 1000.0)

    @staticmethod
    def tenant_of(body: _SamplingFields, request: Request) -> tuple[str, float]:
        """Who the request is for (its key's tenant, else ``X-Client-Id``, else the body's ``user``:
        ``server/tenants.tenant_of``) and that tenant's weight in the keys file (1 without one)."""
        user = (body.model_extra or {}).get("user")
        tenant = tenant_of(request, user if isinstance(user, str) else None)
        tenancy = getattr(request.app.state, "tenancy", None)
        return tenant, float(tenancy.table.spec(tenant).weight) if tenancy is not None else 1.0

    def priority_of(self, body: _SamplingFields, request: Request) -> int:
        """The request's priority (``priority``, else ``X-Priority``); one other than 0 sent to an engine that
        does not order by it is a 400 naming the flag that would honour it."""
        priority = body.priority if body.priority is not None else int(
            header_num(request, "x-priority", int) or 0)  # the embeddings routes' header rule
        policy = self.engine.config.policy
        if priority and policy != "priority":
            raise APIError(400, f"priority {priority} is honoured only by an engine started with "
                           f"--scheduling-policy priority; this one schedules {policy}",
                           code="unsupported_value", param="priority")
        return priority

    async def answer(self, route: str, body: _SamplingFields, request: Request, work: Work) -> Response:
        received = time.monotonic()
        arms = self.arms
        if arms is None:
            return await self.attempt(route, body, request, work, received, "", self.engine)
        arm, chosen = arms.armed.pick(request)
        try:
            return await self.attempt(route, body, request, work, received, arm, chosen)
        except APIError as exc:  # a candidate failed before its response started: the primary answers
            if arm == PRIMARY or exc.code not in _ENGINE_FAULTS:
                raise
            failed_s = time.monotonic() - received
            out = await self.attempt(route, body, request, work, received, PRIMARY, arms.engines[PRIMARY],
                                     record=False)  # its time includes the candidate's attempt
            arms.armed.record(arm, 500, failed_s)  # the primary answered it: the candidate's fault
            return out

    async def attempt(self, route: str, body: _SamplingFields, request: Request, work: Work,
                      received: float, arm: str, chosen: ServedEngine, record: bool = True) -> Response:
        arms = self.arms
        token = _served.set((chosen, self.per_arm[arm]))
        try:
            deadline = self.deadline_of(body, request, received)
            priority = self.priority_of(body, request)
            _tenant.set(self.tenant_of(body, request))
            out = await _guarded(request, deadline, lambda reqs: work(reqs, received, deadline, priority))
            if arms is not None:
                if record:
                    arms.armed.record(arm, out.status_code, time.monotonic() - received)
                out.headers[ARM_HEADER] = arm
            return out
        except Exception as exc:
            err = to_api_error(exc)
            reason = "rejected" if err.status < 500 else err.code or "error"
            if err.status not in (404, 422):
                self.per_arm[arm].requests.labels(route=route, finish_reason=reason).inc()
            # a candidate's engine failure is charged by ``answer`` once the primary has answered it
            if arms is not None and record and not (arm != PRIMARY and err.code in _ENGINE_FAULTS):
                arms.armed.record(arm, err.status, time.monotonic() - received)
            raise err from None
        finally:
            _served.reset(token)

    @staticmethod
    def finished(route: str, last: GenerationOutput, metrics: LLMMetrics) -> None:
        metrics.requests.labels(route=route, finish_reason=last.finish_reason or "none").inc()
        metrics.prompt_tokens.inc(last.num_prompt_tokens)

    @staticmethod
    def submit(prompts: list[list[int]], params: SamplingParams, priority: int, deadline: float,
               stream: bool, n: int = 1) -> Sequence[GenerationStream]:
        target, who = _served.get()[0], _tenant.get()
        if isinstance(target, LLMFailover):  # an answer not streamed can restart on the fallback
            return target.submit(prompts, params, priority, deadline, n, who, replayable=not stream)
        return target.submit(prompts, params, priority, deadline, n, who)

    async def params_of(self, body: _SamplingFields, route: str, constraint: StructuredOutput | None = None,
                        param: str = "") -> SamplingParams:
        """The request's sampling params; a structured-output constraint is compiled first (off the event
        loop: a refused one is a 400 with the grammar library's reason, before any tokenising)."""
        params = body.sampling_params(DEFAULT_MAX_TOKENS[route], self.limits, self.max_len,
                                      self.engine.prompts.vocab_size, constraint)
        if constraint is not None:
            await self.engine.prompts.check_constraint_async(constraint, param)
        return params

    async def completions(self, body: CompletionRequest, reqs: list[GenerationStream], received: float,
                          deadline: float, priority: int) -> Response:
        route, rid, created = "/v1/completions", f"cmpl-{self.ids()}", int(time.time())
        target, metrics = _served.get()
        model = self.served_model(body.model)
        prompts = body.prompts()
        self.limits.check_prompts(prompts, self.max_len)
        params = await self.params_of(body, route, *body.constraint())
        samples, n = body.samples, body.n
        if samples > n and params.logprobs is None:  # best_of ranks by logprob: computed, not shown
            params = dataclasses.replace(params, logprobs=0)
        target.check_room(len(prompts) * samples, _tenant.get()[0])  # before the tokenising it would waste
        token_ids = await _all_or_none([self.engine.prompts.encode_async(p) for p in prompts])
        reqs.extend(self.submit(token_ids, params, priority, deadline, body.stream, samples))
        text = self.token_text if body.logprobs is not None else None
        head: dict[str, object] = {"id": rid, "object": "text_completion", "created": created, "model": model}
        if body.stream:
            firsts = await _all_or_none([anext(r) for r in reqs])
            chunks = Chunks(head, chat=False, text=text, include_usage=body.include_usage, samples=samples)
            events = chunks.events(firsts, reqs, lambda last: self.finished(route, last, metrics))
            return _stream(events, reqs, first_token_timing(received, firsts[0]))
        answers = await _all_or_none([collect(r) for r in reqs])
        for a in answers:
            self.finished(route, a.last, metrics)
        kept = [a for i in range(0, len(answers), samples) for a in best(answers[i : i + samples], n)]
        return JSONResponse({**head, "choices": [completion_choice(i, a, text) for i, a in enumerate(kept)],
                             "usage": usage_of([a.last for a in answers], samples)})

    async def chat_completions(self, body: ChatCompletionRequest, reqs: list[GenerationStream],
                               received: float, deadline: float, priority: int) -> Response:
        route, rid, created = "/v1/chat/completions", f"chatcmpl-{self.ids()}", int(time.time())
        target, metrics = _served.get()
        model = self.served_model(body.model)
        messages = body.chat()
        self.limits.check_messages([m["content"] for m in messages])
        tools = body.tool_plan()
        constraint, param = (tools.constraint(), "tools") if tools is not None else body.constraint()
        if tools is not None and body.constraint()[0] is not None:
            raise APIError(400, "a forced tool call is already a structured output: drop response_format",
                           code="invalid_value", param="response_format")
        params = await self.params_of(body, route, constraint, param)
        target.check_room(body.n, _tenant.get()[0])
        prompt = await self.engine.prompts.encode_chat_async(messages)
        reqs.extend(self.submit([prompt], params, priority, deadline, body.stream, body.n))
        text = self.token_text if body.logprobs else None
        if body.stream:
            firsts = await _all_or_none([anext(r) for r in reqs])
            head: dict[str, object] = {"id": rid, "object": "chat.completion.chunk", "created": created,
                                       "model": model}
            chunks = Chunks(head, chat=True, text=text, tools=tools, include_usage=body.include_usage,
                            samples=body.n)
            events = chunks.events(firsts, reqs, lambda last: self.finished(route, last, metrics))
            return _stream(events, reqs, first_token_timing(received, firsts[0]))
        answers = await _all_or_none([collect(r) for r in reqs])
        for a in answers:
            self.finished(route, a.last, metrics)
        return JSONResponse({
            "id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": [chat_choice(i, a, text, tools) for i, a in enumerate(answers)],
            "usage": usage_of([a.last for a in answers], body.n),
        })


async def _guarded(request: Request, deadline: float,
                   work: Callable[[list[GenerationStream]], Awaitable[Response]]) -> Response:
    """Run a route's work while watching the connection and the deadline. Until the response starts (the
    whole generation when not streaming; the first token when streaming) a client that disconnects is
    not noticed by Starlette, so its sequences would run to ``max_tokens`` for nobody. When the client
    leaves, the deadline passes or the work fails, every request the work submitted is closed: its
    sequences are aborted and their KV blocks freed. A returned StreamingResponse owns its request."""
    reqs: list[GenerationStream] = []
    handed_over = False
    task = asyncio.ensure_future(work(reqs))
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        done: set[asyncio.Future[Response] | asyncio.Future[None]] = set()
        # a timer may fire a little before its time (the loop's clock granularity): wait until the
        # deadline has come by the core's rule (``past_deadline``), which the engine's count checks
        while not done and time.monotonic() < deadline:
            done, _ = await asyncio.wait({task, watch}, timeout=max(0.0, deadline - time.monotonic()),
                                         return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            result = task.result()  # raises what the work raised
            handed_over = True
            return result
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        if watch in done:
            return Response(status_code=499)  # nobody reads it; logged as "client closed request"
        raise RequestTimedOut
    finally:
        watch.cancel()
        task.cancel()
        if not handed_over:
            for req in reqs:
                req.close()


async def _all_or_none(coros: list[Awaitable[T]]) -> list[T]:
    """Every result, or the first failure with the rest cancelled (the caller closes their requests)."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for t in tasks:  # in order: the first prompt that failed, even while later ones still run
            if t in done and t.exception() is not None:
                raise t.exception()  # type: ignore[misc]
        return [t.result() for t in tasks]
    finally:
        for t in tasks:
            t.cancel()


def _stream(events: AsyncIterator[bytes], reqs: Sequence[GenerationStream], headers: dict[str, str]
            ) -> StreamingResponse:
    """The SSE response: a failure mid-way becomes an error event, then the stream ends; however it
    ends (finished, failed, client gone) its requests are closed."""
    async def guarded() -> AsyncIterator[bytes]:
        try:
            async for chunk in events:
                yield chunk
        except Exception as exc:
            yield sse_error(exc)
        finally:
            for req in reqs:
                req.close()

    return StreamingResponse(guarded(), media_type="text/event-stream", headers=headers)


async def _disconnected(request: Request) -> None:
    """Returns when the client goes away (the body is already read: the next message is a disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
