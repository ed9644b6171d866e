"""Errors in the OpenAI format: ``{"error": {"message", "type", "param", "code"}}``.

Every route raises ``APIError``; the app installs ``install_error_handlers`` so validation errors,
unknown routes and unexpected exceptions all come back in this shape, never as a stack trace.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("batchpilot.server")

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          413: "invalid_request_error", 422: "invalid_request_error", 429: "rate_limit_error",
          503: "service_unavailable", 504: "timeout"}


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


def error_body(status: int, message: str, code: str | None = None, param: str | None = None,
               err_type: str | None = None) -> dict[str, Any]:
    default = "server_error" if status >= 500 else "invalid_request_error"
    return {"error": {"message": message, "type": err_type or _TYPES.get(status, default),
                      "param": param, "code": code}}


def error_response(err: APIError) -> JSONResponse:
    headers = {}
    if err.retry_after_s is not None:
        headers["Retry-After"] = str(max(1, int(err.retry_after_s + 0.999)))
    return JSONResponse(error_body(err.status, err.message, err.code, err.param, err.err_type),
                        status_code=err.status, headers=headers)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        errs = exc.errors()
        first = errs[0] if errs else {}
        loc = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        text = str(first.get("msg", "invalid request"))
        msg = f"{loc}: {text}" if loc else text
        return JSONResponse(error_body(422, msg, code="invalid_value", param=loc or None), status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(error_body(exc.status_code, str(exc.detail)), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return JSONResponse(error_body(500, "internal server error", code="internal_error"), status_code=500)
