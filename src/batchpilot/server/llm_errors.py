"""How an LLM request's failure reaches its client: an error body before the response starts, an SSE
error event (``data: {"error": {...}}``) once a stream has. One fixed message per code; whatever an
exception says about the internals goes to the log, never to the client. Only ``RequestRejected``
(what the request asked for against what the engine allows) is passed on as written."""

from __future__ import annotations

import json
import logging

from batchpilot.runtime.llm_errors import (
    EngineBusy,
    EngineStopped,
    EngineUnavailable,
    GenerationFailed,
    RequestRejected,
)
from batchpilot.server.errors import APIError, error_body

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
