"""Serve an app with uvicorn in a thread of this process, on a socket bound here (no race for the port).

    sock, port = bound_socket()
    with in_thread(app, sock, "name") as url: ...      # drained and joined on exit

The profiles' serving-path measurements (``profile/serving.py``, ``profile/llm.py``)
run the real app this way, in the profiling process.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn

from batchpilot.server.config import ServerConfig


def bound_socket() -> tuple[socket.socket, int]:
    """A 127.0.0.1 socket bound to a free port (handed to uvicorn: no race for the port)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    return sock, int(sock.getsockname()[1])


@contextmanager
def in_thread(app: Any, sock: socket.socket, name: str) -> Iterator[str]:
    """Serve ``app`` with uvicorn on ``sock`` in a thread; yields its URL; drains and joins on exit."""
    port = int(sock.getsockname()[1])
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           access_log=False, lifespan="on",
                                           timeout_keep_alive=ServerConfig.keep_alive_s))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True, name=name)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"{name}: the in-process server did not start")
            time.sleep(0.02)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True  # uvicorn drains, then the app's lifespan shuts the Batcher down
        thread.join(15)
        sock.close()
    if thread.is_alive():
        raise RuntimeError(f"{name}: the in-process server did not shut down within 15 s")
