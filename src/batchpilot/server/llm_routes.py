"""OpenAI-compatible ``POST /v1/completions`` and ``POST /v1/chat/completions`` over the LLM engine.

``make_llm_router(engine, registry)`` returns a router the app includes (``batchpilot serve --llm``).
Streaming is SSE (``data: {chunk}`` lines, then ``data: [DONE]``); the first engine item is awaited
before the response starts, so a request that can never fit gets a normal 400 error body instead of
a broken stream. A client that disconnects mid-stream cancels the generator, which aborts the
sequence and frees its KV blocks; one that disconnects before its answer starts (non-streaming, or
waiting for the first token) is caught by ``_unless_client_leaves``, with the same effect.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry

from ..core.request import IdCounter
from ..runtime.llm_engine import EngineStopped, GenerationOutput, LLMEngine, RequestRejected, build_llm_engine
from .errors import APIError
from .llm_metrics import LLMMetrics
from .llm_schemas import ChatCompletionRequest, CompletionRequest, _SamplingFields

__all__ = ["build_llm_engine", "make_llm_router"]

# when the client gives no max_tokens: OpenAI's legacy completions default, and a bounded chat answer
# (OpenAI lets chat run to the context limit; a bound keeps one request from holding the engine)
DEFAULT_MAX_TOKENS = {"/v1/completions": 16, "/v1/chat/completions": 256}


def _sse(obj: dict[str, Any] | str) -> bytes:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n".encode()


def _usage(last: GenerationOutput) -> dict[str, Any]:
    usage: dict[str, Any] = {"prompt_tokens": last.num_prompt_tokens,
                             "completion_tokens": last.num_output_tokens,
                             "total_tokens": last.num_prompt_tokens + last.num_output_tokens}
    if last.num_cached_tokens:
        usage["prompt_tokens_details"] = {"cached_tokens": last.num_cached_tokens}
    return usage


def first_token_timing(received: float, first: GenerationOutput) -> dict[str, str]:
    """W3C ``Server-Timing`` of a stream's first token (the headers leave with it): ``tokenize`` = the
    handler's start -> the sequence in the engine (prompt encoding), ``engine`` = the engine's TTFT
    (queue, prefill, first token out of its step), ``app`` = the handler's start -> that token back on
    the event loop. ``app - tokenize - engine`` is the hand-off from the engine thread to the loop;
    the client's TTFT minus ``app`` is HTTP both ways (the load generator records each part)."""
    now = time.monotonic()
    return {"server-timing": f"tokenize;dur={max(first.arrival - received, 0.0) * 1e3:.3f}, "
                             f"engine;dur={max(first.emitted - first.arrival, 0.0) * 1e3:.3f}, "
                             f"app;dur={(now - received) * 1e3:.3f}"}


def make_llm_router(engine: LLMEngine, registry: CollectorRegistry) -> APIRouter:
    metrics = LLMMetrics(engine, registry)
    router = APIRouter(tags=["llm"])
    ids = IdCounter(1)

    async def start(prompt: str | list[int], body: _SamplingFields, route: str, gens: list[Any],
                    ) -> tuple[GenerationOutput, AsyncIterator[GenerationOutput]]:
        params = body.sampling_params(DEFAULT_MAX_TOKENS[route])
        gen = engine.generate(prompt, params, priority=body.priority)
        gens.append(gen)  # closed (aborting the sequence) if the client leaves before the answer
        try:
            first = await gen.__anext__()
        except RequestRejected as exc:
            metrics.requests.labels(route=route, finish_reason="rejected").inc()
            raise APIError(400, str(exc), code=exc.code, param=exc.param) from None
        except EngineStopped as exc:
            raise APIError(503, str(exc), code="engine_stopped") from None
        return first, gen

    async def collect(started: tuple[GenerationOutput, AsyncIterator[GenerationOutput]],
                      ) -> tuple[str, GenerationOutput]:
        first, gen = started
        parts, last = [], first
        async for item in _chain(first, gen):
            parts.append(item.text)
            last = item
        return "".join(parts), last

    def finished(route: str, last: GenerationOutput) -> None:
        metrics.requests.labels(route=route, finish_reason=last.finish_reason or "none").inc()
        metrics.prompt_tokens.inc(last.num_prompt_tokens)

    def _served_model(name: str | None) -> str:
        # OpenAI clients must name a model; a name this server does not serve is a 404, not silently ours
        if name and name != engine.model_name:
            raise APIError(404, f"model {name!r} does not exist; this server serves {engine.model_name!r}",
                           code="model_not_found", param="model")
        return engine.model_name

    @router.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Any:
        return await _unless_client_leaves(request, lambda gens: _completions(body, gens))

    async def _completions(body: CompletionRequest, gens: list[Any]) -> Any:
        received = time.monotonic()
        route, rid, created = "/v1/completions", f"cmpl-{ids()}", int(time.time())
        prompts = body.prompts()
        model = _served_model(body.model)
        if body.stream:
            if len(prompts) != 1:
                raise APIError(400, "streaming takes a single prompt", code="unsupported_value",
                               param="prompt")
            first, gen = await start(prompts[0], body, route, gens)
            timing = first_token_timing(received, first)

            async def events() -> AsyncIterator[bytes]:
                last = first
                async for item in _chain(first, gen):
                    last = item
                    yield _sse({"id": rid, "object": "text_completion", "created": created, "model": model,
                                "choices": [{"index": 0, "text": item.text, "logprobs": None,
                                             "finish_reason": item.finish_reason}]})
                finished(route, last)
                if body.include_usage:
                    yield _sse({"id": rid, "object": "text_completion", "created": created, "model": model,
                                "choices": [], "usage": _usage(last)})
                yield _sse("[DONE]")

            return StreamingResponse(events(), media_type="text/event-stream", headers=timing)

        choices, usage = [], {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
        # all prompts enter the engine before any is awaited, so they share batches
        started = [await start(prompt, body, route, gens) for prompt in prompts]
        results = await asyncio.gather(*(collect(s) for s in started))
        for i, (text, last) in enumerate(results):
            finished(route, last)
            choices.append({"index": i, "text": text, "logprobs": None, "finish_reason": last.finish_reason})
            for k, v in _usage(last).items():
                if k in usage:
                    usage[k] += v
        return JSONResponse({"id": rid, "object": "text_completion", "created": created, "model": model,
                             "choices": choices, "usage": usage})

    @router.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
        return await _unless_client_leaves(request, lambda gens: _chat_completions(body, gens))

    async def _chat_completions(body: ChatCompletionRequest, gens: list[Any]) -> Any:
        received = time.monotonic()
        route, rid, created = "/v1/chat/completions", f"chatcmpl-{ids()}", int(time.time())
        model = _served_model(body.model)
        try:
            prompt = engine.encode_chat(body.chat())
        except APIError:
            raise
        except Exception as exc:  # a template that rejects the conversation (e.g. role order)
            raise APIError(400, f"chat template failed: {exc}", code="invalid_value",
                           param="messages") from None
        first, gen = await start(prompt, body, route, gens)
        if body.stream:
            timing = first_token_timing(received, first)

            def chunk(delta: dict[str, Any], reason: str | None) -> dict[str, Any]:
                return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}]}

            async def events() -> AsyncIterator[bytes]:
                yield _sse(chunk({"role": "assistant", "content": ""}, None))
                last = first
                async for item in _chain(first, gen):
                    last = item
                    if item.text:
                        yield _sse(chunk({"content": item.text}, None))
                yield _sse(chunk({}, last.finish_reason))
                finished(route, last)
                if body.include_usage:
                    yield _sse({"id": rid, "object": "chat.completion.chunk", "created": created,
                                "model": model, "choices": [], "usage": _usage(last)})
                yield _sse("[DONE]")

            return StreamingResponse(events(), media_type="text/event-stream", headers=timing)

        text, last = await collect((first, gen))
        finished(route, last)
        return JSONResponse({
            "id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                         "finish_reason": last.finish_reason}],
            "usage": _usage(last),
        })

    return router


async def _unless_client_leaves(request: Request, work: Callable[[list[Any]], Awaitable[Any]]) -> Any:
    """Run a route's work while watching the connection. Until the response starts (the whole
    generation when not streaming; the first token when streaming) a client that disconnects is not
    noticed by Starlette, so its sequences would run to ``max_tokens`` for nobody: here the work is
    cancelled and every generator it started is closed, which aborts the sequences and frees their KV
    blocks. Once a StreamingResponse is returned, Starlette's own disconnect handling takes over."""
    gens: list[Any] = []
    task = asyncio.ensure_future(work(gens))
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if task in done:
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    for gen in gens:
        await gen.aclose()
    return Response(status_code=499)  # nobody reads it; logged as "client closed request"


async def _disconnected(request: Request) -> None:
    """Returns when the client goes away (the body is already read: the next message is a disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _chain(first: GenerationOutput, gen: AsyncIterator[GenerationOutput],
                 ) -> AsyncIterator[GenerationOutput]:
    """The primed first item, then the rest; closing this closes ``gen`` (which aborts the sequence)."""
    try:
        yield first
        if first.finish_reason is None:
            async for item in gen:
                yield item
    finally:
        await gen.aclose()  # type: ignore[attr-defined]
