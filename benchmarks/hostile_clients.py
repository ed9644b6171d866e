"""Hostile clients against the embedding server: does a normal load keep its latency, the server its
memory, and every answer its 4xx?

    .venv/bin/python benchmarks/hostile_clients.py                       # about 2 minutes
    .venv/bin/python benchmarks/hostile_clients.py --phase-s 20 --rate 40

One ``batchpilot serve --noop --noop-delay-ms 20`` subprocess (a model of fixed cost, so the clean
latency is the serving path's, not this machine's speed). A normal open-loop load (Poisson arrivals,
4 short texts each) runs for ``--phase-s`` clean, then as long again while a second process attacks:

* 256 slow-loris connections: headers, then one body byte a second (the server's body deadline,
  ``--body-timeout-s``, answers 408 and closes; each reconnects at once);
* 64 stalled readers: a request (8 inputs, a 30 KB answer), then nothing read, ever;
* bodies of 16 MiB of invalid items (``[{}, {}, ...]``) and huge inputs (an 8 MiB text, 3 M tiny
  strings, a list of 100 k token ids), one every ``--big-every-s`` (a client with unbounded bandwidth
  is a volume attack, for a proxy's rate limit, not this benchmark).

Printed: the normal requests' P50/P99 clean and under attack (target: P99 within 2x), the server's RSS
baseline and peak during the attack (target: under 2x), every answer's status by kind, and the count of
5xx (target: 0).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import random
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from batchpilot.bench.serverproc import free_port, wait_ready  # noqa: E402

MIB = 1 << 20


def rss_kib(pid: int, field: str = "VmRSS") -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


async def normal_load(url: str, rate: float, duration_s: float,
                      seed: int) -> tuple[list[float], Counter[int]]:
    rng = random.Random(seed)
    latencies: list[float] = []
    statuses: Counter[int] = Counter()
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:
        async def one(i: int) -> None:
            t0 = time.perf_counter()
            try:
                r = await client.post("/v1/embeddings", json={"input": [f"normal request {i} text {k}"
                                                                        for k in range(4)]})
                statuses[r.status_code] += 1
                if r.status_code == 200:
                    latencies.append(time.perf_counter() - t0)
            except httpx.HTTPError as exc:
                statuses[-1] += 1
                if statuses[-1] <= 3:
                    print("normal request failed:", type(exc).__name__, file=sys.stderr)

        tasks, start, due, i = [], time.perf_counter(), 0.0, 0
        while due < duration_s:
            delay = start + due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)  # the arrival schedule (open loop), not a synchronisation
            tasks.append(asyncio.create_task(one(i)))
            i += 1
            due += rng.expovariate(rate)
        await asyncio.gather(*tasks)
    return latencies, statuses


# -- the attacker (its own process, so its CPU work does not stall the normal client's loop) --------
async def _slow_loris(host: str, port: int, stop: float, out: Counter[str]) -> None:
    while time.monotonic() < stop:
        try:
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 100000\r\n\r\n")
            answered = asyncio.ensure_future(reader.read(4096))
            while time.monotonic() < stop and not answered.done():
                writer.write(b" ")
                await writer.drain()
                await asyncio.wait({answered}, timeout=1.0)  # one byte a second: the slow-loris pace
            if answered.done():
                data = answered.result()
                out[f"slow-loris {data[9:12].decode() or 'closed'}"] += 1
            else:
                answered.cancel()
            writer.close()
        except OSError as exc:
            out[f"slow-loris {type(exc).__name__}"] += 1


async def _stalled_reader(host: str, port: int, stop: float, out: Counter[str]) -> None:
    body = ('{"input": [' + ",".join(f'"stalled reader text {i}"' for i in range(8)) + "]}").encode()
    try:
        _, writer = await asyncio.open_connection(host, port)
        writer.write(b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body) + body)
        await writer.drain()
        out["stalled reader sent"] += 1
        await asyncio.sleep(max(0.0, stop - time.monotonic()))  # never reads: that is the attack
        writer.close()
    except OSError as exc:
        out[f"stalled {type(exc).__name__}"] += 1


async def _big_bodies(url: str, stop: float, every_s: float, out: Counter[str]) -> None:
    invalid = b'{"input": [' + b"{}," * ((16 * MIB - 20) // 3) + b"{}]}"
    huge = [b'{"input": "' + b"x" * (8 * MIB) + b'"}',
            b'{"input": [' + b'"a",' * (3_000_000 - 1) + b'"a"]}',
            b'{"input": [[' + b",".join(b"%d" % (i % 30000 + 100) for i in range(100_000)) + b"]]}"]
    names = ["8 MiB text", "3 M tiny strings", "100 k token ids"]
    kinds = [("16 MiB of {}", invalid)] + list(zip(names, huge, strict=True))
    order = [0, 1, 0, 2, 0, 3]  # the invalid items every other time
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        i, due = 0, time.monotonic()
        while time.monotonic() < stop:
            due += every_s
            name, body = kinds[order[i % len(order)]]
            try:
                r = await client.post("/v1/embeddings", content=body,
                                      headers={"content-type": "application/json"})
                out[f"{name} {r.status_code}"] += 1
            except httpx.HTTPError as exc:
                out[f"{name} {type(exc).__name__}"] += 1
            i += 1
            await asyncio.sleep(max(0.0, due - time.monotonic()))  # the attack's pace


async def _attack(url: str, duration_s: float, every_s: float) -> Counter[str]:
    host, port = url.removeprefix("http://").split(":")
    stop = time.monotonic() + duration_s
    out: Counter[str] = Counter()
    await asyncio.gather(*(_slow_loris(host, int(port), stop, out) for _ in range(256)),
                         *(_stalled_reader(host, int(port), stop, out) for _ in range(64)),
                         _big_bodies(url, stop, every_s, out))
    return out


def attacker(url: str, duration_s: float, every_s: float, results: mp.Queue) -> None:  # type: ignore[type-arg]
    results.put(dict(asyncio.run(_attack(url, duration_s, every_s))))


def percentiles(xs: list[float]) -> tuple[float, float]:
    a = np.asarray(xs) * 1e3
    return float(np.percentile(a, 50)), float(np.percentile(a, 99))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--phase-s", type=float, default=40.0, help="seconds of each phase (clean, hostile)")
    ap.add_argument("--big-every-s", type=float, default=0.5, help="one 16 MiB or huge body this often")
    ap.add_argument("--rate", type=float, default=40.0, help="normal requests per second")
    ap.add_argument("--noop-delay-ms", type=float, default=20.0)
    ap.add_argument("--body-timeout-s", type=float, default=10.0)
    ap.add_argument("--send-timeout-s", type=float, default=10.0)
    args = ap.parse_args()

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = Path(os.environ.get("TMPDIR", "/tmp")) / f"hostile-serve-{port}.log"
    cmd = [sys.executable, "-m", "batchpilot.cli", "serve", "--port", str(port), "--noop", "--no-warmup",
           "--noop-delay-ms", str(args.noop_delay_ms), "--body-timeout-s", str(args.body_timeout_s),
           "--send-timeout-s", str(args.send_timeout_s), "--log-level", "warning"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "HF_HUB_OFFLINE": "1"})
    try:
        wait_ready(url, 120, proc, log)
        asyncio.run(normal_load(url, args.rate, 3.0, seed=0))  # warm-up, not measured
        baseline = rss_kib(proc.pid)
        clean, clean_st = asyncio.run(normal_load(url, args.rate, args.phase_s, seed=1))
        Path(f"/proc/{proc.pid}/clear_refs").write_text("5")  # peak RSS := now
        samples: list[int] = []
        done = threading.Event()

        def sample() -> None:
            while not done.wait(0.1):
                samples.append(rss_kib(proc.pid))

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        q: mp.Queue = mp.get_context("spawn").Queue()  # type: ignore[type-arg]
        attack = mp.get_context("spawn").Process(target=attacker,
                                                 args=(url, args.phase_s + 5, args.big_every_s, q))
        attack.start()
        hostile, hostile_st = asyncio.run(normal_load(url, args.rate, args.phase_s, seed=2))
        attack_out = q.get(timeout=300)
        attack.join(60)
        done.set()
        peak = max(rss_kib(proc.pid, "VmHWM"), *samples)
        metrics = httpx.get(url + "/metrics", timeout=10).text
    finally:
        proc.terminate()
        proc.wait(timeout=30)

    (c50, c99), (h50, h99) = percentiles(clean), percentiles(hostile)
    fives = sum(v for k, v in {**clean_st, **hostile_st}.items() if k >= 500)
    fives += sum(v for k, v in attack_out.items() if k.split()[-1].startswith("5"))
    print(f"normal load: {args.rate:g} req/s open loop, {args.phase_s:g} s per phase, no-op model "
          f"{args.noop_delay_ms:g} ms per batch; a big body every {args.big_every_s:g} s")
    print(f"  clean:   {len(clean)} ok  P50 {c50:7.1f} ms  P99 {c99:7.1f} ms  statuses {dict(clean_st)}")
    print(f"  hostile: {len(hostile)} ok  P50 {h50:7.1f} ms  P99 {h99:7.1f} ms  statuses {dict(hostile_st)}")
    print(f"  P99 hostile / clean: {h99 / c99:.2f}x (target < 2x)")
    print(f"server RSS: baseline {baseline / 1024:.0f} MiB, peak under attack {peak / 1024:.0f} MiB: "
          f"{peak / baseline:.2f}x (target < 2x)")
    print("attacker's answers:")
    for k, v in sorted(attack_out.items()):
        print(f"  {k:40s} {v}")
    refusals = [ln for ln in metrics.splitlines() if ln.startswith("batchpilot_http_refusals_total")]
    print("server's refusals:", *refusals, sep="\n  ")
    print(f"5xx answers: {fives} (target 0)")
    return 0 if fives == 0 and h99 < 2 * c99 and peak < 2 * baseline else 1


if __name__ == "__main__":
    raise SystemExit(main())
