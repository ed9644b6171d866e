"""Graceful shutdown: SIGTERM stops admission (503 + Retry-After), drains in-flight work, exits 0.

    SIGTERM ─▶ draining: new requests 503 shutting_down, /health 503 "draining" (load balancers stop
               routing), the listener stays open so late clients get an answer, not a refused connection
            ─▶ every in-flight HTTP request (embeddings, completions, streams) finishes, or
               ``drain_timeout_s`` passes
            ─▶ uvicorn's normal shutdown: close the listener, lifespan shutdown (the Batcher fails
               whatever is left — nothing, after a complete drain), exit status 0
    second SIGTERM / SIGINT ─▶ stop draining now
    SIGHUP ─▶ the app's ``on_hangup`` on the event loop (the keys file reloaded: ``server/tenants.py``)

uvicorn alone closes the listening socket at the first signal (late clients see "connection refused")
and re-raises the signal after shutting down, so the process dies *by* SIGTERM (status -15). The
request middleware (``middleware.RequestLifecycle``, the app ``create_app`` returns) owns the shutdown
state: it counts in-flight requests (from their first body byte) and answers during the drain;
``GracefulServer`` turns the first signal into its drain and exits normally. ``serve`` runs uvicorn with
the header deadline's protocol (``header_timeout.py``), the one timer uvicorn lacks.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
from collections.abc import Awaitable, Callable, Generator
from contextlib import contextmanager
from types import FrameType
from typing import Any

import uvicorn

from batchpilot.server.header_timeout import deadline_protocol
from batchpilot.server.middleware import RequestLifecycle

log = logging.getLogger("batchpilot.server")

_HANDLED = (signal.SIGINT, signal.SIGTERM)


class GracefulServer(uvicorn.Server):
    """uvicorn, but the first SIGTERM/SIGINT drains the app's middleware before the normal shutdown, and
    the process exits normally instead of re-raising the signal. ``drained`` says how it went."""

    def __init__(self, config: uvicorn.Config, drainer: RequestLifecycle, drain_timeout_s: float,
                 on_timeout: Callable[[], Awaitable[Any]] | None = None,
                 on_hangup: Callable[[], object] | None = None) -> None:
        super().__init__(config)
        self.on_hangup = on_hangup  # SIGHUP, run on the event loop (a reload of the keys file)
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

    def handle_hangup(self, sig: int, frame: FrameType | None) -> None:
        if self.on_hangup is not None and self._loop is not None:
            self._loop.call_soon_threadsafe(self.on_hangup)

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
        if self.on_hangup is not None:
            original[signal.SIGHUP] = signal.signal(signal.SIGHUP, self.handle_hangup)
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)


def serve(app: RequestLifecycle, *, host: str, port: int, drain_timeout_s: float, log_level: str = "info",
          access_log: bool = False, log_format: str = "text", header_timeout_s: float = 10.0,
          keep_alive_s: float = 30.0) -> int:
    """Run until SIGTERM/SIGINT, drain, shut down. Returns the exit status: 0, or 1 if the drain timed out
    and in-flight requests had to be failed. Every request's head must arrive within ``header_timeout_s``
    (``header_timeout.py``; each 408 counted by the app's ``count_header_timeout``); an idle kept-alive
    connection is closed after ``keep_alive_s``."""
    # json: keep the handlers logs.configure installed (uvicorn's own config would print plain text)
    log_config = None if log_format == "json" else uvicorn.config.LOGGING_CONFIG
    http = deadline_protocol(header_timeout_s, getattr(app, "count_header_timeout", None))
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=access_log,
                            timeout_graceful_shutdown=1, log_config=log_config, http=http,
                            timeout_keep_alive=keep_alive_s)
    hooks = list(getattr(getattr(app, "state", None), "drain_timeout_hooks", ()))

    async def on_timeout() -> None:  # every engine answers what it still holds (503 / an SSE error event)
        for hook in hooks:
            try:
                await hook()
            except Exception:
                log.exception("drain timeout: %r failed", hook)

    tenancy = getattr(getattr(app, "state", None), "tenancy", None)
    server = GracefulServer(config, app, drain_timeout_s, on_timeout if hooks else None,
                            tenancy.reload if tenancy is not None else None)
    server.run()
    return 0 if server.drained is not False else 1
