"""Errors in the OpenAI format: ``{"error": {"message", "type", "param", "code"}}``.

Every route raises ``APIError``; the app installs ``install_error_handlers`` so validation errors,
unknown routes and unexpected exceptions all come back in this shape, never as a stack trace.

A 500 never carries the text it was raised with: the client gets a fixed message per code
(``FIXED_500``) and the request's id (``error.request_id``, also the ``X-Request-Id`` header, which the
request middleware puts on every response); the raised text goes to the log under that id. Error
bodies are encoded as ASCII JSON, so no input (a lone surrogate, say) can break the encoding of a 4xx.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("batchpilot.server")

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          408: "invalid_request_error", 413: "invalid_request_error", 422: "invalid_request_error",
          429: "rate_limit_error", 503: "service_unavailable", 504: "timeout"}
FIXED_500 = {
    "model_error": "the model failed on this request; the server log has the detail under its request id",
    "internal_error": "internal server error; the server log has the detail under its request id",
}


class APIError(Exception):
    def __init__(self, status: int, message: str, *, code: str | None = None, param: str | None = None,
                 retry_after_s: float | None = None, err_type: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.retry_after_s = retry_after_s
        default = "server_error" if status >= 500 else "invalid_request_error"
        self.err_type = err_type or _TYPES.get(status, default)


class ClientStalled(Exception):
    """The client stopped reading its response: the send timed out (the connection is dropped)."""


class ErrorResponse(JSONResponse):
    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode()


def error_body(status: int, message: str, code: str | None = None, param: str | None = None,
               err_type: str | None = None, request_id: str | None = None) -> dict[str, Any]:
    default = "server_error" if status >= 500 else "invalid_request_error"
    err: dict[str, Any] = {"message": message, "type": err_type or _TYPES.get(status, default),
                           "param": param, "code": code}
    if request_id is not None:
        err["request_id"] = request_id
    return {"error": err}


def internal_error_body(code: str, request_id: str | None) -> dict[str, Any]:
    """The body of a 500: a fixed message for the code, and the id the log has the detail under."""
    return error_body(500, FIXED_500.get(code, FIXED_500["internal_error"]), code=code,
                      request_id=request_id)


def request_id_of(request: Request) -> str | None:
    state = request.scope.get("state") or {}
    rid = state.get("request_id")
    return rid if isinstance(rid, str) else None


def error_response(err: APIError, request_id: str | None = None) -> JSONResponse:
    headers = {}
    if err.retry_after_s is not None:
        headers["Retry-After"] = str(max(1, int(err.retry_after_s + 0.999)))
    if err.status == 500:
        log.error("request %s: 500 %s: %s", request_id or "-", err.code, err.message)
        body = internal_error_body(err.code or "internal_error", request_id)
    else:
        body = error_body(err.status, err.message, err.code, err.param, err.err_type,
                          request_id if err.status >= 500 else None)
    return ErrorResponse(body, status_code=err.status, headers=headers)


def validation_response(errors: Sequence[Any]) -> JSONResponse:
    """A 422 naming the first validation error (pydantic's ``errors()``; ``body`` left out of the path)."""
    first = errors[0] if errors else {}
    loc = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
    text = str(first.get("msg", "invalid request"))
    msg = f"{loc}: {text}" if loc else text
    return ErrorResponse(error_body(422, msg, code="invalid_value", param=loc or None), status_code=422)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc, request_id_of(request))

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_response(exc.errors())

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return ErrorResponse(error_body(exc.status_code, str(exc.detail)), status_code=exc.status_code,
                             headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        rid = request_id_of(request)
        if not isinstance(exc, ClientStalled):
            log.error("request %s: unhandled error", rid or "-", exc_info=exc)
            state = request.scope.get("state")
            if isinstance(state, dict):
                state["error_logged"] = True  # the middleware, which sees it next, does not log it again
        return ErrorResponse(internal_error_body("internal_error", rid), status_code=500)
