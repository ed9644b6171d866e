"""Live goodput at P99 <= SLA on conv-embed over HTTP: ``--dtype auto`` vs ``--dtype float32``.

    .venv/bin/python benchmarks/precision_goodput.py [--sla 1.0] [--requests 1000] [--cpus 1]

Two ``batchpilot serve`` processes, identical but for ``--dtype``: float32 (the baseline) and auto
(the fastest precision this machine supports that passes the accuracy guard, measured at start-up).
Each measures its own start-up profile at its own precision (the cost model its policy and budgets
use), with the default config otherwise. The live capacity of each, the highest rate scale of the same
conv-embed rows whose P99 meets the SLA (refused requests count as late), is searched with every probe
interleaved round-robin between the two (``batchpilot.bench.interleave``): the goodput ratio is the
capacity ratio. The auto server's choice is read from its ``/metrics``.
"""

from __future__ import annotations

import argparse
import os
from contextlib import ExitStack
from pathlib import Path

import httpx

from batchpilot.bench.capacity import CapacityConfig
from batchpilot.bench.interleave import interleaved_capacity
from batchpilot.bench.loadgen import build_plan, load_tokenizer
from batchpilot.bench.scrape import parse_metrics
from batchpilot.bench.serverproc import pin_load_generator, serve
from batchpilot.sim.traces import load_workload


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpus", default=None, help="pin the servers to these cores")
    ap.add_argument("--sla", type=float, default=1.0)
    ap.add_argument("--start", type=int, default=0)
    ap.add_argument("--requests", type=int, default=1000, help="conv-embed rows per probe")
    ap.add_argument("--max-probes", type=int, default=7)
    ap.add_argument("--out", default="/tmp/batchpilot-precision")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    wl = load_workload("conv-embed", start=args.start, count=args.requests)
    pin_load_generator(args.cpus)
    texts = [p.body["input"] for p in build_plan(wl, tokenizer=load_tokenizer(None), seed=0)]
    arms = {"float32": ["--dtype", "float32"], "auto": ["--dtype", "auto"]}
    ccfg = CapacityConfig(sla_s=args.sla, start=2.0, growth=1.5, lo=0.05, hi=256.0, rel_tol=0.05,
                          max_probes=args.max_probes, probe_s=1e9, cooldown_s=5.0)
    print(f"conv-embed rows {args.start}..{args.start + len(wl)} ({wl.mean_rate:.2f} req/s at x1); SLA "
          f"{args.sla:g} s; load average {os.getloadavg()[0]:.1f}", flush=True)
    with ExitStack() as stack:
        urls = {name: stack.enter_context(serve(["--log-level", "warning", *extra],
                                                log_path=out / f"serve-{name}.log", cpus=args.cpus))
                for name, extra in arms.items()}
        chosen = {}
        for name, url in urls.items():
            m = parse_metrics(httpx.get(url + "/metrics").text)
            info = [k for k, v in m.items() if k.startswith("batchpilot_precision_info") and v == 1]
            chosen[name] = (info[0].split("dtype=")[1].rstrip("}") if info else "?",
                            m.get("batchpilot_precision_min_cosine", float("nan")))
            print(f"{name}: serves {chosen[name][0]} (guard min cosine {chosen[name][1]:.5f})", flush=True)
        caps = interleaved_capacity(wl, urls, ccfg, texts)
    for name, cap in caps.items():
        print(f"\n{name}: live capacity\n{cap.table()}", flush=True)
    base = caps["float32"].rps
    print("\n| arm | precision served | capacity x | goodput req/s at P99 <= SLA | ratio |")
    print("|---|---|---|---|---|")
    for name, cap in caps.items():
        ratio = cap.rps / base if base > 0 else float("nan")
        print(f"| {name} | {chosen[name][0]} | {cap.rate_scale:.3f} | {cap.rps:.2f} | {ratio:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
