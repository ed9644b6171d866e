"""LLM priorities under load: first-token latency of a small high-priority class and of the rest, over HTTP.

What: ``batchpilot serve --llm --noop`` (the default tiny Llama, seeded random weights; the encoder side is
a no-op) with a config file ``llm: {policy: priority, max_priority_wait_s: W}``. A contiguous slice of
conv-llm (docs/design.md: prompt ``clip(round(ctx/8), 4, 1024)`` token ids, output ``clip(gen, 1, 256)``
tokens, EOS ignored), streamed, is replayed open loop by the load generator (``bench.loadgen``): each
request is high priority (``priority: -1``) with probability ``--high-share`` (0.1, seeded), low
(``priority: 1``) otherwise. The rate is ``--load`` (0.8) of the capacity measured first on the same
server: the same rows sent all at once, requests answered per second (after a two-request warm-up).

Baseline: the same plan, at the same rate, against a second server identical but for ``policy: fcfs``
(run after the first). Reported per server and class: TTFT (sent -> first token) P50/P99, errors, and
the longest low-priority TTFT beside the aging bound: under ``priority`` a low request goes ahead of
every younger request once it has waited ``max_priority_wait_s``, so past W it waits only for what
arrived before it and what was running (docs/llm.md). Results go to ``--out`` as JSON.

    .venv/bin/python benchmarks/llm_priority.py [--requests 200] [--start 0] [--load 0.8]
        [--high-share 0.1] [--max-priority-wait-s 10] [--threads 1] [--no-baseline] [--out DIR]

A smoke check of the plumbing (seconds of load; the servers' start takes longer):
``--requests 6 --max-output-tokens 4 --no-baseline``. ``--threads`` sets the server's torch threads
(``OMP_NUM_THREADS``; 1 is steadier on shared cores, see benchmarks/llm_throughput.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
from pathlib import Path
from typing import Any

import numpy as np

from batchpilot.bench.capacity import wait_idle
from batchpilot.bench.loadgen import LoadGenConfig, PlannedRequest, build_plan, replay
from batchpilot.bench.records import RequestRecord
from batchpilot.bench.serverproc import serve
from batchpilot.sim.traces import Workload, load_workload

HIGH, LOW = -1, 1  # lower is served first


def make_workload(args: argparse.Namespace) -> tuple[Workload, np.ndarray]:
    wl = load_workload("conv-llm", start=args.start, count=args.requests)
    out = np.minimum(wl.output_tokens, args.max_output_tokens)
    high = np.random.default_rng(args.seed).random(len(wl)) < args.high_share
    prio = np.where(high, HIGH, LOW).astype(np.int64)
    return Workload(wl.name, wl.arrival_s, wl.input_tokens, out, prio), high


def with_priority(plan: list[PlannedRequest], prio: np.ndarray) -> list[PlannedRequest]:
    return [dataclasses.replace(p, body={**p.body, "priority": int(prio[p.index])}) for p in plan]


def capacity_rps(url: str, wl: Workload, seed: int) -> float:
    """Requests answered per second with every row sent at t=0 (the engine saturated)."""
    burst = Workload(wl.name, np.zeros(len(wl)), wl.input_tokens, wl.output_tokens, wl.priority)
    res = replay(with_priority(build_plan(burst, "completions", seed=seed), wl.priority),
                 LoadGenConfig(url, "completions", progress=False, scrape_interval_s=0))
    ok = [r for r in res.records if r.ok]
    if len(ok) < len(res.records):
        print(f"capacity burst: {len(res.records) - len(ok)} of {len(res.records)} requests failed "
              f"(first: {next(r.error for r in res.records if not r.ok)})", flush=True)
    span = max(r.done_s for r in ok) - min(r.sent_s for r in res.records) if ok else math.nan
    return len(ok) / span if ok and span > 0 else math.nan


def warm_up(url: str, wl: Workload) -> None:
    first = wl.slice(0, min(2, len(wl)))  # the server's first steps allocate: not measured
    replay(build_plan(first, "completions", warmup_requests=len(first)),
           LoadGenConfig(url, "completions", progress=False, scrape_interval_s=0))
    wait_idle(url, 30.0)


def q(xs: list[float], p: float) -> float:
    return float(np.percentile(xs, p)) if xs else math.nan


def summarize(records: list[RequestRecord], high: np.ndarray) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, want in (("high", True), ("low", False)):
        recs = [r for r in records if not r.warmup and bool(high[r.index]) == want]
        ttft = [r.ttft_s for r in recs if r.ok and math.isfinite(r.ttft_s)]
        engine = [r.server_batcher_s for r in recs if r.ok and math.isfinite(r.server_batcher_s)]
        out[name] = {"requests": len(recs), "errors": sum(not r.ok for r in recs),
                     "ttft_p50_s": q(ttft, 50), "ttft_p99_s": q(ttft, 99),
                     "ttft_max_s": max(ttft, default=math.nan),
                     "engine_ttft_max_s": max(engine, default=math.nan)}
    return out


def run_server(name: str, policy: str, args: argparse.Namespace, wl: Workload, high: np.ndarray, out: Path,
               rate_rps: float | None) -> tuple[float, dict[str, Any]]:
    """Start a server with ``policy``; measure capacity if no rate is given; replay the plan at
    ``load`` x capacity. Returns the rate used and the summary."""
    cfg = out / f"{name}.yaml"
    cfg.write_text(f"llm:\n  policy: {policy}\n  max_priority_wait_s: {args.max_priority_wait_s}\n")
    serve_args = ["--llm", "--noop", "--no-warmup", "--no-startup-profile", "--log-level", "warning",
                  "--config", str(cfg)]
    env = {"OMP_NUM_THREADS": str(args.threads)} if args.threads else None
    with serve(serve_args, log_path=out / f"serve-{name}.log", env=env) as url:
        warm_up(url, wl)
        if rate_rps is None:
            cap = capacity_rps(url, wl, args.seed)
            rate_rps = args.load * cap
            print(f"measured capacity ({name}): {cap:.3f} req/s with all {len(wl)} rows at once; "
                  f"replaying at {args.load:.0%} = {rate_rps:.3f} req/s", flush=True)
            wait_idle(url, 60.0)
        if not rate_rps > 0 or wl.mean_rate <= 0:
            raise SystemExit("no positive rate to replay at (capacity not measured, or fewer than 2 rows)")
        rows = wl.scale_rate(rate_rps / wl.mean_rate)
        plan = with_priority(build_plan(rows, "completions", seed=args.seed), wl.priority)
        res = replay(plan, LoadGenConfig(url, "completions", progress=not args.no_progress),
                     description=f"{name} at {rate_rps:.2f} req/s")
        wait_idle(url, 60.0)
    return rate_rps, summarize(res.records, high)


def table(results: dict[str, dict[str, Any]], wait_s: float) -> str:
    head = f"{'server':<10}{'class':<7}{'n':>5}{'err':>5}{'TTFT p50':>10}{'TTFT p99':>10}{'TTFT max':>10}"
    lines = [head]
    for server, summary in results.items():
        for cls in ("high", "low"):
            s = summary[cls]
            lines.append(f"{server:<10}{cls:<7}{s['requests']:>5}{s['errors']:>5}{s['ttft_p50_s']:>10.2f}"
                         f"{s['ttft_p99_s']:>10.2f}{s['ttft_max_s']:>10.2f}")
    low = results["priority"]["low"]
    lines.append(f"priority: longest low-priority TTFT {low['ttft_max_s']:.2f} s (engine side "
                 f"{low['engine_ttft_max_s']:.2f} s); the aging bound: max_priority_wait_s = {wait_s:g} s "
                 "+ the service of what arrived before it")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=200, help="conv-llm rows (at most 320: the queue bound)")
    ap.add_argument("--start", type=int, default=0)
    ap.add_argument("--load", type=float, default=0.8, help="the replay rate, x the measured capacity")
    ap.add_argument("--high-share", type=float, default=0.1, help="share of high-priority requests")
    ap.add_argument("--max-priority-wait-s", type=float, default=10.0, help="the aging bound (0 = off)")
    ap.add_argument("--max-output-tokens", type=int, default=256, help="clip outputs further (smoke checks)")
    ap.add_argument("--threads", type=int, default=1, help="server torch threads (0 = torch's default)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-baseline", action="store_true", help="skip the fcfs server")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--out", default="/tmp/batchpilot-llm-priority")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    wl, high = make_workload(args)
    print(f"conv-llm rows [{args.start}, {args.start + len(wl)}): {int(high.sum())} high priority, "
          f"{int((~high).sum())} low; load average {os.getloadavg()[0]:.1f}", flush=True)
    results: dict[str, dict[str, Any]] = {}
    rate, results["priority"] = run_server("priority", "priority", args, wl, high, out, None)
    if not args.no_baseline:
        _, results["fcfs"] = run_server("fcfs", "fcfs", args, wl, high, out, rate)
    print(table(results, args.max_priority_wait_s), flush=True)
    (out / "llm_priority.json").write_text(json.dumps(
        {"rows": [args.start, args.start + len(wl)], "load": args.load, "rate_rps": rate,
         "high_share": args.high_share, "max_priority_wait_s": args.max_priority_wait_s,
         "results": results, "load_average_1m": os.getloadavg()[0]}, indent=2))
    print(f"written to {out / 'llm_priority.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
