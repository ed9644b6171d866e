"""A flooding tenant against three well-behaved ones: each well-behaved tenant's P99 under the fair order,
under FIFO and alone, live over HTTP with the simulator's prediction beside it.

    .venv/bin/python benchmarks/tenants.py [--profile p.json] [--cpus 1] [--duration-s 60] [--share 0.2]
                                           [--flood 3] [--sla 1.0] [--noop-delay-ms MS]

* Capacity is the simulator's: the tuner's capacity search (``bench.fidelity.predicted_capacity``) of the
  default deployment on 1,000 conv-embed rows at the SLA, from the profile (``--profile``, else a fresh
  ``batchpilot profile``; ``--noop-delay-ms`` serves the no-op model at a fixed time per batch instead,
  with its exact cost model: the serving path alone).
* Tenants ``a``, ``b``, ``c`` each send conv-embed rows (from rows 0, 4000, 8000) at ``share`` x capacity;
  ``flood`` sends rows from 12000 at ``flood`` x capacity; all for ``duration-s`` seconds
  (``sim.tenants.tenant_mix``), each request with ``X-Client-Id: <tenant>``.
* Two ``batchpilot serve`` processes on the same profile and cores, identical but for
  ``encoder.queue_order`` (``fair`` / ``fcfs``), replay the mix one after the other; then each
  well-behaved tenant's own rows alone, on the fair server.
* The simulator predicts the same runs (``sim.tenants.compare_orders``, the profile's service model).

Printed: per tenant, P50 / P99 live and the simulator's P99, for fair, fcfs and alone; each
well-behaved tenant's fair P99 over its alone P99 (target <= 1.5); the total throughput and goodput of
fair against fcfs (target >= 95%).
"""

from __future__ import annotations

import argparse
import sys
from contextlib import ExitStack
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from batchpilot.bench.capacity import wait_idle  # noqa: E402
from batchpilot.bench.fidelity import predicted_capacity, run_profile  # noqa: E402
from batchpilot.bench.loadgen import (  # noqa: E402
    LoadGenConfig,
    PlannedRequest,
    build_plan,
    load_tokenizer,
    replay,
    with_tenants,
)
from batchpilot.bench.records import Summary, by_tenant, summarize  # noqa: E402
from batchpilot.bench.serverproc import pin_load_generator, serve  # noqa: E402
from batchpilot.core.costmodel import CostModel  # noqa: E402
from batchpilot.core.deployment import DeploymentSpec, ModelLimits, resolve_deployment  # noqa: E402
from batchpilot.sim.service import ServiceModel  # noqa: E402
from batchpilot.sim.tenants import TenantLoad, TenantReport, compare_orders, tenant_mix  # noqa: E402
from batchpilot.sim.traces import load_workload  # noqa: E402

WELL_BEHAVED = ("a", "b", "c")
STARTS = {"a": 0, "b": 4000, "c": 8000, "flood": 12000}


def profile_and_serve_args(args: argparse.Namespace, out: Path) -> tuple[Path, list[str]]:
    if args.noop_delay_ms is not None:
        profile = out / "noop_profile.json"
        CostModel(latency_coef=(args.noop_delay_ms / 1e3, 0.0, 0.0, 0.0),
                  meta={"source": f"noop {args.noop_delay_ms:g} ms per batch"}).save(profile)
        return profile, ["--noop", "--noop-delay-ms", str(args.noop_delay_ms), "--profile", str(profile)]
    profile = Path(args.profile) if args.profile else run_profile(out, "none", "", args.cpus)
    return profile, ["--profile", str(profile)]


def predict(args: argparse.Namespace, profile: Path) -> tuple[float, Any, CostModel, ServiceModel | None]:
    """The simulator's capacity (req/s) of the default deployment, the deployment, its inputs."""
    cost = CostModel.load(profile)
    service = ServiceModel.from_profile(profile) if args.noop_delay_ms is None else None
    spec = DeploymentSpec()
    deployment = resolve_deployment(spec, cost, ModelLimits.from_meta(cost.meta))
    cap = predicted_capacity(load_workload("conv-embed", count=1000), cost, spec, service, args.sla)
    return float(cap.rps), deployment, cost, service


def live(url: str, plan: list[PlannedRequest], sla_s: float,
         label: str) -> tuple[Summary, dict[str, Summary]]:
    res = replay(plan, LoadGenConfig(url, progress=False), description=label)
    wait_idle(url, 90.0)
    return summarize(res.records, sla_s), by_tenant(res.records, sla_s)


def fmt(s: Summary | None, r: TenantReport | None) -> str:
    live_part = f"{s.p50 * 1e3:6.0f} / {s.p99 * 1e3:6.0f}" if s is not None and s.num_ok else "-"
    sim_part = f"{r.p99_s * 1e3:6.0f}" if r is not None and r.completed else "     -"
    return f"{live_part} ({sim_part})"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", default=None, help="profile JSON (default: run `batchpilot profile`)")
    ap.add_argument("--noop-delay-ms", type=float, default=None,
                    help="serve the no-op model at this fixed time per batch (no profile needed)")
    ap.add_argument("--cpus", default=None, help="pin the servers (and the profiler) to these cores")
    ap.add_argument("--duration-s", type=float, default=60.0, help="seconds of traffic per run")
    ap.add_argument("--share", type=float, default=0.2, help="each well-behaved tenant, x capacity")
    ap.add_argument("--flood", type=float, default=3.0, help="the flooding tenant, x capacity")
    ap.add_argument("--sla", type=float, default=1.0, help="the P99 target the capacity is searched at (s)")
    ap.add_argument("--out", default="bench-tenants", help="folder for the profile and the server logs")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    profile, serve_args = profile_and_serve_args(args, out)
    cap, deployment, cost, service = predict(args, profile)
    loads = [TenantLoad(t, args.share * cap, start=STARTS[t]) for t in WELL_BEHAVED]
    loads.append(TenantLoad("flood", args.flood * cap, start=STARTS["flood"]))
    wl, table = tenant_mix(loads, args.duration_s)
    print(f"capacity (simulated, P99 <= {args.sla:g} s): {cap:.2f} req/s; tenants a, b, c at {args.share:g}x "
          f"= {args.share * cap:.2f} req/s each, flood at {args.flood:g}x = {args.flood * cap:.2f} req/s; "
          f"{len(wl)} requests over {args.duration_s:g} s; profile {profile}", flush=True)
    predicted = compare_orders(wl, table, deployment.scheduler, cost, service=service, sla_s=args.sla)
    pin_load_generator(args.cpus)
    plan = with_tenants(build_plan(wl, tokenizer=load_tokenizer(None), seed=0), wl)
    measured: dict[str, dict[str, Summary]] = {"alone": {}}
    totals: dict[str, Summary] = {}
    with ExitStack() as stack:
        urls = {}
        for order in ("fair", "fcfs"):
            cfg = out / f"{order}.yaml"
            cfg.write_text(f"encoder:\n  queue_order: {order}\n")
            flags = [*serve_args, "--config", str(cfg), "--log-level", "warning"]
            log = out / f"serve-{order}.log"
            urls[order] = stack.enter_context(serve(flags, log_path=log, cpus=args.cpus))
        for order, url in urls.items():
            totals[order], measured[order] = live(url, plan, args.sla, order)
            print(f"{order}: done", flush=True)
        for name in WELL_BEHAVED:
            _, alone = live(urls["fair"], [p for p in plan if p.tenant == name], args.sla, f"{name} alone")
            measured["alone"].update(alone)
    report(measured, predicted, totals, args)
    return 0


def report(measured: dict[str, dict[str, Summary]], predicted: dict[str, dict[str, TenantReport]],
           totals: dict[str, Summary], args: argparse.Namespace) -> None:
    print("\ntenant  | live P50 / P99 ms (simulated P99), fair | fcfs | alone | fair P99 / alone P99")
    for name in (*WELL_BEHAVED, "flood"):
        cells = [fmt(measured[o].get(name), predicted[o].get(name)) for o in ("fair", "fcfs", "alone")]
        fair, alone = measured["fair"].get(name), measured["alone"].get(name)
        ratio = f"{fair.p99 / alone.p99:.2f}" if fair and alone and fair.num_ok and alone.num_ok else "-"
        print(f"{name:<7} | {' | '.join(cells)} | {ratio}")
    for name in ("fair", "fcfs"):
        t = totals[name]
        print(f"{name}: {t.num_ok} of {t.num_requests} answered; throughput {t.throughput_rps:.2f} req/s, "
              f"goodput {t.goodput_rps:.2f} req/s; errors {t.errors}")
    fair, fcfs = totals["fair"], totals["fcfs"]
    print(f"fair / fcfs: throughput {fair.throughput_rps / max(fcfs.throughput_rps, 1e-9):.1%}, "
          f"goodput {fair.goodput_rps / max(fcfs.goodput_rps, 1e-9):.1%} (target >= 95%)")


if __name__ == "__main__":
    raise SystemExit(main())
