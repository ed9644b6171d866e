"""Hostile clients against the embedding server: does a normal load keep its latency, the server its
memory, and every answer its 4xx?

    .venv/bin/python benchmarks/hostile_clients.py                       # about 2 minutes
    .venv/bin/python benchmarks/hostile_clients.py --phase-s 20 --rate 40

One ``batchpilot serve --noop --noop-delay-ms 20`` subprocess (a model of fixed cost, so the clean
latency is the serving path's, not this machine's speed). A normal open-loop load (Poisson arrivals,
4 short texts each) runs for ``--phase-s`` clean, then as long again while a second process attacks:

* 256 slow-loris connections: headers, then one body byte a second (the server's body deadline,
  ``--body-timeout-s``, answers 408 and closes; each reconnects at once);
* 64 stalled readers: a request (8 inputs, a 30 KB answer), then nothing read, ever. They start
  evenly over the first half of the phase: their requests are real work, and all at once they would be
  a burst of 512 inputs (0.64 s of the no-op model's time at 16 per 20 ms batch) that any server
  queues, which measures burst queueing, not what not reading costs (``--stalled-burst`` sends them at
  once, ``--polite`` has them read their answers: the control for that burst);
* bodies of 16 MiB of invalid items (``[{}, {}, ...]``) and huge inputs (an 8 MiB text, 3 M tiny
  strings, a list of 100 k token ids; to the LLM routes a 4 MiB prompt and 100 k stop strings), one
  every ``--big-every-s`` (a client with unbounded bandwidth is a volume attack, for a proxy's rate
  limit, not this benchmark);
* 16 LLM streams (256 tokens each, ``stream: true``) whose readers never read: the send timeout must
  drop them and free their sequences (the server runs ``--llm``, the seeded tiny Llama on one thread).

``--attacks`` runs a subset (``loris stalled big streams``), to tell which one costs the normal load.

Printed: the normal requests' P50/P99 clean and under attack (target: P99 within 2x), the server's RSS
baseline and peak during the attack (target: under 2x), every answer's status by kind, and the count of
5xx (target: 0).
"""

from __future__ import annotations

import argparse
import asyncio
import json
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


async def _stalled_reader(host: str, port: int, stop: float, out: Counter[str], delay_s: float,
                          polite: bool = False) -> None:
    body = ('{"input": [' + ",".join(f'"stalled reader text {i}"' for i in range(8)) + "]}").encode()
    await asyncio.sleep(delay_s)  # spread: their requests are real work, not a burst (module docstring)
    try:
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body) + body)
        await writer.drain()
        out["stalled reader sent"] += 1
        if polite:  # the control: the same request, its answer read
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
            await reader.readexactly(length)
            out[f"polite reader {head[9:12].decode()}"] += 1
        await asyncio.sleep(max(0.0, stop - time.monotonic()))  # never reads: that is the attack
        writer.close()
    except OSError as exc:
        out[f"stalled {type(exc).__name__}"] += 1


async def _stalled_stream(host: str, port: int, stop: float, out: Counter[str], delay_s: float) -> None:
    """An LLM stream that is never read: the server's send timeout must drop it and free its sequence."""
    body = json.dumps({"model": LLM_MODEL, "prompt": "stalled stream", "max_tokens": 256, "stream": True,
                       "ignore_eos": True}).encode()
    await asyncio.sleep(delay_s)
    try:
        _, writer = await asyncio.open_connection(host, port)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body) + body)
        await writer.drain()
        out["stalled stream sent"] += 1
        await asyncio.sleep(max(0.0, stop - time.monotonic()))
        writer.close()
    except OSError as exc:
        out[f"stalled stream {type(exc).__name__}"] += 1


async def _big_bodies(url: str, stop: float, every_s: float, out: Counter[str], llm: bool) -> None:
    invalid = b'{"input": [' + b"{}," * ((16 * MIB - 20) // 3) + b"{}]}"
    huge = [b'{"input": "' + b"x" * (8 * MIB) + b'"}',
            b'{"input": [' + b'"a",' * (3_000_000 - 1) + b'"a"]}',
            b'{"input": [[' + b",".join(b"%d" % (i % 30000 + 100) for i in range(100_000)) + b"]]}"]
    names = ["8 MiB text", "3 M tiny strings", "100 k token ids"]
    kinds = [("16 MiB of {}", invalid)] + list(zip(names, huge, strict=True))
    order = [0, 1, 0, 2, 0, 3]  # the invalid items every other time
    paths = ["/v1/embeddings"] * 4
    if llm:  # a multi-MB prompt and a huge stop list, to the completions route
        kinds += [("4 MiB prompt", json.dumps({"model": LLM_MODEL, "prompt": "p" * (4 * MIB)}).encode()),
                  ("100 k stop strings", json.dumps({"model": LLM_MODEL, "prompt": "hi",
                                                     "stop": [f"s{i}" for i in range(100_000)]}).encode())]
        paths += ["/v1/completions"] * 2
        order += [4, 0, 5]
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        i, due = 0, time.monotonic()
        while time.monotonic() < stop:
            due += every_s
            k = order[i % len(order)]
            name, body = kinds[k]
            try:
                r = await client.post(paths[k], content=body,
                                      headers={"content-type": "application/json"})
                out[f"{name} {r.status_code}"] += 1
            except httpx.HTTPError as exc:
                out[f"{name} {type(exc).__name__}"] += 1
            i += 1
            await asyncio.sleep(max(0.0, due - time.monotonic()))  # the attack's pace


ATTACKS = ("loris", "stalled", "big", "streams")
LLM_MODEL = "batchpilot-tiny-llama"


async def _attack(url: str, duration_s: float, every_s: float, attacks: tuple[str, ...],
                  burst: bool = False, polite: bool = False) -> Counter[str]:
    host, port = url.removeprefix("http://").split(":")
    stop = time.monotonic() + duration_s
    out: Counter[str] = Counter()
    spread = 0.0 if burst else duration_s / 2  # stalled readers and streams start over the first half
    readers = 64 if "stalled" in attacks else 0
    jobs = [*(_slow_loris(host, int(port), stop, out) for _ in range(256 if "loris" in attacks else 0)),
            *(_stalled_reader(host, int(port), stop, out, i * spread / 64, polite) for i in range(readers))]
    if "big" in attacks:
        jobs.append(_big_bodies(url, stop, every_s, out, llm="streams" in attacks))
    if "streams" in attacks:
        jobs += [_stalled_stream(host, int(port), stop, out, i * spread / 16) for i in range(16)]
    await asyncio.gather(*jobs)
    return out


def attacker(url: str, duration_s: float, every_s: float, attacks: tuple[str, ...], burst: bool,
             polite: bool, results: mp.Queue) -> None:  # type: ignore[type-arg]
    results.put(dict(asyncio.run(_attack(url, duration_s, every_s, attacks, burst, polite))))


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
    ap.add_argument("--attacks", nargs="+", choices=ATTACKS, default=list(ATTACKS),
                    help="attacks to run (default all): slow-loris, stalled readers, big bodies, LLM streams")
    ap.add_argument("--stalled-burst", action="store_true",
                    help="send the stalled readers' (and streams') requests all at once")
    ap.add_argument("--polite", action="store_true",
                    help="the control: the stalled readers read their answers")
    args = ap.parse_args()

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = Path(os.environ.get("TMPDIR", "/tmp")) / f"hostile-serve-{port}.log"
    cmd = [sys.executable, "-m", "batchpilot.cli", "serve", "--port", str(port), "--noop", "--no-warmup",
           "--noop-delay-ms", str(args.noop_delay_ms), "--body-timeout-s", str(args.body_timeout_s),
           "--send-timeout-s", str(args.send_timeout_s), "--log-level", "warning"]
    if "streams" in args.attacks:  # the LLM routes too, with the seeded tiny Llama on one thread
        cmd += ["--llm", "--threads", "1", "--max-num-seqs", "16"]
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
                                                 args=(url, args.phase_s + 5, args.big_every_s,
                                                       tuple(args.attacks), args.stalled_burst,
                                                       args.polite, q))
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
          f"{args.noop_delay_ms:g} ms per batch; attacks: {', '.join(args.attacks)} (a big body every "
          f"{args.big_every_s:g} s)")
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
