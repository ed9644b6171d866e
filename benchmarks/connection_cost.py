"""What a new connection costs a batchpilot server: the server's CPU per request, kept-alive against one new
connection per request.

    .venv/bin/python benchmarks/connection_cost.py [--requests 300] [--rounds 3] [--cpus 1]

Starts ``batchpilot serve`` (the embedded MiniLM, pinned to ``--cpus``; this process on the other cores
when there are any) and sends short embedding requests one at a time in rounds, the two ways
alternating: all over one kept-alive connection, and each over a connection of its own (opened,
used once, closed). Per way and round it prints the server process's CPU seconds per request (user +
system, from ``/proc/PID/stat``) and the client's wall time per request. The difference of the CPU
per request is what a reconnecting client costs the server beyond the request itself: the accept,
the protocol set-up and the close.
"""

from __future__ import annotations

import argparse
import os
import time

import httpx

from batchpilot.bench.serverproc import cores, serve


def server_pid(port: str) -> int:
    """The pid of the process listening on 127.0.0.1:``port`` (its socket inode in ``/proc/*/fd``)."""
    inode = None
    with open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            parts = line.split()
            if parts[3] == "0A" and int(parts[1].split(":")[1], 16) == int(port):  # LISTEN
                inode = parts[9]
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
            if any(os.readlink(f"/proc/{pid}/fd/{fd}") == f"socket:[{inode}]" for fd in fds):
                return int(pid)
        except OSError:
            continue
    raise RuntimeError(f"no process listens on port {port}")


def cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cpus", default="1", help="the server's cores ('none': unpinned)")
    args = ap.parse_args()
    cpus = None if args.cpus == "none" else args.cpus
    if cpus and hasattr(os, "sched_setaffinity"):
        rest = set(os.sched_getaffinity(0)) - cores(cpus)
        if rest:
            os.sched_setaffinity(0, rest)
    with serve(["--log-level", "warning", "--no-warmup"], cpus=cpus) as url:
        pid = server_pid(url.rsplit(":", 1)[1])
        with httpx.Client(base_url=url) as c:
            model = c.get("/v1/models").json()["data"][0]["id"]
            for _ in range(20):  # the first calls of a fresh server are slow
                c.post("/v1/embeddings", json={"input": "warm up", "model": model}).raise_for_status()
        body = {"input": "hello world, this is a short text to embed", "model": model}
        print(f"server pid {pid} on cores {cpus or 'all'}; {args.requests} requests per way and round")
        for r in range(args.rounds):
            for way in ("kept-alive", "new connection") if r % 2 == 0 else ("new connection", "kept-alive"):
                c0, t0 = cpu_s(pid), time.perf_counter()
                if way == "kept-alive":
                    with httpx.Client(base_url=url) as c:
                        for _ in range(args.requests):
                            c.post("/v1/embeddings", json=body).raise_for_status()
                else:
                    with httpx.Client(base_url=url, limits=httpx.Limits(max_keepalive_connections=0)) as c:
                        for _ in range(args.requests):
                            c.post("/v1/embeddings", json=body).raise_for_status()
                wall = time.perf_counter() - t0
                time.sleep(0.5)  # the server's last closes are counted
                print(f"round {r + 1} {way:>15}: server CPU {(cpu_s(pid) - c0) / args.requests * 1e3:.2f} ms "
                      f"per request, client wall {wall / args.requests * 1e3:.2f} ms per request", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
