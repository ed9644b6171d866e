"""Overload soak: a live ``batchpilot serve`` held at 3x its measured capacity for minutes.

    .venv/bin/python benchmarks/overload_soak.py                          # real MiniLM, 3x, 5 minutes
    .venv/bin/python benchmarks/overload_soak.py --noop-delay-ms 50 --duration-s 120   # serving path only
    .venv/bin/python benchmarks/overload_soak.py --cpus 1       # server on core 1, load generator on the rest

1. Capacity: closed loop (``--clients`` concurrent requests, conv-embed texts) for ``--capacity-s``:
   successful requests per second.
2. Soak: open-loop Poisson arrivals (seeded) at ``--overload`` x capacity for ``--duration-s``.
   Every request must get exactly one answer: 200, or 429/503 *with* Retry-After. A client timeout,
   a reset connection or any other status is a failure. The client holds ``--connections`` requests
   in flight at most (default: twice what the server completes at its capacity within the SLA, at
   least 64, so that the server holds more work than the SLA allows and has to refuse); the rest
   wait in the client (counted in its latency), so the server sees at most that many at once.
3. Admitted requests: P99 latency against ``--sla-s``, measured by the server (its
   ``batchpilot_request_latency_seconds`` histogram: admission to result of every admitted input; the
   bucket bound that holds 99 %), because on a shared 2-core machine the load generator itself falls behind
   and its own clock adds client-side queueing; the client-side P50/P99 are printed too.
4. Memory: the server's RSS (``/proc/PID/status`` VmRSS) sampled every second; growth = the last
   fifth's maximum over the RSS at the end of the warm-up (the first fifth). Target < 5 %.

With ``-- --batch-log PATH`` it also prints how the server's batches ran against their predicted time.
Prints the figures and PASS/FAIL per criterion; ``--json PATH`` writes them too. The server is a
separate process (the load generator does not share its GIL), started exactly as a user would.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import numpy as np

from batchpilot.bench.serverproc import free_port, pin_load_generator, pinned, wait_ready


@dataclass
class Outcome:
    sent_at: float
    latency_s: float
    status: int | str  # an HTTP status, or the exception's name
    retry_after: str | None


@dataclass
class Report:
    capacity_rps: float
    offered_rps: float
    duration_s: float
    sent: int
    answered: int
    by_status: dict[str, int]
    missing_retry_after: int
    failures: int
    admitted_p50_s: float
    admitted_p99_s: float
    server_p99_s: float
    sla_s: float
    rss_start_mib: float
    rss_end_max_mib: float
    rss_growth: float
    criteria: dict[str, bool] = field(default_factory=dict)


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def conv_embed_texts(n: int, seed: int) -> list[str]:
    """Real English texts with conv-embed's token lengths (the trace's first ``n`` rows)."""
    from batchpilot.bench.loadgen import load_tokenizer
    from batchpilot.models.texts import texts_for_lengths
    from batchpilot.sim.traces import conv_embed

    lengths = [int(x) for x in conv_embed().input_tokens[:n]]
    return texts_for_lengths(load_tokenizer(None), lengths, seed=seed)


async def one(client: httpx.AsyncClient, text: str, t0: float, out: list[Outcome],
              slots: asyncio.Semaphore | None = None) -> None:
    sent = time.monotonic()
    try:
        if slots is None:
            r = await client.post("/v1/embeddings", json={"input": text})
        else:
            async with slots:
                r = await client.post("/v1/embeddings", json={"input": text})
        status: int | str = r.status_code
        retry = r.headers.get("retry-after")
    except httpx.HTTPError as exc:
        status, retry = type(exc).__name__, None
    out.append(Outcome(sent - t0, time.monotonic() - sent, status, retry))


async def capacity(url: str, texts: list[str], clients: int, seconds: float) -> float:
    done = 0
    stop = time.monotonic() + seconds
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=httpx.Limits(max_connections=clients)) as c:
        async def worker(k: int) -> None:
            nonlocal done
            i = k
            while time.monotonic() < stop:
                r = await c.post("/v1/embeddings", json={"input": texts[i % len(texts)]})
                done += r.status_code == 200
                i += clients
        t0 = time.monotonic()
        await asyncio.gather(*(worker(k) for k in range(clients)))
        return done / (time.monotonic() - t0)


def scrape(url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=30).text):
        for smp in fam.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(smp.labels.items()))
            out[smp.name + ("{" + labels + "}" if labels else "")] = smp.value
    return out


def histogram_quantile(before: dict[str, float], after: dict[str, float], name: str, q: float) -> float:
    """Upper bound of the bucket holding quantile ``q`` of the observations between two scrapes."""
    prefix = name + "_bucket{"
    buckets = []
    for key, value in after.items():
        if key.startswith(prefix) and "le=" in key:
            le = key.split("le=")[1].split(",")[0].rstrip("}")
            buckets.append((float(le), value - before.get(key, 0.0)))
    buckets.sort()
    total = buckets[-1][1] if buckets else 0.0
    for le, count in buckets:
        if total and count >= q * total:
            return le
    return float("nan")


async def soak(url: str, texts: list[str], rate: float, seconds: float, pid: int, seed: int,
               timeout_s: float, connections: int) -> tuple[list[Outcome], list[tuple[float, float]]]:
    rng = random.Random(seed)
    outcomes: list[Outcome] = []
    rss: list[tuple[float, float]] = []
    tasks: set[asyncio.Task[None]] = set()
    # a bounded pool: thousands of sockets would overflow the listen backlog (connect timeouts) and
    # measure the client's kernel, not the server
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    # requests beyond the pool wait here, not in httpcore's pool: its queue costs every waiting
    # request a pass over the connections on each event, and at 3x capacity on 2 cores that work
    # starved the load generator (it stopped sending; the server sat idle). The wait is counted in
    # the client-side latency, as the pool's was.
    slots = asyncio.Semaphore(connections)
    async with httpx.AsyncClient(base_url=url, timeout=timeout_s, limits=limits) as client:
        t0 = time.monotonic()
        next_sample, next_send, i = t0, t0, 0
        while (now := time.monotonic()) < t0 + seconds:
            if now >= next_sample:
                rss.append((now - t0, rss_mib(pid)))
                next_sample += 1.0
            if now >= next_send:
                task = asyncio.create_task(one(client, texts[i % len(texts)], t0, outcomes, slots))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                i += 1
                next_send += rng.expovariate(rate)
                continue
            await asyncio.sleep(min(next_send, next_sample) - now)
        sent = i
        await asyncio.gather(*tasks)
        rss.append((time.monotonic() - t0, rss_mib(pid)))
    assert len(outcomes) == sent
    return outcomes, rss


def summarize(outcomes: list[Outcome], rss: list[tuple[float, float]], cap: float, rate: float,
              seconds: float, sla_s: float, server_p99_s: float) -> Report:
    by_status: dict[str, int] = {}
    for o in outcomes:
        by_status[str(o.status)] = by_status.get(str(o.status), 0) + 1
    ok = [o.latency_s for o in outcomes if o.status == 200]
    refused = [o for o in outcomes if o.status in (429, 503)]
    failures = sum(1 for o in outcomes if o.status not in (200, 429, 503))
    fifth = seconds / 5
    start = [m for t, m in rss if t <= fifth]
    end = [m for t, m in rss if t >= seconds - fifth]
    rss_start = start[-1] if start else rss[0][1]
    rss_end = max(end) if end else rss[-1][1]
    p = np.percentile(ok, [50, 99]) if ok else [float("nan")] * 2
    report = Report(cap, rate, seconds, len(outcomes), len(outcomes) - failures, by_status,
                    sum(1 for o in refused if not o.retry_after), failures, float(p[0]), float(p[1]),
                    server_p99_s, sla_s, rss_start, rss_end, rss_end / rss_start - 1.0)
    report.criteria = {
        "every request answered once (200 or 429/503)": failures == 0,
        "every 429/503 has Retry-After": report.missing_retry_after == 0,
        "some requests refused (the load was over capacity)": len(refused) > 0,
        f"admitted P99 <= SLA ({sla_s:g} s, server-measured)": bool(ok) and server_p99_s <= sla_s,
        "RSS growth < 5 %": report.rss_growth < 0.05,
    }
    return report


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration-s", type=float, default=300.0)
    ap.add_argument("--capacity-s", type=float, default=20.0)
    ap.add_argument("--overload", type=float, default=3.0, help="offered load as a multiple of capacity")
    ap.add_argument("--clients", type=int, default=32, help="closed-loop clients for the capacity phase")
    ap.add_argument("--connections", type=int, default=None,
                    help="soak: the client's connection pool (default: 2 x capacity x SLA, at least 64)")
    ap.add_argument("--sla-s", type=float, default=1.0)
    ap.add_argument("--noop-delay-ms", type=float, default=None, help="serve the no-op model instead")
    ap.add_argument("--threads", type=int, default=1, help="server torch threads (real model)")
    ap.add_argument("--texts", type=int, default=400)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cpus", default=None,
                    help="pin the server to these cores (e.g. 1), the load generator to the rest")
    ap.add_argument("--json", default=None)
    ap.add_argument("serve_args", nargs="*", help="extra `batchpilot serve` arguments (after --)")
    args = ap.parse_args()

    texts = conv_embed_texts(args.texts, args.seed)
    port = free_port()
    # the SLA is declared: shedding is what this soak exercises (without one the server queues)
    serve = [*pinned(args.cpus), sys.executable, "-m", "batchpilot.cli", "serve", "--port", str(port),
             "--no-warmup", "--latency-sla", str(args.sla_s)]
    if args.noop_delay_ms is not None:
        serve += ["--noop", "--noop-delay-ms", str(args.noop_delay_ms)]
    else:
        serve += ["--threads", str(args.threads)]
    serve += args.serve_args
    log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"overload-soak-{port}.log"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    url = f"http://127.0.0.1:{port}"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(serve, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        wait_ready(url, 300, proc, log_path)
        pin_load_generator(args.cpus)
        print(f"server: {' '.join(serve[serve.index('-m') + 1:])}  (log {log_path})")
        cap = asyncio.run(capacity(url, texts, args.clients, args.capacity_s))
        rate = cap * args.overload
        # fewer in flight than the server completes within the SLA would never overload it: it would
        # admit them all and the excess would queue in the client
        connections = args.connections or max(64, math.ceil(2.0 * cap * args.sla_s))
        print(f"capacity {cap:.1f} req/s (closed loop, {args.clients} clients); "
              f"soak at {args.overload:g}x = {rate:.1f} req/s for {args.duration_s:.0f} s, "
              f"{connections} connections")
        before = scrape(url)
        outcomes, rss = asyncio.run(soak(url, texts, rate, args.duration_s, proc.pid, args.seed,
                                         max(60.0, 10 * args.sla_s), connections))
        after = scrape(url)
        server_p99 = histogram_quantile(before, after, "batchpilot_request_latency_seconds", 0.99)
        http_p50 = histogram_quantile(before, after, "batchpilot_http_request_duration_seconds", 0.5)
        http_p99 = histogram_quantile(before, after, "batchpilot_http_request_duration_seconds", 0.99)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    report = summarize(outcomes, rss, cap, rate, args.duration_s, args.sla_s, server_p99)
    print(f"sent {report.sent}, answered {report.answered}, by status {report.by_status}, "
          f"429/503 without Retry-After {report.missing_retry_after}")
    print(f"server-measured latency of admitted inputs: P99 <= {server_p99 * 1e3:.0f} ms "
          f"(SLA {args.sla_s:g} s); "
          f"HTTP handler time of all requests (refusals included): P50 <= {http_p50 * 1e3:.0f} ms, "
          f"P99 <= {http_p99 * 1e3:.0f} ms")
    print(f"client-side latency of admitted requests: P50 {report.admitted_p50_s * 1e3:.0f} ms, "
          f"P99 {report.admitted_p99_s * 1e3:.0f} ms (includes the load generator's own queueing)")
    print(f"server RSS {report.rss_start_mib:.0f} MiB after warm-up -> max {report.rss_end_max_mib:.0f} MiB "
          f"in the last fifth ({report.rss_growth:+.1%})")
    if "--batch-log" in args.serve_args:
        print(batch_spread(Path(args.serve_args[args.serve_args.index("--batch-log") + 1])))
    for name, passed in report.criteria.items():
        print(f"  {'PASS' if passed else 'FAIL'}  {name}")
    if args.json:
        Path(args.json).write_text(json.dumps(asdict(report), indent=2))
    return 0 if all(report.criteria.values()) else 1


def batch_spread(path: Path, run: int = 6) -> str:
    """The batch log's time over prediction: P10 / median / P90, and ``run`` batches in a row (about the
    work ahead of an admitted request) over their median, P1 and P99."""
    from batchpilot.runtime.journal import read_batches

    batches = [b for b in read_batches(path)[0] if b.predicted_s > 0]
    if len(batches) < run:
        return f"batch log {path}: {len(batches)} batches"
    slot = np.array([b.slot_s for b in batches])
    pred = np.array([b.predicted_s for b in batches])
    ratio = np.percentile(slot / pred, [10, 50, 90])
    window = np.ones(run)
    runs = np.convolve(slot, window, "valid") / np.convolve(pred, window, "valid")
    lo, hi = np.percentile(runs / np.median(runs), [1, 99])
    largest = max(b.n for b in batches)
    full = sum(b.n == largest for b in batches)
    return (f"batch log: {len(batches)} batches ({full} of the largest size, {largest}); "
            f"time over prediction P10 {ratio[0]:.2f}, median {ratio[1]:.2f}, P90 {ratio[2]:.2f}; "
            f"{run} in a row over their median: P1 {lo:.2f}, P99 {hi:.2f}")


if __name__ == "__main__":
    raise SystemExit(main())
