"""Ray Serve scale-out: live capacity of 1 vs 2 replicas, the P99 the Ray path adds, and the simulator.

    .venv/bin/python benchmarks/ray_scaleout.py [--delay-ms 250] [--max-batch-size 8] [--requests 600]

The model is the no-op one with a fixed time per batch (``--noop --noop-delay-ms``), a stand-in for a
model bound by its accelerator: a replica's capacity is its batches' time, not the machine's CPU.
Three servers run at once, each started by ``bench.serverproc.serve``:

* ``ray x1`` and ``ray x2``: ``batchpilot serve --ray --replicas 1|2`` (each its own local Ray, 0.5
  CPU per replica, HAProxy ingress where it runs);
* ``plain``: ``batchpilot serve`` with the same deployment flags.

1. Throughput: the live capacity (``bench.capacity``: the highest rate scale of the same conv-embed
   rows whose P99 meets the SLA) of ``ray x1`` and ``ray x2``, probes interleaved round-robin
   (``bench.interleave``): the ratio is 2 replicas' goodput over 1's.
2. The Ray path's latency: ``plain`` and ``ray x1`` replay the same rows at the same rate (half of
   ``ray x1``'s capacity), alternately, ``--rounds`` times each; P50 and P99 side by side.
3. Where ``sim/fleet.py`` exists: ``batchpilot simulate --replicas 1|2`` on the same rows at each live
   capacity's rate scale, from the no-op model's cost model alone (its fixed per-batch time; no
   serving-path model, no calibration on the measured traffic), router ``least_loaded`` (HAProxy's
   ``leastconn``), printed beside the live probe at that scale.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import httpx

from batchpilot.bench.capacity import CapacityConfig, CapacityResult
from batchpilot.bench.interleave import interleaved_capacity
from batchpilot.bench.loadgen import LoadGenConfig, build_plan, load_tokenizer, replay
from batchpilot.bench.records import Summary, summarize
from batchpilot.bench.serverproc import free_port, serve
from batchpilot.core.costmodel import CostModel
from batchpilot.sim.traces import load_workload

HEADER = "x-batchpilot-replica"


def wait_replicas(url: str, n: int, timeout_s: float = 60.0) -> set[str]:
    """Until ``n`` replicas answer through the ingress (a replica joins HAProxy after its health check)."""
    seen: set[str] = set()
    deadline = time.monotonic() + timeout_s
    while len(seen) < n and time.monotonic() < deadline:
        with httpx.Client(base_url=url, timeout=10) as client:
            seen |= {client.get("/health").headers.get(HEADER, "") for _ in range(8)}
        time.sleep(0.3)
    if len(seen) < n:
        raise RuntimeError(f"{url}: only {len(seen)} of {n} replicas answered within {timeout_s:.0f} s")
    return seen


def simulate(profile: Path, flags: list[str], replicas: int, rate_scale: float, start: int, requests: int,
             sla: float) -> dict[str, float]:
    """``batchpilot simulate --replicas N`` on the rows the live probes sent, at ``rate_scale``."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        cmd = [sys.executable, "-m", "batchpilot.cli", "simulate", "--workload", "conv-embed",
               "--start", str(start), "--requests", str(requests), "--rate-scale", f"{rate_scale:.6g}",
               "--profile", str(profile), "--replicas", str(replicas), "--router", "least_loaded",
               "--sla", str(sla), "--json", out.name, *flags]
        subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=600)
        report = json.loads(Path(out.name).read_text())
    return {"p50": report["latency"]["p50"], "p99": report["latency"]["p99"],
            "throughput": report["throughput_rps"]}


def probe_at(cap: CapacityResult, scale: float) -> Summary:
    return min(cap.probes, key=lambda p: abs(p.rate_scale - scale)).summary


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--delay-ms", type=float, default=250.0, help="the no-op model's time per batch")
    ap.add_argument("--max-batch-size", type=int, default=8)
    ap.add_argument("--sla", type=float, default=1.0)
    ap.add_argument("--start", type=int, default=0)
    ap.add_argument("--requests", type=int, default=600, help="conv-embed rows per probe")
    ap.add_argument("--start-scale", type=float, default=4.0, help="first rate scale probed")
    ap.add_argument("--max-probes", type=int, default=7)
    ap.add_argument("--rounds", type=int, default=3, help="part 2: replays of each server, alternating")
    ap.add_argument("--out", default="/tmp/batchpilot-ray-scaleout")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    flags = ["--noop", "--noop-delay-ms", f"{args.delay_ms:g}", "--max-batch-size", str(args.max_batch_size),
             "--no-warmup", "--log-level", "warning"]
    ray_flags = ["--ray", "--replica-cpus", "0.5", "--ray-num-cpus", "2"]
    wl = load_workload("conv-embed", start=args.start, count=args.requests)
    texts = [p.body["input"] for p in build_plan(wl, tokenizer=load_tokenizer(None), seed=0)]
    print(f"conv-embed rows {args.start}..{args.start + len(wl)} ({wl.mean_rate:.2f} req/s at x1); "
          f"no-op model {args.delay_ms:g} ms per batch of up to {args.max_batch_size}; SLA {args.sla:g} s; "
          f"load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores (shared: compare within this run)", flush=True)
    with ExitStack() as stack:
        urls: dict[str, str] = {}
        for name, extra in (("ray x1", [*ray_flags, "--replicas", "1"]),
                            ("ray x2", [*ray_flags, "--replicas", "2"]), ("plain", [])):
            env = {"RAY_SERVE_HAPROXY_STATS_PORT": str(free_port()),  # one HAProxy per local Ray
                   "RAY_SERVE_HAPROXY_METRICS_PORT": str(free_port())}
            t0 = time.monotonic()
            urls[name] = stack.enter_context(serve([*flags, *extra], env=env, ready_timeout_s=240,
                                                   log_path=out / f"serve-{name.replace(' ', '')}.log"))
            if name.startswith("ray"):
                wait_replicas(urls[name], int(name[-1]))
            print(f"{name}: ready in {time.monotonic() - t0:.1f} s at {urls[name]}", flush=True)

        ccfg = CapacityConfig(sla_s=args.sla, start=args.start_scale, growth=2.0, lo=0.5, hi=512.0,
                              rel_tol=0.1, max_probes=args.max_probes, probe_s=1e9, cooldown_s=5.0)
        caps = interleaved_capacity(wl, {k: urls[k] for k in ("ray x1", "ray x2")}, ccfg, texts)
        for name, cap in caps.items():
            print(f"\n{name}: live capacity\n{cap.table()}", flush=True)
        one, two = caps["ray x1"], caps["ray x2"]
        ratio = two.rps / one.rps if one.rps > 0 else float("nan")
        print(f"\nthroughput at P99 <= {args.sla:g} s: 1 replica {one.rps:.1f} req/s, 2 replicas "
              f"{two.rps:.1f} req/s: {ratio:.2f}x", flush=True)

        scale = one.rate_scale / 2
        plan = build_plan(wl.scale_rate(scale), texts=texts, seed=0)
        runs: dict[str, list[Summary]] = {"plain": [], "ray x1": []}
        for _ in range(args.rounds):
            for name in runs:
                res = replay(plan, LoadGenConfig(urls[name], progress=False, scrape_interval_s=0))
                runs[name].append(summarize(res.records, args.sla))
                time.sleep(2.0)
        print(f"\nsame rows at x{scale:.2f} ({wl.mean_rate * scale:.1f} req/s), {args.rounds} rounds each, "
              "alternating:\n| server | P50 ms (per round) | P99 ms (per round) | errors |\n"
              "|---|---|---|---|")
        for name, sums in runs.items():
            p50 = " ".join(f"{s.p50 * 1e3:.1f}" for s in sums)
            p99 = " ".join(f"{s.p99 * 1e3:.1f}" for s in sums)
            print(f"| {name} | {p50} | {p99} | {sum(s.num_requests - s.num_ok for s in sums)} |")
        med = {n: sorted(s.p99 for s in sums)[len(sums) // 2] for n, sums in runs.items()}
        print(f"median P99: plain {med['plain'] * 1e3:.1f} ms, ray x1 {med['ray x1'] * 1e3:.1f} ms: "
              f"the Ray path adds {(med['ray x1'] - med['plain']) * 1e3:+.1f} ms", flush=True)

    if importlib.util.find_spec("batchpilot.sim.fleet") is None:
        print("\nsim/fleet.py is not there: no simulator comparison")
        return 0
    profile = out / "noop-profile.json"
    CostModel(latency_coef=(args.delay_ms / 1e3, 0.0, 0.0, 0.0), meta={"source": "noop"}).save(profile)
    sim_flags = ["--max-batch-size", str(args.max_batch_size)]
    print("\nsimulator (cost model = the no-op model's fixed batch time) beside the live probe at the same "
          "scale:\n| replicas | rate scale | live P50 / P99 ms | live thru/s | sim P50 / P99 ms "
          "| sim thru/s |\n|---|---|---|---|---|---|")
    for n, cap in ((1, one), (2, two)):
        live = probe_at(cap, cap.rate_scale)
        sim = simulate(profile, sim_flags, n, cap.rate_scale, args.start, len(wl), args.sla)
        print(f"| {n} | {cap.rate_scale:.2f} | {live.p50 * 1e3:.0f} / {live.p99 * 1e3:.0f} | "
              f"{live.throughput_rps:.1f} | {sim['p50'] * 1e3:.0f} / {sim['p99'] * 1e3:.0f} | "
              f"{sim['throughput']:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
