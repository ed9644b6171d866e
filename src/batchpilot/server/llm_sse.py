"""The SSE bodies of streamed completions and chat completions, and the headers and usage they carry.

Each generator starts from the request's first output (awaited before the response starts) and reads
the rest from the request; ``on_finish`` gets the last output. Errors are not handled here: the route
turns one into an error event (``llm_routes._stream``).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from batchpilot.runtime.llm_engine import GenerationOutput, LLMRequest

OnFinish = Callable[[GenerationOutput], None]


def sse(obj: dict[str, Any] | str) -> bytes:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n".encode()


def usage_of(last: GenerationOutput) -> dict[str, Any]:
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


async def outputs(first: GenerationOutput, req: LLMRequest) -> AsyncIterator[GenerationOutput]:
    """The primed first output, then the rest."""
    yield first
    if first.finish_reason is None:
        async for item in req:
            yield item


async def completion_events(head: dict[str, Any], first: GenerationOutput, req: LLMRequest,
                            include_usage: bool, on_finish: OnFinish) -> AsyncIterator[bytes]:
    last = first
    async for item in outputs(first, req):
        last = item
        yield sse({**head, "choices": [{"index": 0, "text": item.text, "logprobs": None,
                                        "finish_reason": item.finish_reason}]})
    on_finish(last)
    if include_usage:
        yield sse({**head, "choices": [], "usage": usage_of(last)})
    yield sse("[DONE]")


async def chat_events(head: dict[str, Any], first: GenerationOutput, req: LLMRequest,
                      include_usage: bool, on_finish: OnFinish) -> AsyncIterator[bytes]:
    def chunk(delta: dict[str, Any], reason: str | None) -> bytes:
        return sse({**head, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                         "finish_reason": reason}]})

    yield chunk({"role": "assistant", "content": ""}, None)
    last = first
    async for item in outputs(first, req):
        last = item
        if item.text:
            yield chunk({"content": item.text}, None)
    yield chunk({}, last.finish_reason)
    on_finish(last)
    if include_usage:
        yield sse({**head, "choices": [], "usage": usage_of(last)})
    yield sse("[DONE]")
