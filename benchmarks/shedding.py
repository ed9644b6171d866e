"""Latency-based shedding refuses only what would miss: false rejects and goodput, shedding on vs off.

    .venv/bin/python benchmarks/shedding.py [--profile p.json] [--cpus 1] [--sla 1.0] [--requests 1000]

Two `batchpilot serve` processes on the same model, profile and cores, identical but for
``--latency-sla``: "off" (the default deployment: no declared SLA, requests queue within the
concurrency limit and the timeout) and "on" (``--latency-sla SLA``: a request is refused when its
predicted completion misses the SLA). In one run, with every probe interleaved round-robin between
the two (``batchpilot.bench.interleave``):

1. The live capacity of each: the highest rate scale of the conv-embed rows whose P99 meets the SLA,
   refused requests counted as late (the goodput definition of docs/benchmarks.md).
2. At "off"'s capacity (the highest rate where the server without shedding meets the SLA), both
   replay the same rows twice, alternately: the share of requests "on" refuses there is its false
   reject rate (target: under 1%).
3. Above capacity (``--overload`` x that rate), both replay the same rows: goodput (requests answered
   within the SLA per second) and the admitted requests' P99.
"""

from __future__ import annotations

import argparse
import os
import sys
from contextlib import ExitStack
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from batchpilot.bench.capacity import CapacityConfig, wait_idle  # noqa: E402
from batchpilot.bench.fidelity import (
    measure,  # noqa: E402
    run_profile,  # noqa: E402
)
from batchpilot.bench.interleave import interleaved_capacity  # noqa: E402
from batchpilot.bench.loadgen import build_plan, load_tokenizer  # noqa: E402
from batchpilot.bench.serverproc import pin_load_generator, serve  # noqa: E402
from batchpilot.sim.traces import load_workload  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", default=None, help="profile JSON (default: run `batchpilot profile`)")
    ap.add_argument("--cpus", default=None, help="pin the servers (and the profiler) to these cores")
    ap.add_argument("--sla", type=float, default=1.0, help="the declared SLA and the P99 target (s)")
    ap.add_argument("--start", type=int, default=0)
    ap.add_argument("--requests", type=int, default=1000, help="conv-embed rows per replay")
    ap.add_argument("--overload", type=float, default=1.5, help="the overload point, x the capacity")
    ap.add_argument("--max-probes", type=int, default=7)
    ap.add_argument("--out", default="/tmp/batchpilot-shedding")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    profile = Path(args.profile) if args.profile else run_profile(out, "none", "", args.cpus)
    wl = load_workload("conv-embed", start=args.start, count=args.requests)
    pin_load_generator(args.cpus)
    texts = [p.body["input"] for p in build_plan(wl, tokenizer=load_tokenizer(None), seed=0)]
    arms = {"off": [], "on": ["--latency-sla", str(args.sla)]}
    ccfg = CapacityConfig(sla_s=args.sla, start=2.0, growth=1.5, lo=0.05, hi=256.0, rel_tol=0.05,
                          max_probes=args.max_probes, probe_s=1e9, cooldown_s=5.0)
    print(f"conv-embed rows {args.start}..{args.start + len(wl)} ({wl.mean_rate:.2f} req/s at x1); SLA "
          f"{args.sla:g} s; profile {profile}; load average {os.getloadavg()[0]:.1f}", flush=True)
    with ExitStack() as stack:
        urls = {name: stack.enter_context(serve(["--profile", str(profile), "--log-level", "warning", *extra],
                                                log_path=out / f"serve-{name}.log", cpus=args.cpus))
                for name, extra in arms.items()}
        caps = interleaved_capacity(wl, urls, ccfg, texts)
        for name, cap in caps.items():
            print(f"\n{name}: live capacity\n{cap.table()}", flush=True)
        k = caps["off"].rate_scale
        if k <= 0:
            print("shedding off never met the SLA: nothing to compare", file=sys.stderr)
            return 1
        print(f"\nat shedding off's capacity, x{k:.3f}: both arms twice, alternately", flush=True)
        at_cap: dict[str, list] = {name: [] for name in urls}
        for _ in range(2):
            for name, url in urls.items():
                at_cap[name].append(measure(url, wl.scale_rate(k), texts, args.sla, 0, False, name).summary)
                wait_idle(url, 10.0)
        over = k * args.overload
        print(f"overload, x{over:.3f} ({args.overload:g} x capacity)", flush=True)
        at_over = {}
        for name, url in urls.items():
            at_over[name] = measure(url, wl.scale_rate(over), texts, args.sla, 0, False, name).summary
            wait_idle(url, 15.0)
    print(f"\narm   capacity x  capacity req/s | at x{k:.3f}: refused  P99 ms (2 runs) | at x{over:.3f}: "
          "refused  goodput req/s  admitted P99 ms")
    for name in urls:
        c, runs, o = caps[name], at_cap[name], at_over[name]
        refused = sum(s.num_requests - s.num_ok for s in runs)
        total = sum(s.num_requests for s in runs)
        p99s = " / ".join(f"{s.p99 * 1e3:.0f}" for s in runs)
        print(f"{name:<5} {c.rate_scale:10.3f} {c.rps:15.2f} | {refused:5d} of {total} "
              f"({refused / total:.2%})  {p99s:>12} | {o.num_requests - o.num_ok:5d} of {o.num_requests}  "
              f"{o.goodput_rps:13.2f}  {o.p99 * 1e3:15.0f}")
    runs = at_cap["on"]
    rate = sum(s.num_requests - s.num_ok for s in runs) / sum(s.num_requests for s in runs)
    print(f"\nfalse rejects (shedding on, at the highest rate where shedding off meets the SLA): {rate:.2%} "
          f"(target < 1%); goodput at {args.overload:g}x: on {at_over['on'].goodput_rps:.2f} vs off "
          f"{at_over['off'].goodput_rps:.2f} req/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
