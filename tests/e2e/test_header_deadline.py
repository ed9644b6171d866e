"""The header deadline (``server/header_timeout.py``) on the real ``batchpilot serve`` over raw sockets.

A client that trickles its request head one byte at a time, on a fresh connection or on a kept-alive
one after a response, is answered 408 ``header_timeout`` and disconnected, while other connections are
served; a connection that sends nothing is closed without a word; a request whose head arrives at once
is not touched by the deadline however long its body or its answer take. A kept-alive connection idle
longer than the head's deadline is still served (idle is the keep-alive timer's), and is closed without
a word once idle past ``--keep-alive-s``.

The server runs with a 2 s deadline and an 8 s keep-alive. The only times asserted are bounds no
machine's speed can break: closed no earlier than the timer, and no later than 30 s past it.
"""

from __future__ import annotations

import contextlib
import select
import socket
import time
from collections.abc import Iterator

import httpx
import pytest
from conftest import running_server
from inproc import scrape

DEADLINE_S = 2.0
KEEP_ALIVE_S = 8.0
SLACK_S = 30.0  # the server's timer may run late on a loaded machine; only an unbounded hold fails
NOOP_DELAY_MS = 2500  # an embedding takes longer than the deadline
TRICKLE_S = 0.25  # one header byte per connection this often: every byte resets any per-byte idle timer
REFUSED = "batchpilot_http_refusals_total{reason=header_timeout}"


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    args = ["--noop", "--no-warmup", "--noop-delay-ms", str(NOOP_DELAY_MS),
            "--header-timeout-s", str(DEADLINE_S), "--keep-alive-s", str(KEEP_ALIVE_S)]
    with running_server(args, tmp_path_factory.mktemp("header-deadline")) as u:
        yield u


def connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=SLACK_S)


def trickle_until_closed(socks: list[socket.socket]) -> tuple[list[bytes], list[float]]:
    """One header byte on each socket every ``TRICKLE_S`` until the server closes it (or the deadline
    plus the slack pass): what each received, and when each closed (``inf``: still open)."""
    got = {s: b"" for s in socks}
    closed = {s: float("inf") for s in socks}
    start = time.monotonic()
    while any(t == float("inf") for t in closed.values()) and time.monotonic() - start < DEADLINE_S + SLACK_S:
        live = [s for s in socks if closed[s] == float("inf")]
        for s in live:
            with contextlib.suppress(OSError):  # closed by the server: what it wrote is still read below
                s.sendall(b"a")
        for s in select.select(live, [], [], TRICKLE_S)[0]:
            try:
                chunk = s.recv(65536)
            except ConnectionResetError:
                chunk = b""
            got[s] += chunk
            if not chunk:
                closed[s] = time.monotonic()
    return [got[s] for s in socks], [closed[s] for s in socks]


def read_response(sock: socket.socket) -> bytes:
    """One whole response with a Content-Length, leaving the connection open."""
    def more() -> bytes:
        chunk = sock.recv(65536)
        if not chunk:
            raise AssertionError("the server closed the connection before a whole response")
        return chunk

    data = b""
    while b"\r\n\r\n" not in data:
        data += more()
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
    while len(body) < length:
        body += more()
    return head + b"\r\n\r\n" + body


def test_heads_trickled_on_fresh_connections_get_408_and_are_closed_while_others_are_served(url: str) -> None:
    before = scrape(url).get(REFUSED, 0)
    opened = time.monotonic()
    slow = [connect(url) for _ in range(4)]
    try:
        for s in slow:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\nX-Slow: ")
        assert httpx.get(url + "/health", timeout=SLACK_S).status_code == 200  # another connection
        got, closed_at = trickle_until_closed(slow)
    finally:
        for s in slow:
            s.close()
    for raw, at in zip(got, closed_at, strict=True):
        assert at - opened <= DEADLINE_S + SLACK_S, "a trickling head held its connection past the deadline"
        assert at - opened >= DEADLINE_S * 0.9
        assert raw.startswith(b"HTTP/1.1 408 ") and b'"header_timeout"' in raw, raw
        assert b"connection: close" in raw.lower()
    assert scrape(url)[REFUSED] == before + 4
    assert httpx.get(url + "/health", timeout=SLACK_S).status_code == 200


def test_a_head_trickled_after_a_kept_alive_response_gets_408(url: str) -> None:
    with connect(url) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n")
        assert read_response(s).startswith(b"HTTP/1.1 200 ")
        answered = time.monotonic()
        s.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\nX-Slow: ")  # keeps the keep-alive timer off
        (raw,), (at,) = trickle_until_closed([s])
    assert at - answered <= DEADLINE_S + SLACK_S
    assert raw.startswith(b"HTTP/1.1 408 ") and b'"header_timeout"' in raw, raw


def test_a_connection_that_sends_nothing_is_closed_without_an_answer(url: str) -> None:
    opened = time.monotonic()
    with connect(url) as s:
        assert s.recv(65536) == b""  # the server closed it (the socket's timeout is the slack)
    assert DEADLINE_S * 0.9 <= time.monotonic() - opened <= DEADLINE_S + SLACK_S


def test_a_prompt_head_is_not_cut_by_a_slow_body_or_a_slow_answer(url: str) -> None:
    """Headers at once, then a body spread over longer than the header deadline (the body's own, 30 s,
    applies) and an answer that takes longer than it (the no-op model's delay); then a second request on
    the same kept-alive connection: all served."""
    body = b'{"input": "a slow body"}'
    with connect(url) as s:
        s.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n" % len(body))
        pieces = [body[i:i + 2] for i in range(0, len(body), 2)]
        paced = time.monotonic()
        for piece in pieces:  # the pace of the upload, not a wait on the server
            time.sleep(DEADLINE_S * 1.5 / len(pieces))
            s.sendall(piece)
        assert time.monotonic() - paced >= DEADLINE_S  # the body took longer than the head may
        first = read_response(s)
        assert first.startswith(b"HTTP/1.1 200 "), first
        s.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n")
        assert read_response(s).startswith(b"HTTP/1.1 200 ")


def test_a_head_pipelined_behind_a_slow_answer_gets_its_408_after_that_answer(url: str) -> None:
    """The embedding takes longer than the deadline; the next request's head, sent with it and then
    trickled, is cut only once the embedding is answered: the 200 arrives whole, then the 408."""
    body = b'{"input": "a"}'
    with connect(url) as s:
        s.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
                  + b"GET /health HTTP/1.1\r\nHost: t\r\nX-Slow: ")
        (raw,), (at,) = trickle_until_closed([s])
    assert at < float("inf")
    assert raw.startswith(b"HTTP/1.1 200 "), raw
    first, _, rest = raw.partition(b"HTTP/1.1 408 ")
    assert b'"embedding"' in first and b'"header_timeout"' in rest, raw


def test_a_kept_alive_connection_idle_past_the_head_deadline_is_served_then_closed_past_keep_alive(
        url: str) -> None:
    """Idle between requests is not a slow head: a request sent after an idle longer than the head's
    deadline (and shorter than the keep-alive) is answered on the same connection; idle past the
    keep-alive, the connection is closed without a word."""
    with connect(url) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n")
        assert read_response(s).startswith(b"HTTP/1.1 200 ")
        time.sleep(DEADLINE_S * 1.5)
        s.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n")
        assert read_response(s).startswith(b"HTTP/1.1 200 ")
        answered = time.monotonic()
        assert s.recv(65536) == b""  # closed by the server (the socket's timeout is the slack)
    assert KEEP_ALIVE_S * 0.9 <= time.monotonic() - answered <= KEEP_ALIVE_S + SLACK_S
