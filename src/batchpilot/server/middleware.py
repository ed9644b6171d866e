"""The request lifecycle, one ASGI middleware around the FastAPI app, outermost, before any parsing:

    request head ─▶ not complete within ``header_timeout_s``: 408, closed by the HTTP protocol before
                    this middleware runs (``header_timeout.py``; counted here, ``count_header_timeout``)
    request ─▶ draining? 503 shutting_down (/health: 503 "draining"; /metrics still answers)
            ─▶ Bearer API key (every route but /health) ─▶ 401; the key names the request's tenant
               (``server/tenants.py``; without keys, the ``X-Client-Id`` header may name it)
            ─▶ Content-Length over the limit ─▶ 413, before a byte of the body is read
            ─▶ the body, bounded (413) and within ``body_timeout_s`` of the headers (else 408 and the
               connection closed: a slow-loris upload holds nothing for long)
               · the request counts as in flight from its first body byte: a connection that sent
                 headers and stalls holds no slot, and the drain does not wait for it
            ─▶ its JSON structure (``json_shape``): over ``max_json_values`` / ``max_json_containers``
               ─▶ 413 too_many_values, before ``json.loads`` builds millions of objects
            ─▶ the app, with every response send bounded by ``send_timeout_s`` (a client that stops
               reading is dropped, and whatever its handler held is released)
            ─▶ any exception that escapes: 500 with a fixed message and the request id; the detail
               goes to the log under that id

Every response carries ``X-Request-Id`` (the client's own, when it sent a sane one). This is the one
owner of the shutdown state: ``drain()`` stops admission and waits for the in-flight count to reach
zero (``lifecycle.GracefulServer`` calls it on SIGTERM). It decides nothing about load: the concurrency
limit is the core's (``admission.max_concurrent_requests``), so the simulator applies it too.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import re
import secrets
from dataclasses import dataclass
from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from batchpilot.server.config import ServerConfig
from batchpilot.server.errors import ClientStalled, error_body, internal_error_body
from batchpilot.server.tenants import TENANT_KEY, Tenancy, client_tenant

# How many JSON values and containers a raw body holds, counted without parsing it.
#
# ``json.loads`` turns three bytes of ``{},`` into a 64-byte dict, and pydantic then builds an error
# object per bad item: a 16 MiB body of ``[{}, {}, ...]`` costs hundreds of MB before the first error is
# read. The request middleware refuses a body whose structure is over the limits before anything parses
# it. It counts commas and ``{`` / ``[`` outside strings with vectorised byte comparisons in 1 MiB
# pieces (numpy releases the GIL, so a large body is scanned in a worker thread without stalling the
# event loop); for valid JSON the value count is an upper bound, exact but for empty containers.

_CHUNK = 1 << 20
EARLY_SCAN_BYTES = 1 << 20  # a body still arriving is scanned on the loop only up to this size
_QUOTE, _BACKSLASH, _COMMA, _LBRACE, _LBRACKET = 0x22, 0x5C, 0x2C, 0x7B, 0x5B


@dataclass(frozen=True)
class JSONShape:
    values: int  # scalars and containers outside strings: commas + containers + 1 (an upper bound)
    containers: int  # objects and arrays


def json_shape(body: bytes | bytearray) -> JSONShape:
    """The counts for ``body`` (UTF-8 JSON; any bytes give some bound)."""
    values = containers = 0
    inside = 0  # 1 while the scan is inside a string, carried across pieces
    start, n = 0, len(body)
    while start < n:
        end = min(n, start + _CHUNK)
        while end < n and body[end - 1] == _BACKSLASH:  # never split an escape
            end += 1
        part = body[start:end]
        if b"\\" in part:  # drop escaped backslashes and quotes: every quote left delimits a string
            part = part.replace(b"\\\\", b"").replace(b'\\"', b"")
        a = np.frombuffer(part, dtype=np.uint8)
        if a.size:
            parity = (np.cumsum(a == _QUOTE, dtype=np.uint8) + np.uint8(inside)) & 1
            outside = parity == 0
            containers += int(np.count_nonzero(((a == _LBRACE) | (a == _LBRACKET)) & outside))
            values += int(np.count_nonzero((a == _COMMA) & outside))
            inside = int(parity[-1])
        start = end
    return JSONShape(values=values + containers + (1 if n else 0), containers=containers)


def over_limits(shape: JSONShape, max_containers: int, max_values: int) -> str | None:
    if shape.containers > max_containers:
        return f"more than {max_containers} JSON objects and arrays"
    if shape.values > max_values:
        return f"more than {max_values} JSON values"
    return None


class ShapeWatch:
    """The JSON structure limits, watched while a body arrives (the request middleware feeds it).

    Counting ``{ [ ,`` in the raw bytes (``bytes.count``: C speed) bounds the real counts from above
    (some may sit inside strings), so nothing more is done while the raw counts are within the limits
    (``suspect`` stays False: the finished body needs no scan). Once they are over, the string-aware
    scan (``json_shape``) of what has arrived decides, at doubling sizes up to ``EARLY_SCAN_BYTES``
    (on the event loop, so bounded): a structure bomb is refused after its first few hundred KB
    instead of after all 16 MiB. A larger suspect body is scanned whole once it is in (in a thread)."""

    def __init__(self, max_containers: int, max_values: int) -> None:
        self.max_containers, self.max_values = max_containers, max_values
        self.containers = self.values = 0
        self.suspect = False
        self.over: str = ""
        self._next_scan = 0

    def feed(self, chunk: bytes, body: bytearray) -> bool:
        """False when what has arrived is already over a limit (``over`` says which)."""
        if not self.suspect:
            self.containers += chunk.count(b"{") + chunk.count(b"[")
            self.values += chunk.count(b",")
            self.suspect = (self.containers > self.max_containers
                            or self.values + self.containers + 1 > self.max_values)
        if not self.suspect or len(body) < self._next_scan or len(body) > EARLY_SCAN_BYTES:
            return True
        self._next_scan = 2 * len(body)
        over = over_limits(json_shape(body), self.max_containers, self.max_values)
        if over is None:
            return True
        self.over = over
        return False


log = logging.getLogger("batchpilot.server")


DRAIN_RETRY_AFTER_S = 5
OPEN_PATHS = frozenset({"/health"})
_SCAN_INLINE_BYTES = 64 * 1024  # smaller bodies are scanned on the loop; larger ones in a thread
_CLIENT_ID = re.compile(rb"[A-Za-z0-9._:-]{1,64}")
_ID_PREFIX = secrets.token_hex(4)  # per process: ids from several replicas do not collide
_ID_COUNTER = itertools.count(1)


class RequestLifecycle:
    """ASGI middleware: auth, body limits with a read deadline, in-flight counting, drain, request ids,
    the last-resort 500. ``.app`` is the FastAPI app; ``.state`` its state (``.state.service``)."""

    def __init__(self, app: ASGIApp, settings: ServerConfig, registry: CollectorRegistry | None = None,
                 tenancy: Tenancy | None = None) -> None:
        self.app = app
        self.state = getattr(app, "state", None)
        self.settings = settings
        self.tenancy = tenancy or Tenancy.of(settings.api_keys, settings.api_key)
        self.in_flight = 0
        self.draining = False
        self.refused = 0  # requests refused while draining
        self.timed_out = 0  # bodies that did not arrive in time (408)
        self.header_timeouts = 0  # request heads that did not arrive in time (408, header_timeout.py)
        self.stalled = 0  # clients dropped for not reading their response
        self._idle: asyncio.Event | None = None
        self._refusals: Counter | None = None
        if registry is not None:
            Gauge("batchpilot_http_in_flight", "HTTP requests in flight, counted from their first body byte",
                  registry=registry).set_function(lambda: self.in_flight)
            self._refusals = Counter("batchpilot_http_refusals", "requests answered before any route "
                                     "ran (by the middleware, or the header deadline), by reason", ["reason"],
                                     registry=registry)

    def _count(self, reason: str) -> None:
        if self._refusals is not None:
            self._refusals.labels(reason=reason).inc()

    def count_header_timeout(self) -> None:
        """A request whose headers did not arrive in time, answered 408 by the HTTP protocol before
        any app saw it (``header_timeout.HeaderDeadlineProtocol``): counted with the refusals."""
        self.header_timeouts += 1
        self._count("header_timeout")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = _request_id(scope)
        scope.setdefault("state", {})["request_id"] = rid
        sender = _Sender(send, rid.encode(), self.settings.send_timeout_s)
        counted = False
        try:
            if self.draining and scope["path"] != "/metrics":
                await self._refuse_draining(scope, sender)
                return
            refusal = self._check_headers(scope)
            if refusal is not None:
                self._count(refusal[2])
                await send_error(sender, *refusal)
                return
            body, counted = await self._read_body(scope, receive, sender)
            if body is None:
                return
            await self.app(scope, _replay(body, receive), sender)
        except ClientStalled:
            self.stalled += 1
            self._count("client_stalled")
            log.warning("request %s: the client read nothing for %.0f s; dropping the connection", rid,
                        self.settings.send_timeout_s)
        except Exception:
            if not scope["state"].get("error_logged"):
                log.exception("request %s: unhandled error", rid)
            if not sender.started:
                await _send_json(sender, 500, internal_error_body("internal_error", rid))
        finally:
            if counted:
                self.in_flight -= 1
                if self.in_flight == 0 and self._idle is not None:
                    self._idle.set()

    def _check_headers(self, scope: Scope) -> tuple[int, str, str] | None:
        headers = dict(scope["headers"])
        if scope["path"] not in OPEN_PATHS:
            tenancy = self.tenancy
            if tenancy.requires_key:
                tenant = tenancy.authenticate(headers.get(b"authorization"))
                if tenant is None:
                    return 401, "missing or wrong API key: send Authorization: Bearer <key>", \
                        "invalid_api_key"
            else:
                tenant = client_tenant(headers)
            if tenant is not None:
                scope["state"][TENANT_KEY] = tenant
        length = headers.get(b"content-length")
        if length is not None:
            if not length.isdigit():
                return 400, "invalid Content-Length", "invalid_request"
            if len(length) > 18 or int(length) > self.settings.max_body_bytes:
                return 413, f"request body over {self.settings.max_body_bytes} bytes", "body_too_large"
        return None

    async def _read_body(self, scope: Scope, receive: Receive, send: _Sender) -> tuple[bytes | None, bool]:
        """The whole body, or None when it was refused (the answer is sent). The bool: counted in flight."""
        limit = self.settings.max_body_bytes
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settings.body_timeout_s
        body, counted, more = bytearray(), False, True
        shape = ShapeWatch(self.settings.max_json_containers, self.settings.max_json_values)
        try:
            async with asyncio.timeout_at(deadline):  # one timer for the whole body, not one per message
                while more:
                    message = await receive()
                    if message["type"] != "http.request":
                        return None, counted  # the client left before its body was complete
                    if not counted:
                        if self.draining:
                            await self._refuse_draining(scope, send)
                            return None, False
                        self.in_flight += 1
                        counted = True
                    chunk = message.get("body", b"")
                    body += chunk
                    more = message.get("more_body", False)
                    if len(body) > limit:
                        self._count("body_too_large")
                        await send_error(send, 413, f"request body over {limit} bytes", "body_too_large")
                        return None, counted
                    if not shape.feed(chunk, body):  # a structure bomb: refused as it arrives
                        await self._refuse_shape(shape.over, send, close=more)
                        return None, counted
        except TimeoutError:
            self.timed_out += 1
            self._count("body_timeout")
            await send_error(send, 408, f"the request body did not arrive within "
                             f"{self.settings.body_timeout_s:g} s", "body_timeout", close=True)
            return None, counted
        if body and shape.suspect and not await self._shape_ok(body, send):  # scanned in place, no copy
            return None, counted
        return bytes(body), counted

    async def _shape_ok(self, body: bytearray, send: _Sender) -> bool:
        if len(body) <= _SCAN_INLINE_BYTES:
            found = json_shape(body)
        else:
            found = await asyncio.to_thread(json_shape, body)
        over = over_limits(found, self.settings.max_json_containers, self.settings.max_json_values)
        if over is None:
            return True
        await self._refuse_shape(over, send)
        return False

    async def _refuse_shape(self, what: str, send: _Sender, close: bool = False) -> None:
        self._count("too_many_values")
        await send_error(send, 413, f"request body has {what}", "too_many_values", close=close)

    async def _refuse_draining(self, scope: Scope, send: Send) -> None:
        if scope["path"] == "/health":
            body: dict[str, object] = {"status": "draining", "in_flight": self.in_flight}
        else:
            self.refused += 1
            self._count("shutting_down")
            body = error_body(503, "the server is shutting down; retry on another instance",
                              code="shutting_down")
        await _send_json(send, 503, body, [(b"retry-after", str(DRAIN_RETRY_AFTER_S).encode()),
                                           (b"connection", b"close")])

    async def drain(self, timeout_s: float) -> bool:
        """Stop admitting; wait until nothing is in flight. True if it drained within ``timeout_s``."""
        self.draining = True
        if self.in_flight == 0:
            return True
        self._idle = asyncio.Event()
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            return False
        return True


class _Sender:
    """``send`` with the request id on the response and a timeout on every write."""

    def __init__(self, send: Send, rid: bytes, timeout_s: float) -> None:
        self.send = send
        self.rid = rid
        self.timeout_s = timeout_s
        self.started = False

    async def __call__(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.started = True
            message = {**message, "headers": [*message.get("headers", ()), (b"x-request-id", self.rid)]}
        try:
            async with asyncio.timeout(self.timeout_s):
                await self.send(message)
        except TimeoutError:
            raise ClientStalled from None


def _request_id(scope: Scope) -> str:
    for name, value in scope["headers"]:
        if name == b"x-request-id" and _CLIENT_ID.fullmatch(value):
            return str(value.decode("ascii"))
    return f"{_ID_PREFIX}{next(_ID_COUNTER):08x}"


def _replay(body: bytes, receive: Receive) -> Receive:
    """The body, read already, as one message; then the connection's own messages (the disconnect)."""
    sent = False

    async def replayed() -> Any:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed


async def send_error(send: Send, status: int, message: str, code: str, close: bool = False) -> None:
    extra = [(b"connection", b"close")] if close else []
    if status == 401:
        extra.append((b"www-authenticate", b"Bearer"))
    await _send_json(send, status, error_body(status, message, code=code), extra)


async def _send_json(send: Send, status: int, body: dict[str, object],
                     extra: list[tuple[bytes, bytes]] | None = None) -> None:
    payload = json.dumps(body, ensure_ascii=True).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
               *(extra or [])]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})
