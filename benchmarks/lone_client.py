"""Where the serving-path profile's client runs, and how the live server's lone requests compare.

    taskset -c 1 .venv/bin/python benchmarks/lone_client.py [--serve-profile /path/profile.json]

The profile's lone requests (``profile/serving.py``) give the simulator its delay outside the
batcher. This serves MiniLM in-process as the profile does (bfloat16, one thread, the profile's
scheduler, ``in_thread``) and sends the profile's lone-request plan (``profile.serving.lone_plan``, one
round of its 24 lengths), in interleaved rounds, from:

* ``in-process``: an httpx client in this process, back to back;
* ``child, gap G``: a client process on the cores this one is not pinned to
  (``profile.serving.lone_elsewhere``), one request at a time, ``G`` seconds of silence between two.

With ``--serve-profile``, the same child with a 0.2 s gap also sends to a ``batchpilot serve`` process
pinned like this one (the live server of ``bench fidelity``). Printed per variant: the median over
rounds of each round's median time outside the batcher (client latency less the ``tokenize`` and
``batcher`` parts of ``Server-Timing``), and the rounds' range.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import httpx

from batchpilot.bench.loadgen import LoadGenConfig, one_by_one_async
from batchpilot.core.costmodel import CostModel
from batchpilot.core.deployment import ServingOptions
from batchpilot.models.encoder import EncoderConfig, EncoderExecutor, plan_for
from batchpilot.profile.serving import lone_elsewhere, lone_plan, scheduler_config
from batchpilot.server.app import ServedModel, create_app
from batchpilot.server.config import ServerConfig
from batchpilot.server.inproc_server import bound_socket, in_thread

GAPS = (0.0, 0.05, 0.2, 0.5)


def outside(records: list[Any]) -> float:
    xs = [r.latency_s - r.server_tokenize_s - r.server_batcher_s for r in records if r.ok and not r.warmup]
    return statistics.median(xs)


def start_serve(profile: str) -> tuple[subprocess.Popen[bytes], str]:
    sock, port = bound_socket()
    sock.close()
    cpus = ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))
    cmd = ["taskset", "-c", cpus, sys.executable, "-m", "batchpilot.cli", "serve", "--profile", profile,
           "--padding", "none", "--port", str(port), "--log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(1)
    proc.kill()
    raise RuntimeError("batchpilot serve did not come up")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--serve-profile", default=None, help="also send to `batchpilot serve --profile PATH`")
    args = ap.parse_args()
    ex = EncoderExecutor(EncoderConfig(dtype="bfloat16"))
    ex.warmup()
    ex.threads = plan_for(ex, 1)
    plan = lone_plan(ex, rounds=1)[2]  # the profile's lone requests, one round of its 24 lengths
    sock, port = bound_socket()
    cost_model = CostModel.default_cpu_minilm()
    app = create_app(ServerConfig(port=port, serving=ServingOptions(request_timeout_s=30.0)),
                     [ServedModel(ex, scheduler_config(ex, "none", cost_model), cost_model)])
    proc, serve_url = start_serve(args.serve_profile) if args.serve_profile else (None, "")
    results: dict[str, list[float]] = {}
    try:
        with in_thread(app, sock, "lone-client") as url:
            model = app.state.service.model_name
            config = LoadGenConfig(url, model=model, timeout_s=30.0, progress=False, scrape_interval_s=0)
            for _ in range(args.rounds):
                results.setdefault("in-process, back to back", []).append(
                    outside(asyncio.run(one_by_one_async(plan, config))))
                for gap in GAPS:
                    results.setdefault(f"child, gap {gap:g} s", []).append(
                        outside(lone_elsewhere(url, model, plan, gap)))
                if serve_url:
                    results.setdefault("child, gap 0.2 s, to batchpilot serve", []).append(
                        outside(lone_elsewhere(serve_url, model, plan, 0.2)))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
    cores = sorted(os.sched_getaffinity(0))
    print(f"{len(plan) - 4} lone requests a round, {args.rounds} rounds, this process on cores {cores}")
    for name, xs in results.items():
        print(f"{name:40s} outside the batcher: median {statistics.median(xs) * 1e3:.2f} ms "
              f"(rounds {min(xs) * 1e3:.2f} .. {max(xs) * 1e3:.2f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
