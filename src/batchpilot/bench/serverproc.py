"""Start ``batchpilot serve`` as a subprocess on a free port, wait until it answers, stop it after.

Used by ``bench --compare cfg1.yaml cfg2.yaml`` (one server per config, one after the other) and by the
fidelity check (the live server runs the same config and cost-model profile as the simulation). The
server is a separate process so the load generator and the server do not share an event loop or a GIL
— the same as a user pointing the tool at a running server.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def pinned(cpus: str | None) -> list[str]:
    """The ``taskset`` prefix that pins a subprocess to ``cpus`` (empty for None)."""
    if not cpus:
        return []
    if shutil.which("taskset") is None:
        raise RuntimeError("pinning to cpus needs taskset (util-linux); omit --cpus")
    return ["taskset", "-c", cpus]


def wait_ready(url: str, timeout_s: float, proc: subprocess.Popen[bytes] | None = None,
               log: Path | None = None) -> None:
    """Poll ``/v1/models`` (then ``/health``) until 200; raise with the server's log if it died."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            tail = log.read_text()[-3000:] if log and log.exists() else ""
            raise RuntimeError(f"batchpilot serve exited with {proc.returncode} before it was ready:\n{tail}")
        for path in ("/v1/models", "/health"):
            try:
                if httpx.get(url + path, timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
        time.sleep(0.3)
    raise TimeoutError(f"{url} did not answer /v1/models or /health within {timeout_s:.0f} s")


@contextmanager
def serve(args: Sequence[str] = (), *, port: int | None = None, log_path: str | Path | None = None,
          ready_timeout_s: float = 180.0, env: dict[str, str] | None = None,
          cpus: str | None = None) -> Iterator[str]:
    """``with serve(["--config", "cfg.yaml"]) as url:`` — a live batchpilot server at ``url``.

    ``cpus`` (``taskset -c`` syntax, e.g. ``"1"``) pins the server to those cores; the encoder then sizes
    its torch thread pool to them (``models.device.available_cores``)."""
    port = port or free_port()
    tmp = Path(os.environ.get("TMPDIR", "/tmp"))
    log = Path(log_path) if log_path else tmp / f"batchpilot-serve-{port}.log"
    cmd = [*pinned(cpus), sys.executable, "-m", "batchpilot.cli", "serve", "--host", "127.0.0.1",
           "--port", str(port), *args]
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=full_env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, ready_timeout_s, proc, log)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def cores(cpus: str) -> set[int]:
    """``taskset -c`` syntax (``1``, ``0,2``, ``1-3``) as a set of core numbers."""
    out: set[int] = set()
    for part in cpus.split(","):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def pin_load_generator(cpus: str | None) -> None:
    """Move the load generator off the server's cores (when the server is pinned and others remain)."""
    if not cpus or not hasattr(os, "sched_setaffinity"):
        return
    server = cores(cpus)
    rest = set(os.sched_getaffinity(0)) - server
    if rest:
        os.sched_setaffinity(0, rest)
        print(f"load generator pinned to cores {sorted(rest)}, server and profiler to {sorted(server)}")


KEEPALIVE_MARGIN_S = 5.0  # a client closes an idle connection this long before the server would


def client_keepalive_s(serve_args: Sequence[str] = (), given: float | None = None) -> float:
    """``given`` (``bench --keepalive-s``) when it is not None, else how long a load generator keeps an
    idle pooled connection to a ``batchpilot serve`` started with ``serve_args``: the server's
    keep-alive (``--keep-alive-s``, else ``ServerConfig.keep_alive_s``) less ``KEEPALIVE_MARGIN_S``, at
    least half of it. Like a gateway that pools its upstream connections, the client then reuses them
    across the idle gaps of bursty traffic, and never sends on one the server is closing. The profile's
    load, a steady stream, reaches its server on open connections, and the prediction is made for such
    requests (docs/loadgen.md, "Connections")."""
    from batchpilot.server.config import ServerConfig

    if given is not None:
        return float(given)  # LoadGenConfig rejects one that is not > 0
    server = ServerConfig.keep_alive_s
    args = list(serve_args)
    for i, a in enumerate(args):
        if a == "--keep-alive-s" and i + 1 < len(args):
            server = float(args[i + 1])
        elif a.startswith("--keep-alive-s="):
            server = float(a.partition("=")[2])
    return max(server - KEEPALIVE_MARGIN_S, server / 2)
