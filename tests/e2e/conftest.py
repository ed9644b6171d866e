"""Start the real ``batchpilot serve`` in a subprocess on a free 127.0.0.1 port and wait for /health.

Session-scoped: the MiniLM server loads once for every e2e test. A second, no-op-model server (starts in
about a second) carries the guards that need their own settings: API key, body limit, a tiny queue.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import pytest

from batchpilot.bench.serverproc import free_port, serve

API_KEY = "e2e-secret"


@contextmanager
def running_server(args: Sequence[str], log_dir: Path, ready_timeout_s: float = 180.0) -> Iterator[str]:
    """The same subprocess launcher the load generator uses (``bench.serverproc.serve``)."""
    port = free_port()
    log_path = log_dir / f"serve-{port}.log"
    with serve(args, port=port, log_path=log_path, ready_timeout_s=ready_timeout_s) as url:
        yield url


@pytest.fixture(scope="session")
def server_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The default server: embedded MiniLM, default scheduler config, built-in cost model (fast start).
    float32: the parity tests compare with sentence-transformers' float32. One torch thread: test runs
    share the machine, and OpenMP pools stall when oversubscribed."""
    with running_server(["--no-startup-profile", "--request-timeout-s", "60", "--threads", "1",
                         "--dtype", "float32"],
                        tmp_path_factory.mktemp("serve")) as url:
        yield url


@pytest.fixture(scope="session")
def auth() -> dict[str, str]:
    """The header the guarded server wants."""
    return {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="session")
def guarded_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """No-op model, 400 ms per batch of one, at most 2 queued requests, an API key and a 64 KiB body limit."""
    d = tmp_path_factory.mktemp("guarded")
    cfg = d / "sched.yaml"
    cfg.write_text("encoder:\n  policy: {name: window, max_batch_size: 1, max_wait_s: 0.0}\n"
                   "  admission: {max_queued_requests: 2}\n")
    args = ["--noop", "--noop-delay-ms", "400", "--config", str(cfg), "--api-key", API_KEY,
            "--max-body-bytes", "65536", "--no-warmup"]
    with running_server(args, d) as url:
        yield url
