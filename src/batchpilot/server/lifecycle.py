"""Graceful shutdown: SIGTERM stops admission (503 + Retry-After), drains in-flight work, exits 0.

    SIGTERM ─▶ draining: new requests 503 shutting_down, /health 503 "draining" (load balancers stop
               routing), the listener stays open so late clients get an answer, not a refused connection
            ─▶ every in-flight HTTP request (embeddings, completions, streams) finishes, or
               ``drain_timeout_s`` passes
            ─▶ uvicorn's normal shutdown: close the listener, lifespan shutdown (the Batcher fails
               whatever is left — nothing, after a complete drain), exit status 0
    second SIGTERM / SIGINT ─▶ stop draining now

uvicorn alone closes the listening socket at the first signal (late clients see "connection refused")
and re-raises the signal after shutting down, so the process dies *by* SIGTERM (status -15). The
``Drainer`` ASGI wrapper counts in-flight requests and answers during the drain; ``GracefulServer``
turns the first signal into a drain and exits normally.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import threading
from collections.abc import Awaitable, Callable, Generator, MutableMapping
from contextlib import contextmanager
from types import FrameType
from typing import Any

import uvicorn

from .errors import error_body

log = logging.getLogger("batchpilot.server")

DRAIN_RETRY_AFTER_S = 5
_HANDLED = (signal.SIGINT, signal.SIGTERM)
Receive = Callable[[], Awaitable[Any]]
Send = Callable[[Any], Awaitable[None]]


class Drainer:
    """ASGI wrapper: counts in-flight HTTP requests; once ``draining``, refuses new ones with 503.

    It decides nothing about load: the concurrency limit is the core's
    (``admission.max_concurrent_requests``), so the simulator applies it too."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.state = getattr(app, "state", None)  # tests and the CLI reach the service through it
        self.in_flight = 0
        self.draining = False
        self.refused = 0
        self._idle: asyncio.Event | None = None

    async def __call__(self, scope: MutableMapping[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.draining and scope["path"] != "/metrics":
            await self._refuse(scope, send)
            return
        self.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1
            if self.in_flight == 0 and self._idle is not None:
                self._idle.set()

    async def _refuse(self, scope: MutableMapping[str, Any], send: Send) -> None:
        if scope["path"] == "/health":
            body: dict[str, Any] = {"status": "draining", "in_flight": self.in_flight}
        else:
            self.refused += 1
            body = error_body(503, "the server is shutting down; retry on another instance",
                              code="shutting_down")
        await _send_503(send, body, DRAIN_RETRY_AFTER_S, close=True)

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


async def _send_503(send: Send, body: dict[str, Any], retry_after_s: int, close: bool = False) -> None:
    payload = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
               (b"retry-after", str(retry_after_s).encode())]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": 503, "headers": headers})
    await send({"type": "http.response.body", "body": payload})


class GracefulServer(uvicorn.Server):
    """uvicorn, but the first SIGTERM/SIGINT drains through ``Drainer`` before the normal shutdown, and
    the process exits normally instead of re-raising the signal. ``drained`` says how it went."""

    def __init__(self, config: uvicorn.Config, drainer: Drainer, drain_timeout_s: float,
                 on_timeout: Callable[[], Awaitable[Any]] | None = None) -> None:
        super().__init__(config)
        self.drainer = drainer
        self.drain_timeout_s = drain_timeout_s
        self.on_timeout = on_timeout  # fails what is left (e.g. Batcher.shutdown(0): 503 shutting_down)
        self.drained: bool | None = None  # None: no signal; True: drained in time; False: timed out
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task[None] | None = None

    async def serve(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._drain_task is not None or self._loop is None or self.should_exit:
            log.warning("second signal: stopping without waiting for the drain")
            self.should_exit = True
            return
        self._loop.call_soon_threadsafe(self._begin_drain, sig)

    def _begin_drain(self, sig: int) -> None:
        if self._drain_task is None:
            self._drain_task = asyncio.get_running_loop().create_task(self._drain(sig))

    async def _drain(self, sig: int) -> None:
        log.info("%s: draining %d in-flight requests (at most %.0f s); new requests get 503",
                 signal.Signals(sig).name, self.drainer.in_flight, self.drain_timeout_s)
        self.drained = await self.drainer.drain(self.drain_timeout_s)
        if self.drained:
            log.info("drained; %d requests refused meanwhile; shutting down", self.drainer.refused)
        else:
            log.warning("drain timeout: %d requests still in flight are failed", self.drainer.in_flight)
            if self.on_timeout is not None:  # answer them (503) rather than drop their connections
                await self.on_timeout()
                await self.drainer.drain(1.0)
        self.should_exit = True

    @contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        """Like uvicorn's, without re-raising the signal afterwards (the drain *is* the handling)."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        original = {sig: signal.signal(sig, self.handle_exit) for sig in _HANDLED}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)


def serve(app: Any, *, host: str, port: int, drain_timeout_s: float, log_level: str = "info",
          access_log: bool = False, log_format: str = "text") -> int:
    """Run until SIGTERM/SIGINT, drain, shut down. Returns the exit status: 0, or 1 if the drain timed out
    and in-flight requests had to be failed."""
    drainer = Drainer(app)
    # json: keep the handlers logs.configure installed (uvicorn's own config would print plain text)
    log_config = None if log_format == "json" else uvicorn.config.LOGGING_CONFIG
    config = uvicorn.Config(drainer, host=host, port=port, log_level=log_level, access_log=access_log,
                            timeout_graceful_shutdown=1, log_config=log_config)
    service = getattr(getattr(app, "state", None), "service", None)
    on_timeout = (lambda: service.batcher.shutdown(0.0)) if service is not None else None
    server = GracefulServer(config, drainer, drain_timeout_s, on_timeout)
    server.run()
    return 0 if server.drained is not False else 1
