"""HTTP requests/s of ``batchpilot serve --noop`` against a bare FastAPI endpoint, side by side.

    .venv/bin/python benchmarks/http_noop.py [--seconds 10] [--concurrency 32] [--rounds 2]

Both servers run as subprocesses on 127.0.0.1 with the same uvicorn (uvloop/httptools when installed);
the load generator is this process (keep-alive HTTP/1.1 on raw asyncio streams, ``--concurrency``
connections each with one request in flight, closed loop).
The bare server answers every POST /v1/embeddings with a constant body of the same shape and size, so
the ratio batchpilot / bare is what validation, tokenisation, the Batcher, the executor threads and
metrics cost on top of the HTTP stack itself. Rounds interleave the two servers, so machine-load drift
hits both alike; the client shares the machine's cores with the server, as in any one-box benchmark.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx

BODY = {"input": "a short sentence to embed", "model": "noop"}


def bare_server(port: int) -> None:
    """A FastAPI app that does nothing but return an embeddings-shaped constant."""
    import uvicorn
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse

    app = FastAPI()
    payload = {"object": "list", "data": [{"object": "embedding", "embedding": [0.0] * 384, "index": 0}],
               "model": "noop", "usage": {"prompt_tokens": 4, "total_tokens": 4}}

    @app.post("/v1/embeddings")
    async def embed(body: dict) -> JSONResponse:  # type: ignore[type-arg]
        return JSONResponse(payload)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def server(cmd: list[str], port: int) -> Iterator[str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        else:
            raise TimeoutError(f"{cmd} did not start")
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


async def load(url: str, seconds: float, concurrency: int) -> tuple[int, int]:
    """Keep-alive HTTP/1.1 over raw asyncio streams: a load generator far cheaper per request than httpx,
    so the client (which shares the cores) takes as little CPU from the servers as possible."""
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps(BODY).encode()
    request = (f"POST /v1/embeddings HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(body)}\r\n\r\n").encode() + body
    ok = errors = 0
    stop = time.monotonic() + seconds

    async def worker() -> None:
        nonlocal ok, errors
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            while time.monotonic() < stop:
                writer.write(request)
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
                await reader.readexactly(length)
                if head.startswith(b"HTTP/1.1 200"):
                    ok += 1
                else:
                    errors += 1
        finally:
            writer.close()

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return ok, errors


def mean_batch(url: str) -> float:
    s = c = 0.0
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith("batchpilot_batch_size_sum"):
            s = float(line.split()[-1])
        elif line.startswith("batchpilot_batch_size_count"):
            c = float(line.split()[-1])
    return s / c if c else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--bare-server", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.bare_server is not None:
        bare_server(args.bare_server)
        return
    pb, pn = free_port(), free_port()
    bare_cmd = [sys.executable, __file__, "--bare-server", str(pb)]
    noop_cmd = [sys.executable, "-m", "batchpilot.server.cli", "--noop", "--port", str(pn),
                "--log-level", "warning"]
    print(f"HTTP no-op: {args.concurrency} requests in flight, {args.seconds:.0f} s per run, "
          f"{args.rounds} rounds")
    rates: dict[str, list[float]] = {"bare FastAPI": [], "batchpilot --noop": []}
    with server(bare_cmd, pb) as bare_url, server(noop_cmd, pn) as noop_url:
        for rnd in range(args.rounds):
            for name, url in (("bare FastAPI", bare_url), ("batchpilot --noop", noop_url)):
                asyncio.run(load(url, 1.0, args.concurrency))  # warm the connections and the server
                ok, err = asyncio.run(load(url, args.seconds, args.concurrency))
                rates[name].append(ok / args.seconds)
                print(f"  round {rnd + 1} {name:<18} {ok / args.seconds:>8,.0f} req/s  ({err} errors)")
        batch = mean_batch(noop_url)
    bare, bp = max(rates["bare FastAPI"]), max(rates["batchpilot --noop"])
    print(f"best: bare FastAPI {bare:,.0f} req/s, batchpilot --noop {bp:,.0f} req/s "
          f"= {bp / bare:.2f}x the bare HTTP stack; batchpilot mean batch size {batch:.1f}")


if __name__ == "__main__":
    main()
