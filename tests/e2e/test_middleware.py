"""The request middleware (``server/middleware.py``) against a real server over real sockets: request
ids, slow-loris bodies (408 and the connection closed), in-flight counting from the first body byte,
clients that stop reading, and a body of millions of JSON items refused before it is parsed.

Raw sockets send exactly the bytes a hostile client would; every wait is on the server's own state
(``wait_for``), never on a sleep, and nothing asserts a time.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from inproc import FaultyExecutor, LiveServer, free_port, live_server, wait_for

from batchpilot.core.config import PolicyConfig, SchedulerConfig
from batchpilot.server.config import ServerConfig
from batchpilot.server.middleware import RequestLifecycle


def window1() -> SchedulerConfig:
    return SchedulerConfig(policy=PolicyConfig(name="window", max_batch_size=1, max_wait_s=0.0))


@pytest.fixture(scope="module")
def srv() -> Iterator[LiveServer]:
    with live_server(FaultyExecutor(), window1(), body_timeout_s=1.0) as s:
        yield s


def connect(url: str, rcvbuf: int | None = None) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.socket()
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.settimeout(30)
    sock.connect((host, int(port)))
    return sock


def headers_for(length: int, path: str = "/v1/embeddings") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n\r\n").encode()


def read_response(sock: socket.socket) -> tuple[int, bytes, bool]:
    """(status, raw response, closed): reads until the server closes or 30 s pass."""
    data = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            return int(data.split(b" ")[1]), data, False
        if not chunk:
            return int(data.split(b" ")[1]), data, True
        data += chunk
        if b"\r\n\r\n" in data and b"connection: close" not in data.lower():
            head, _, rest = data.partition(b"\r\n\r\n")
            length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            if len(rest) >= length:
                return int(data.split(b" ")[1]), data, False


def tasks(s: LiveServer) -> int:
    return len(s.server.server_state.tasks)


def test_every_response_carries_a_request_id_and_a_sane_client_id_is_kept(srv: LiveServer) -> None:
    a = httpx.post(srv.url + "/v1/embeddings", json={"input": "a"}, timeout=30)
    b = httpx.post(srv.url + "/v1/embeddings", json={"input": []}, timeout=30)
    assert a.status_code == 200 and b.status_code == 400
    ids = {a.headers["x-request-id"], b.headers["x-request-id"]}
    assert len(ids) == 2 and all(len(i) >= 16 for i in ids)
    mine = httpx.get(srv.url + "/health", headers={"X-Request-Id": "lb-7f3a"}, timeout=10)
    assert mine.headers["x-request-id"] == "lb-7f3a"
    odd = httpx.get(srv.url + "/health", headers={"X-Request-Id": "x" * 500}, timeout=10)
    assert odd.headers["x-request-id"] != "x" * 500  # not echoed: too long to be an id


def test_a_body_that_does_not_arrive_in_time_gets_408_and_the_connection_closed(srv: LiveServer) -> None:
    with connect(srv.url) as sock:
        sock.sendall(headers_for(100) + b'{"input": "sl')  # 13 of 100 bytes, then nothing
        status, raw, closed = read_response(sock)
    assert status == 408 and closed, raw
    assert b'"body_timeout"' in raw and b"x-request-id" in raw.lower()
    assert httpx.post(srv.url + "/v1/embeddings", json={"input": "next"}, timeout=30).status_code == 200


def test_a_request_is_in_flight_from_its_first_body_byte_not_from_its_headers() -> None:
    """Connections that sent only headers hold nothing (the drain would not wait for them); one byte of
    body makes a request in flight; the completed body is served."""
    with live_server(FaultyExecutor(), window1(), body_timeout_s=120.0) as srv:
        check_in_flight_from_the_first_byte(srv)


def check_in_flight_from_the_first_byte(srv: LiveServer) -> None:
    mw = srv.app
    assert isinstance(mw, RequestLifecycle)
    before = tasks(srv)
    idle = [connect(srv.url) for _ in range(8)]
    try:
        for sock in idle:
            sock.sendall(headers_for(14))
        wait_for(lambda: tasks(srv) >= before + 8, what="the server has the 8 requests' headers")
        assert mw.in_flight == 0
        idle[0].sendall(b'{"input"')
        wait_for(lambda: mw.in_flight == 1, what="one request in flight")
        idle[0].sendall(b': "a"}')
        status, raw, _ = read_response(idle[0])
        assert status == 200, raw
        wait_for(lambda: mw.in_flight == 0, what="it is done")
    finally:
        for sock in idle:
            sock.close()


def _streaming_app(released: threading.Event) -> Any:
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        try:
            while True:  # a stream that never ends: only the client's reading paces it
                await send({"type": "http.response.body", "body": b"x" * 65536, "more_body": True})
        finally:
            released.set()

    return app


def test_a_client_that_stops_reading_is_dropped_and_its_handler_released() -> None:
    released = threading.Event()
    mw = RequestLifecycle(_streaming_app(released), ServerConfig(send_timeout_s=0.5))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(mw, host="127.0.0.1", port=port, log_level="critical"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_for(lambda: server.started, timeout_s=30, what="server started")
    try:
        with connect(f"http://127.0.0.1:{port}", rcvbuf=4096) as sock:
            sock.sendall(b"GET /stream HTTP/1.1\r\nHost: t\r\n\r\n")  # and never reads a byte
            wait_for(lambda: mw.stalled == 1, timeout_s=60, what="the stalled client dropped")
            wait_for(released.is_set, what="the handler's finally ran")
            assert mw.in_flight == 0
    finally:
        server.should_exit = True
        thread.join(15)


def _rss_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} for {pid}")


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc")
def test_16_mib_of_invalid_items_is_refused_before_parsing_with_bounded_memory(tmp_path: Path) -> None:
    """``[{}, {}, ...]`` filling the 16 MiB body limit: ``json.loads`` would build 5.6 M dicts (over
    400 MB) and pydantic an error for each. The server's peak RSS while refusing it stays within a few
    body sizes of its baseline."""
    port = free_port()
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "batchpilot.cli", "serve", "--port", str(port),
                                 "--noop", "--no-warmup", "--log-level", "warning"], stdout=out,
                                stderr=subprocess.STDOUT, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        def ready() -> bool:
            assert proc.poll() is None, log.read_text()[-3000:]
            try:
                return httpx.get(url + "/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(ready, timeout_s=120, what="server ready")
        size = 16 * 1024 * 1024
        hostile = b"[" + b"{}," * ((size - 20) // 3) + b"{}]"
        body = b'{"input": ' + hostile + b"}"
        assert len(body) <= size
        ok = httpx.post(url + "/v1/embeddings", json={"input": ["warm"] * 64}, timeout=30)
        assert ok.status_code == 200
        Path(f"/proc/{proc.pid}/clear_refs").write_text("5")  # peak RSS := current RSS
        baseline = _rss_kib(proc.pid, "VmRSS")
        r = httpx.post(url + "/v1/embeddings", content=body, headers={"content-type": "application/json"},
                       timeout=120)
        peak = _rss_kib(proc.pid, "VmHWM")
        assert r.status_code == 413 and r.json()["error"]["code"] == "too_many_values", r.text[:300]
        grew_mib = (peak - baseline) / 1024
        assert grew_mib < 4 * 16, (baseline / 1024, peak / 1024)  # parsing it would take > 400 MiB
        assert httpx.post(url + "/v1/embeddings", json={"input": "after"}, timeout=30).status_code == 200
    finally:
        proc.terminate()
        proc.wait(timeout=30)
