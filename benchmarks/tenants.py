"""Tenants on one encoder server, live over HTTP with the simulator's prediction beside every figure.

    .venv/bin/python benchmarks/tenants.py [--part flood|jain|all] [--profile p.json] [--cpus 1]
                                           [--duration-s 60] [--share 0.2] [--flood 3] [--sla 1.0]

* Capacity is the simulator's: the tuner's capacity search (``bench.fidelity.predicted_capacity``) of the
  default deployment on 1,000 conv-embed rows at the SLA, from the profile (``--profile``, else a fresh
  ``batchpilot profile``). A tenant's rate is a share of it *in work*: ``share x capacity`` requests/s
  scaled by the mean length of the capacity's rows over the mean length of the tenant's own rows, so
  each tenant at 20% asks 20% of the machine's tokens whatever rows it sends.
* The flooding tenants send documents of ``LONG`` tokens (Poisson arrivals) at their share in work: a
  batch job embedding long documents. With conv-embed's short rows at 3x capacity the load is 200+
  requests/s, more than one core's HTTP front end parses while the model holds that core: requests
  then wait in the accept queue, before any scheduler sees them, for fair and FIFO alike
  (``--flood-length 0`` sends that flood; the script prints the server's own part beside it).
* ``flood``: tenants ``a``, ``b``, ``c`` send conv-embed rows (from rows 0, 4000, 8000) at ``share`` each;
  ``flood`` sends long documents at ``flood`` x capacity; all for ``duration-s`` seconds
  (``sim.tenants.tenant_mix``), each request with ``X-Client-Id: <tenant>`` and ``encoding_format:
  base64`` (the load generator's one core parses less). Two ``batchpilot serve`` processes, identical
  but for ``encoder.queue_order`` (``fair`` / ``fcfs``), replay the mix, and the fair server replays it
  without the flood (the same three tenants, alone together: what the flood must not spoil);
  ``--replays`` times, interleaved. Printed per tenant: P50 / P99 live (median over the replays, the
  P99's range) and the simulator's P99 for each run, each well-behaved tenant's fair P99 over its P99
  without the flood (target <= 1.5), and the total throughput and goodput of fair against fcfs
  (target >= 95%).
* ``jain``: tenants ``w1``, ``w2``, ``w4`` (weights 1, 2, 4 in a keys file, each request with its key)
  each send long documents at the capacity for ``duration-s`` seconds, so all three are backlogged;
  the tokens each has had answered in the middle half of the run, divided by its weight, and Jain's
  index of them (target >= 0.95), live on a fair server and in the simulator
  (``sim.tenants.backlogged_service``).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from contextlib import ExitStack
from pathlib import Path

import numpy as np

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
from batchpilot.bench.records import RequestRecord, Summary, by_tenant, summarize  # noqa: E402
from batchpilot.bench.serverproc import pin_load_generator, serve  # noqa: E402
from batchpilot.core.costmodel import CostModel  # noqa: E402
from batchpilot.core.deployment import DeploymentSpec, ModelLimits, resolve_deployment  # noqa: E402
from batchpilot.sim.service import ServiceModel  # noqa: E402
from batchpilot.sim.target import simulate_encoder  # noqa: E402
from batchpilot.sim.tenants import (  # noqa: E402
    TenantLoad,
    TenantReport,
    backlogged_service,
    compare_orders,
    jain,
    tenant_mix,
)
from batchpilot.sim.traces import load_workload  # noqa: E402

WELL_BEHAVED = ("a", "b", "c")
RUNS = ("fair", "fcfs", "without")
STARTS = {"a": 0, "b": 4000, "c": 8000, "flood": 12000}
WEIGHTS = {"w1": 1.0, "w2": 2.0, "w4": 4.0}
LONG = 512  # the flooding tenants' document length (tokens)


class Setup:
    """The profile, the deployment it resolves to, and the simulator's capacity of it."""

    def __init__(self, args: argparse.Namespace, out: Path) -> None:
        self.profile = Path(args.profile) if args.profile else run_profile(out, "none", "", args.cpus)
        self.cost = CostModel.load(self.profile)
        self.service = ServiceModel.from_profile(self.profile)
        spec = DeploymentSpec()
        self.deployment = resolve_deployment(spec, self.cost, ModelLimits.from_meta(self.cost.meta))
        self.rows = load_workload("conv-embed", count=1000)
        self.capacity = float(predicted_capacity(self.rows, self.cost, spec, self.service, args.sla).rps)

    def load(self, name: str, share: float, start: int, duration_s: float, weight: float = 1.0) -> TenantLoad:
        """A tenant asking ``share`` of the machine's work (module docstring) in conv-embed rows."""
        rate = share * self.capacity
        own = load_workload("conv-embed", start=start, count=max(2, int(rate * duration_s) + 1))
        return TenantLoad(name, rate * float(self.rows.input_tokens.mean() / own.input_tokens.mean()),
                          weight, start=start)

    def flood(self, name: str, share: float, weight: float = 1.0, length: int = LONG) -> TenantLoad:
        """A tenant asking ``share`` of the machine's work in documents of ``length`` tokens (0: in
        conv-embed rows from row 12000, at ``share`` x the capacity's requests)."""
        if length == 0:
            return TenantLoad(name, share * self.capacity, weight, start=STARTS["flood"])
        rate = share * self.capacity * float(self.rows.input_tokens.mean()) / length
        return TenantLoad(name, rate, weight, "poisson", lengths=f"constant:value={length}")


def base64(plan: list[PlannedRequest]) -> list[PlannedRequest]:
    return [dataclasses.replace(p, body={**p.body, "encoding_format": "base64"}) for p in plan]


def live(url: str, plan: list[PlannedRequest], sla_s: float, label: str, key: str | None = None
         ) -> list[RequestRecord]:
    """Replay ``plan``; ``key``: the API key the load generator asks ``GET /v1/models`` with."""
    headers = {"Authorization": f"Bearer {key}"} if key else None
    res = replay(plan, LoadGenConfig(url, progress=False, headers=headers), description=label)
    wait_idle(url, 120.0)
    return res.records


def cell(reps: list[Summary | None], r: TenantReport | None) -> str:
    ok = [s for s in reps if s is not None and s.num_ok]
    sim_part = f"{r.p99_s * 1e3:6.0f}" if r is not None and r.completed else "     -"
    if not ok:
        return f"     - /      - [  -  ] ({sim_part})"
    p50, p99 = (float(np.median([getattr(s, q) for s in ok])) * 1e3 for q in ("p50", "p99"))
    lo, hi = (f(s.p99 for s in ok) * 1e3 for f in (min, max))
    return f"{p50:6.0f} / {p99:6.0f} [{lo:.0f}-{hi:.0f}] ({sim_part})"


def serve_flags(setup: Setup, order: str, out: Path, extra: list[str] | None = None) -> list[str]:
    cfg = out / f"{order}.yaml"
    cfg.write_text(f"encoder:\n  queue_order: {order}\n")
    return ["--profile", str(setup.profile), "--config", str(cfg), "--log-level", "warning", *(extra or [])]


def part_flood(args: argparse.Namespace, setup: Setup, out: Path) -> None:
    loads = [setup.load(t, args.share, STARTS[t], args.duration_s) for t in WELL_BEHAVED]
    loads.append(setup.flood("flood", args.flood, length=args.flood_length))
    wl, table = tenant_mix(loads, args.duration_s)
    rates = ", ".join(f"{x.name} {x.rate:.2f}" for x in loads)
    print(f"flood: capacity (simulated, P99 <= {args.sla:g} s) {setup.capacity:.2f} req/s; tenants a, b, c "
          f"at {args.share:g} of it in work each, flood at {args.flood:g}x: {rates} req/s; "
          f"{len(wl)} requests over {args.duration_s:g} s; profile {setup.profile}", flush=True)
    predicted = compare_orders(wl, table, setup.deployment.scheduler, setup.cost, service=setup.service,
                               sla_s=args.sla, alone=False, without=["flood"])
    plan = base64(with_tenants(build_plan(wl, tokenizer=load_tokenizer(None), seed=0), wl))
    plans = {"fair": plan, "fcfs": plan, "without": [p for p in plan if p.tenant != "flood"]}
    runs: dict[str, list[list[RequestRecord]]] = {k: [] for k in plans}
    with ExitStack() as stack:  # both servers up; one replays at a time
        urls = {order: stack.enter_context(serve(serve_flags(setup, order, out), cpus=args.cpus,
                                                 log_path=out / f"serve-{order}.log"))
                for order in ("fair", "fcfs")}
        for j in range(args.replays):  # interleaved: each replay runs all three, the order rotating
            keys = list(plans)
            for key in keys[j % 3:] + keys[:j % 3]:
                runs[key].append(live(urls["fcfs" if key == "fcfs" else "fair"], plans[key], args.sla, key))
                print(f"replay {j + 1}: {key} done", flush=True)
    measured = {k: [by_tenant(r, args.sla) for r in v] for k, v in runs.items()}
    print(f"\ntenant  | live P50 / P99 ms, median of {args.replays} replays [P99 min-max] (simulated P99): "
          "fair | fcfs | without the flood")
    for name in (*WELL_BEHAVED, "flood"):
        cells = [cell([m.get(name) for m in measured[o]], predicted[o].get(name)) for o in RUNS]
        print(f"{name:<7} | {' | '.join(cells)}")
    print("\nthe server's own part of each answered request (Server-Timing app: handler to answer), P50 / "
          "P99 ms, first replay: a latency far above it was spent before the handler, in the front end")
    for name in (*WELL_BEHAVED, "flood"):
        cells = [server_part([r for r in runs[k][0] if r.tenant == name and r.ok]) for k in RUNS]
        print(f"{name:<7} | {' | '.join(cells)}")
    print("\nwell-behaved tenant | fair P99 / without P99: of the medians, per replay (simulated); "
          "target <= 1.5")
    for name in WELL_BEHAVED:
        fair, base = p99s(measured["fair"], name), p99s(measured["without"], name)
        per = ", ".join(f"{f / b:.2f}" for f, b in zip(fair, base, strict=True))
        sim_f, sim_b = predicted["fair"][name], predicted["without"][name]
        ratio = np.median(fair) / np.median(base)
        print(f"{name:<7} | {ratio:.2f} ({per}) ({sim_f.p99_s / sim_b.p99_s:.2f})")
    sim = {o: sum(r.goodput_rps for r in predicted[o].values()) for o in ("fair", "fcfs")}
    for j in range(args.replays):
        fair, fcfs = summarize(runs["fair"][j], args.sla), summarize(runs["fcfs"][j], args.sla)
        print(f"replay {j + 1}: fair {fair.num_ok} of {fair.num_requests} answered, goodput "
              f"{fair.goodput_rps:.2f} req/s, errors {fair.errors}; fcfs {fcfs.num_ok} answered, goodput "
              f"{fcfs.goodput_rps:.2f} req/s, errors {fcfs.errors}; fair / fcfs: throughput "
              f"{fair.throughput_rps / max(fcfs.throughput_rps, 1e-9):.1%}, goodput "
              f"{fair.goodput_rps / max(fcfs.goodput_rps, 1e-9):.1%} (simulated "
              f"{sim['fair'] / max(sim['fcfs'], 1e-9):.1%}; target >= 95%)")


def server_part(records: list[RequestRecord]) -> str:
    app = np.array([r.server_app_s for r in records], dtype=float)
    app = app[np.isfinite(app)]
    return f"{np.percentile(app, 50) * 1e3:6.0f} / {np.percentile(app, 99) * 1e3:6.0f}" if app.size else "-"


def p99s(reps: list[dict[str, Summary]], name: str) -> list[float]:
    return [m[name].p99 for m in reps if name in m and m[name].num_ok]


def answered_tokens(records: list[RequestRecord], lo: float, hi: float) -> dict[str, float]:
    """Per tenant, the input tokens of its requests answered in ``[lo, hi)`` seconds of the run."""
    out: dict[str, float] = {}
    for r in records:
        if r.ok and lo <= r.done_s < hi:
            out[r.tenant] = out.get(r.tenant, 0.0) + r.input_tokens
    return out


def part_jain(args: argparse.Namespace, setup: Setup, out: Path) -> None:
    loads = [setup.flood(t, 1.0, w) for t, w in WEIGHTS.items()]
    wl, table = tenant_mix(loads, args.duration_s)
    keys = {t: f"sk-bench-{t}-0123456789" for t in WEIGHTS}
    keys_file = out / "keys.yaml"
    keys_file.write_text("tenants:\n" + "".join(f"  {t}: {{weight: {w:g}}}\n" for t, w in WEIGHTS.items())
                         + "keys:\n" + "".join(f"  {k}: {t}\n" for t, k in keys.items()))
    print(f"jain: tenants w1, w2, w4 (weights 1, 2, 4), each at the capacity in work ({loads[0].rate:.2f} "
          f"documents of {LONG} tokens a second); {len(wl)} requests over {args.duration_s:g} s", flush=True)
    fair = dataclasses.replace(setup.deployment.scheduler, queue_order="fair")
    sim = simulate_encoder(wl, fair, setup.cost, service=setup.service, tenants=table)
    (lo, hi), sim_served = backlogged_service(sim, table)
    plan = base64(with_tenants(build_plan(wl, tokenizer=load_tokenizer(None), seed=0), wl, keys))
    flags = serve_flags(setup, "fair", out, ["--api-keys", str(keys_file)])
    with serve(flags, log_path=out / "serve-jain.log", cpus=args.cpus) as url:
        records = live(url, plan, args.sla, "weights 1:2:4", keys["w1"])
    t0 = min(r.sent_s for r in records if r.sent_s == r.sent_s)
    span = args.duration_s
    answered = answered_tokens(records, t0 + span / 4, t0 + 3 * span / 4)
    served = {t: answered.get(t, 0.0) / w for t, w in WEIGHTS.items()}
    print("tenant | weight | tokens answered / weight, live (simulated, while all three were backlogged)")
    for t, w in WEIGHTS.items():
        print(f"{t:<6} | {w:6g} | {served[t]:10.0f} ({sim_served[t]:10.0f})")
    print(f"Jain's index of the weighted service: live {jain(list(served.values())):.3f} over seconds "
          f"{span / 4:g}-{3 * span / 4:g}; simulated {jain(list(sim_served.values())):.3f} over "
          f"{lo:.1f}-{hi:.1f} s (target >= 0.95)")
    errors = summarize(records, args.sla).errors
    print(f"answered {sum(r.ok for r in records)} of {len(records)}; errors {errors}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=("flood", "jain", "all"), default="all")
    ap.add_argument("--profile", default=None, help="profile JSON (default: run `batchpilot profile`)")
    ap.add_argument("--cpus", default=None, help="pin the servers (and the profiler) to these cores")
    ap.add_argument("--duration-s", type=float, default=60.0, help="seconds of traffic per run")
    ap.add_argument("--share", type=float, default=0.2, help="each well-behaved tenant, x capacity")
    ap.add_argument("--flood", type=float, default=3.0, help="the flooding tenant, x capacity")
    ap.add_argument("--sla", type=float, default=1.0, help="the P99 target the capacity is searched at (s)")
    ap.add_argument("--replays", type=int, default=3, help="flood: replays of each run, interleaved")
    ap.add_argument("--flood-length", type=int, default=LONG,
                    help="flood: its documents' tokens (0: conv-embed's own short rows)")
    ap.add_argument("--out", default="bench-tenants", help="folder for the profile and the server logs")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    setup = Setup(args, out)
    pin_load_generator(args.cpus)
    if args.part in ("flood", "all"):
        part_flood(args, setup, out)
    if args.part in ("jain", "all"):
        part_jain(args, setup, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
