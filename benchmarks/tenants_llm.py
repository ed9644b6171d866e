"""A flooding tenant against three well-behaved ones on the LLM engine (conv-llm): each tenant's TTFT and
time per output token under ``--scheduling-policy fair``, under FCFS and without the flood, live over
HTTP (streamed ``/v1/completions``) with the simulator's prediction beside every figure.

    .venv/bin/python benchmarks/tenants_llm.py [--profile llm_profile.json] [--cpus 1] [--duration-s 60]
                                               [--share 0.2] [--flood 3] [--sla 2.0]

* The engine is the one ``serve --llm`` builds (the built-in tiny Llama), profiled first unless
  ``--profile`` names an LLM profile (``batchpilot profile --llm``), pinned like the server.
* Capacity is the simulator's: the capacity search of ``bench fidelity --workload conv-llm`` (the rate
  of 400 conv-llm rows whose TTFT P99 stays within ``--sla``).
* Tenants ``a``, ``b``, ``c`` send conv-llm rows (from rows 0, 2000, 4000) at ``share`` x capacity each,
  ``flood`` rows from 6000 at ``flood`` x capacity, for ``duration-s`` seconds, each request with
  ``X-Client-Id: <tenant>``. Two servers identical but for the policy (``fair`` / ``fcfs``) replay the
  mix; then the fair server replays it without the flood (the same three tenants alone together).
* Printed per tenant: TTFT P50 / P99 and TPOT P99 live (simulated) for each run, each well-behaved
  tenant's fair TTFT P99 and TPOT P99 over its figure without the flood, and the output tokens/s of all
  answered requests, fair against fcfs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from batchpilot.bench.capacity import CapacityConfig, search_capacity, wait_idle  # noqa: E402
from batchpilot.bench.llm_fidelity import engine_config_and_profile, simulate  # noqa: E402
from batchpilot.bench.loadgen import LoadGenConfig, PlannedRequest, build_plan, replay, with_tenants  # noqa: E402
from batchpilot.bench.records import RequestRecord, Summary, by_tenant, summarize  # noqa: E402
from batchpilot.bench.serverproc import cores, pin_load_generator, serve  # noqa: E402
from batchpilot.core.costmodel import CostModel  # noqa: E402
from batchpilot.core.deployment import DeploymentSpec  # noqa: E402
from batchpilot.sim.llm import LLMServiceModel  # noqa: E402
from batchpilot.sim.tenants import LLMTenantReport, TenantLoad, compare_llm_policies, tenant_mix  # noqa: E402
from batchpilot.sim.traces import load_workload  # noqa: E402

WELL_BEHAVED = ("a", "b", "c")
STARTS = {"a": 0, "b": 2000, "c": 4000, "flood": 6000}
RUNS = ("fair", "fcfs", "without")


def live(url: str, plan: list[PlannedRequest], label: str) -> list[RequestRecord]:
    res = replay(plan, LoadGenConfig(url, "completions", progress=False, scrape_interval_s=0),
                 description=label)
    wait_idle(url, 120.0)
    return res.records


def cell(s: Summary | None, r: LLMTenantReport | None) -> str:
    if s is None or not s.num_ok:
        return "-"
    sim = (f"({r.ttft_p99_s * 1e3:.0f}, {r.tpot_p99_s * 1e3:.0f})" if r is not None and r.completed
           else "(-)")
    return f"{s.ttft['p50'] * 1e3:5.0f} / {s.ttft['p99'] * 1e3:6.0f}, {s.tpot['p99'] * 1e3:5.0f} {sim}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", default=None,
                    help="LLM profile JSON (default: run `batchpilot profile --llm`)")
    ap.add_argument("--cpus", default=None, help="pin the servers (and the profiler) to these cores")
    ap.add_argument("--duration-s", type=float, default=60.0, help="seconds of arrivals per run")
    ap.add_argument("--share", type=float, default=0.2, help="each well-behaved tenant, x capacity")
    ap.add_argument("--flood", type=float, default=3.0, help="the flooding tenant, x capacity")
    ap.add_argument("--sla", type=float, default=2.0, help="the TTFT P99 the capacity is searched at (s)")
    ap.add_argument("--out", default="bench-tenants-llm", help="folder for the profile and the server logs")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    config, profile = engine_config_and_profile(out, DeploymentSpec(), args.profile, args.cpus)
    cost, service = CostModel.load(profile), LLMServiceModel.from_profile(profile)
    rows = load_workload("conv-llm", count=400)
    search = CapacityConfig(sla_s=args.sla, rel_tol=0.03, max_probes=30, lo=1e-3, hi=256.0)
    cap = search_capacity(lambda k: simulate(rows.scale_rate(k), config, cost, args.sla, service)[0],
                          search).rps
    loads = [TenantLoad(t, args.share * cap, workload="conv-llm", start=STARTS[t]) for t in WELL_BEHAVED]
    loads.append(TenantLoad("flood", args.flood * cap, workload="conv-llm", start=STARTS["flood"]))
    wl, table = tenant_mix(loads, args.duration_s)
    print(f"capacity (simulated, TTFT P99 <= {args.sla:g} s): {cap:.2f} req/s; a, b, c at {args.share:g}x "
          f"= {args.share * cap:.2f} req/s each, flood at {args.flood:g}x = {args.flood * cap:.2f} req/s; "
          f"{len(wl)} requests over {args.duration_s:g} s; engine {config}; profile {profile}", flush=True)
    predicted = compare_llm_policies(wl, table, config, cost, service=service, without=["flood"])
    plan = with_tenants(build_plan(wl, "completions", seed=0), wl)
    pin_load_generator(args.cpus)
    base = ["--llm", "--log-level", "warning", "--no-warmup"]
    if args.cpus:
        base += ["--threads", str(len(cores(args.cpus)))]
    runs: dict[str, list[RequestRecord]] = {}
    for policy in ("fair", "fcfs"):
        flags = [*base, "--scheduling-policy", policy]
        with serve(flags, log_path=out / f"serve-llm-{policy}.log", cpus=args.cpus) as url:
            warm = build_plan(wl.slice(0, 2), "completions", warmup_requests=2)
            replay(warm, LoadGenConfig(url, "completions", progress=False, scrape_interval_s=0))
            wait_idle(url, 30.0)
            runs[policy] = live(url, plan, policy)
            print(f"{policy}: done", flush=True)
            if policy == "fair":
                runs["without"] = live(url, [p for p in plan if p.tenant != "flood"], "no flood")
                print("without the flood: done", flush=True)
    measured = {k: by_tenant(v, args.sla) for k, v in runs.items()}
    print("\ntenant | live TTFT P50 / P99, TPOT P99 ms (simulated TTFT P99, TPOT P99): fair | fcfs | without "
          "the flood | fair / without: TTFT P99, TPOT P99 (simulated)")
    for name in (*WELL_BEHAVED, "flood"):
        cells = [cell(measured[k].get(name), predicted[k].get(name)) for k in RUNS]
        fair, alone = measured["fair"].get(name), measured["without"].get(name)
        ratio = "-"
        if fair and alone and fair.num_ok and alone.num_ok:
            ratio = f"{fair.ttft['p99'] / alone.ttft['p99']:.2f}, {fair.tpot['p99'] / alone.tpot['p99']:.2f}"
            f, w = predicted["fair"].get(name), predicted["without"].get(name)
            if f and w and w.completed:
                ratio += f" ({f.ttft_p99_s / w.ttft_p99_s:.2f}, {f.tpot_p99_s / w.tpot_p99_s:.2f})"
        print(f"{name:<6} | {' | '.join(cells)} | {ratio}")
    for name in ("fair", "fcfs"):
        t = summarize(runs[name], args.sla)
        sim = sum(r.output_tokens_s for r in predicted[name].values())
        print(f"{name}: {t.num_ok} of {t.num_requests} answered; output {t.output_tokens_per_s:.0f} tok/s "
              f"(simulated {sim:.0f}); errors {t.errors}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
