"""A deadline on each request's head (request line and headers), which uvicorn does not have.

uvicorn times nothing between a connection's first byte and the end of a request's headers: a client
that sends ``GET / HTTP/1.1\\r\\nHost: x\\r\\n`` and then a header byte every few seconds holds its
connection for ever (its keep-alive timer is cancelled by any byte), and so does one that connects and
sends nothing (uvicorn arms no timer before the first request). The request middleware's body deadline
cannot help: it starts when the app is called, after the headers. This protocol adds the deadline:

    connection accepted ──────────────────────┐
    first byte of a request on a kept-alive   ┴─▶ that request's head must be complete within
    connection (idle there is keep-alive's)       ``timeout_s``, else the connection is closed:
        · part of a request arrived: first a 408 ``header_timeout`` in the OpenAI error shape, with
          ``Connection: close`` (no request is being answered on the connection, so it may be
          written), counted by ``on_timeout``
        · nothing arrived since the connection opened: closed without a word
    head complete ─▶ the deadline is off; the body's own (``--body-timeout-s``) is the middleware's

An idle kept-alive connection is closed by uvicorn's keep-alive timer (``--keep-alive-s``), which must
outlast the clients' own idle expiry (httpx and the openai client drop a pooled connection after 5 s):
a server that closes first races a client reusing the connection at that instant, and that request is
lost (a read error, nothing answered). A pipelined request that arrives while another is answered gets
its deadline when that answer ends: nothing is written into a response under way. Built on uvicorn's
``HttpToolsProtocol`` (httptools is a dependency of the server); ``deadline_protocol(timeout_s,
on_timeout)`` is the class to pass as ``uvicorn.Config(http=...)``. The timer is one ``loop.call_later``
per request head, cancelled by it.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from batchpilot.server.errors import error_body


class HeaderDeadlineProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a deadline on every request head (module docstring). The
    deadline and the hook are class attributes: ``deadline_protocol`` makes the class for a server."""

    timeout_s: float = 10.0
    on_timeout: Callable[[], None] | None = None  # called once per 408 (the server's refusal counter)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._deadline: asyncio.TimerHandle | None = None
        self._head_begun = False  # a byte of the next request was parsed

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head_begun = True
        if self._deadline is None and self._idle():  # else it runs from the opening, or from the answer
            self._arm()

    def on_headers_complete(self) -> None:
        self._disarm()
        self._head_begun = False
        super().on_headers_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        # a pipelined head begun during the answer, and no request being answered: its deadline starts
        if self._head_begun and not self.transport.is_closing() and self._idle():
            self._arm()

    def _idle(self) -> bool:
        """No request is being answered on the connection."""
        return self.cycle is None or self.cycle.response_complete

    def _arm(self) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(self.timeout_s, self._expired)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expired(self) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        if self._head_begun and self._idle():
            self.transport.write(self._timeout_response())
            if self.on_timeout is not None:
                self.on_timeout()
        self.transport.close()

    def _timeout_response(self) -> bytes:
        body = json.dumps(error_body(408, f"the request headers did not arrive within {self.timeout_s:g} s",
                                     code="header_timeout"), ensure_ascii=True).encode()
        head = [b"HTTP/1.1 408 Request Timeout\r\n"]
        head += [name + b": " + value + b"\r\n" for name, value in self.server_state.default_headers]
        head += [b"content-type: application/json\r\n", b"content-length: %d\r\n" % len(body),
                 b"connection: close\r\n\r\n"]
        return b"".join(head) + body


def deadline_protocol(timeout_s: float, on_timeout: Callable[[], None] | None = None
                      ) -> type[HeaderDeadlineProtocol]:
    """The protocol class for ``uvicorn.Config(http=...)``: heads due within ``timeout_s`` seconds,
    ``on_timeout()`` called for each 408."""
    if not timeout_s > 0:
        raise ValueError(f"header timeout must be > 0 seconds, got {timeout_s}")
    attrs = {"timeout_s": float(timeout_s), "on_timeout": staticmethod(on_timeout) if on_timeout else None}
    return type("HeaderDeadlineProtocol", (HeaderDeadlineProtocol,), attrs)
