"""``batchpilot simulate`` and ``batchpilot tune``: the simulator and the tuner on the command line.

    batchpilot simulate --workload conv-embed --rate-scale 4 --config cfg.yaml [--profile p.json]
                        [--requests N] [--plot out/]
    batchpilot tune --workload conv-embed --sla-p99 1.0 [--profile p.json] -o best.yaml

``--workload`` is a standard workload (conv-embed, conv-llm), a trace file (Azure CSV, Mooncake JSONL,
batchpilot CSV) or a synthetic spec (``poisson:rate=20``, ``renewal:rate=20,cv=3``,
``mmpp:rate_on=40,rate_off=4,on_s=10,off_s=30``, ``diurnal:rate=20,amplitude=0.5,period_s=600``)
with ``--lengths`` (``lognormal:median=128,sigma=0.8``, ``bimodal:...``, ``empirical`` = conv-embed's).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import batchpilot.sim.tune as tune_module
from batchpilot.core.autoscale import AutoscaleConfig
from batchpilot.core.config import SchedulerConfig
from batchpilot.core.costmodel import CostModel
from batchpilot.core.deployment import Deployment, DeploymentSpec, ModelLimits, resolve_deployment
from batchpilot.settings import add_deployment_args, add_llm_args, rollout_from_args, spec_from_args
from batchpilot.sim.arms import arms_table, client_keys, simulate_arms
from batchpilot.sim.draws import DEFAULT_DRAWS, Drawn, encoder_draws, spread_table
from batchpilot.sim.fleet import FleetScaling, replicas_table, scaling_table, simulate_fleet
from batchpilot.sim.metrics import SimReport, report_table, summarize
from batchpilot.sim.router import ROUTERS
from batchpilot.sim.service import ServiceModel
from batchpilot.sim.synthetic import ARRIVALS, named_workload
from batchpilot.sim.target import SimRun, draws_batch_times, simulate_encoder
from batchpilot.sim.tenants import (
    TenantLoad,
    compare_llm_policies,
    compare_orders,
    llm_tenants_table,
    tenant_mix,
    tenants_table,
)
from batchpilot.sim.traces import STANDARD_WORKLOADS, Workload
from batchpilot.sim.tune import (
    TuneConfig,
    Tuner,
    explain,
    fleet_table,
    result_table,
    tune_fleet,
    tune_variants,
    variants_table,
    write_fleet_yaml,
    write_variant_yaml,
    write_yaml,
)

LONG_RUN = 50_000  # show a progress bar from this many requests


def register(subparsers: Any) -> None:
    register_simulate(subparsers)
    register_tune(subparsers)


# -- the parsers --------------------------------------------------------------------------------

def register_simulate(subparsers: Any) -> None:
    p = subparsers.add_parser("simulate", help="predict latency and throughput of a config on a workload",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(p)
    add_deployment_args(p)
    add_llm_args(p)
    p.add_argument("--sla", type=float, default=1.0,
                   help="latency target in seconds for the report's attainment and goodput (reporting "
                        "only; --latency-sla declares one that the server sheds load for)")
    p.add_argument("--request-sla", type=float, default=None,
                   help="give every request this deadline (s after arrival); SLA-aware policies and "
                        "deadline drops use it")
    p.add_argument("--noise", action="store_true", help="draw batch times from the profile's residuals")
    p.add_argument("--draws", type=int, default=DEFAULT_DRAWS,
                   help="with drawn batch times (--noise, or a profile with noise): replay the "
                        "requests under this many noise draws and report each metric's median and 5-95%% "
                        "band, the range one live run of them should fall in (1: one draw; each draw is "
                        "a full simulation)")
    p.add_argument("--batcher-only", action="store_true",
                   help="leave out the profile's service model (HTTP, JSON, tokenisation, loaded batches) "
                        "and predict the batcher's latency alone")
    p.add_argument("--plot", metavar="DIR", help="write latency CDF, queue length and batch size PNGs here")
    p.add_argument("--json", metavar="PATH", help="also write the report as JSON")
    p.add_argument("--target", choices=("encoder", "llm"), default=None,
                   help="which scheduler to drive (default: llm for conv-llm, else encoder)")
    p.add_argument("--samples", type=int, default=1, metavar="N",
                   help="llm: sequences per request (the API's n), sharing the prompt's KV blocks")
    p.add_argument("--structured-share", type=float, default=0.0, metavar="F",
                   help="llm: the share of requests under a grammar (structured outputs), each of their "
                        "steps priced by the profile's structured_s_per_seq")
    add_fleet_args(p)
    add_arms_args(p)
    p.set_defaults(func=run_simulate)


def register_tune(subparsers: Any) -> None:
    p = subparsers.add_parser("tune", help="find the config with the highest rate inside a P99 SLA",
                              description=tune_module.__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(p)
    add_deployment_args(p, config_help="base config (its encoder admission, max_len, num_slots and its "
                                       "server section are kept)")
    p.set_defaults(requests=8000)
    p.add_argument("--sla-p99", type=float, default=1.0, help="P99 latency SLA in seconds")
    p.add_argument("--batcher-only", action="store_true",
                   help="leave out the profile's service model (HTTP, JSON, tokenisation, loaded batches)")
    p.add_argument("-o", "--output", default="best.yaml", help="where to write the winning config")
    p.add_argument("--candidates", type=int, default=TuneConfig.candidates, help="grid points sampled")
    p.add_argument("--paddings", default="max,dynamic,bucket,none",
                   help="padding modes the serving executor supports (comma-separated)")
    p.add_argument("--noise", action="store_true", help="draw batch times from the profile's residuals")
    p.add_argument("--plot", metavar="DIR", help="write goodput_vs_rate.png for the top configs here")
    p.add_argument("--profile-variants", nargs="+", metavar="PROFILE", default=None,
                   help="one profile per backend/precision (`batchpilot profile --all-backends`): search "
                        "each and write the best variant's model: section too (sim/tune.py)")
    p.add_argument("--max-replicas", type=int, default=None, metavar="M",
                   help="find the fewest replicas (1..M) that hold --sla-p99 at the workload's rate, and "
                        "their per-replica config (sim/tune.py)")
    p.add_argument("--router", choices=ROUTERS, default="power_of_two",
                   help="how a fleet spreads requests (with --max-replicas; default power_of_two)")
    p.set_defaults(func=run_tune)


def add_fleet_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--replicas", type=int, default=1,
                   help="run this many replicas of the deployment, each its own scheduler and slots "
                        "(sim/fleet.py; encoder target)")
    p.add_argument("--router", choices=ROUTERS, default="power_of_two",
                   help="how requests are spread over the replicas (default power_of_two, Ray Serve's)")
    p.add_argument("--autoscale", metavar="MIN:MAX", default=None,
                   help="scale the fleet between MIN and MAX replicas with core.autoscale "
                        "(sim/fleet.py); replaces --replicas")
    p.add_argument("--start-delay-s", type=float, default=30.0,
                   help="with --autoscale: seconds a new replica takes before it takes traffic")


def add_arms_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("arms (the config's arms: section, or --canary; docs/rollout.md)")
    g.add_argument("--canary", default=None, metavar="CONFIG", help="simulate this config as a candidate arm")
    g.add_argument("--canary-share", type=float, default=None, help="--canary: its share (default 0.1)")
    g.add_argument("--clients", type=int, default=200,
                   help="with arms: clients the rows come from (their keys pick the arms, as bench ab sends)")


def add_workload_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workload", default="conv-embed",
                   help=f"{', '.join(STANDARD_WORKLOADS)}, a trace file, or a synthetic spec "
                        f"({', '.join(ARRIVALS)}:key=value,...)")
    p.add_argument("--trace", help="another trace file of the Azure schema for conv-embed / conv-llm")
    p.add_argument("--rate-scale", type=float, default=1.0, help="speed up time k times (rate x k)")
    p.add_argument("--start", type=int, default=0, help="first row of the contiguous slice")
    p.add_argument("--requests", type=int, default=None,
                   help="number of rows (default: all; synthetic 10000)")
    p.add_argument("--lengths", default="lognormal:median=128,sigma=0.8",
                   help="synthetic lengths: lognormal:..., bimodal:..., constant:value=N, empirical")
    p.add_argument("--priorities", default="",
                   help="synthetic priority mix, e.g. '0:0.9,-1:0.1' (lower value is served first)")
    p.add_argument("--warmup-s", type=float, default=0.0, help="leave requests arriving before this out")
    p.add_argument("--profile",
                   help="profile JSON from `batchpilot profile` (default: a stated CPU MiniLM model)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tenant", action="append", default=None, metavar="NAME:rate=R[,weight=W,...]",
                   help="a tenant's traffic (repeat for each): requests/s, weight, workload (conv-embed or "
                        "a synthetic kind), start row, lengths; replaces --workload, and the report gives "
                        "each tenant's latency under the fair order, FIFO, and alone (docs/tenants.md)")
    p.add_argument("--duration-s", type=float, default=120.0, help="--tenant: seconds of traffic")


# -- from the parsed flags to the library's arguments --------------------------------------------

def scaling_from_args(args: argparse.Namespace) -> FleetScaling | None:
    """``--autoscale MIN:MAX`` as a ``FleetScaling`` (None without it)."""
    if not args.autoscale:
        return None
    try:
        lo, hi = (int(x) for x in str(args.autoscale).split(":"))
    except ValueError:
        raise ValueError(f"--autoscale wants MIN:MAX (two integers), got {args.autoscale!r}") from None
    if args.replicas != 1:
        raise ValueError("--autoscale sets the replica count: leave out --replicas")
    return FleetScaling(AutoscaleConfig(min_replicas=lo, max_replicas=hi), start_delay_s=args.start_delay_s)


def tune_config(args: argparse.Namespace) -> TuneConfig:
    return TuneConfig(sla_p99_s=args.sla_p99, candidates=args.candidates, noise=args.noise, seed=args.seed,
                      warmup_s=args.warmup_s, paddings=tuple(x.strip() for x in args.paddings.split(",")))


def resolve_workload(args: argparse.Namespace) -> Workload:
    return named_workload(str(args.workload), trace=args.trace, rate_scale=args.rate_scale, start=args.start,
                          requests=args.requests, lengths=args.lengths, priorities=args.priorities,
                          seed=args.seed)


def make_console() -> Any:
    """A rich console; wide when output is not a terminal (logs, CI) so tables do not wrap."""
    from rich.console import Console

    console = Console()
    return console if console.is_terminal else Console(width=160)


def load_cost_model(args: argparse.Namespace, console: Any) -> CostModel:
    if args.profile:
        return CostModel.load(args.profile)
    console.print("[yellow]no --profile: using CostModel.default_cpu_minilm() (all-MiniLM-L6-v2 on 2 shared "
                  "CPU cores, a stated default); run `batchpilot profile` for this machine's numbers[/]")
    return CostModel.default_cpu_minilm()


def resolve(spec: DeploymentSpec, cost_model: CostModel) -> Deployment:
    """The deployment ``serve`` would run with this spec and profile (``core.deployment``), with the
    model limits the profile recorded."""
    return resolve_deployment(spec, cost_model, ModelLimits.from_meta(cost_model.meta))


def load_service(args: argparse.Namespace) -> ServiceModel | None:
    """The service model, from the profile file and nowhere else (None with ``--batcher-only``)."""
    if getattr(args, "batcher_only", False) or not getattr(args, "profile", None):
        return None
    return ServiceModel.from_profile(args.profile)




def _refuse(console: Any, command: str, why: object) -> int:
    console.print(f"[red]batchpilot {command}: {why}[/]")
    return 2


# -- batchpilot simulate ------------------------------------------------------------------------

def run_simulate(args: argparse.Namespace) -> int:
    console = make_console()
    try:
        workload = resolve_workload(args)
        spec = spec_from_args(args)
    except (ValueError, FileNotFoundError, KeyError) as exc:
        return _refuse(console, "simulate", exc)
    target = args.target or ("llm" if args.workload == "conv-llm" else "encoder")
    try:
        scaling = scaling_from_args(args)
    except ValueError as exc:
        return _refuse(console, "simulate", exc)
    if args.draws < 1:
        return _refuse(console, "simulate", f"--draws must be >= 1, got {args.draws}")
    if args.replicas < 1 or ((args.replicas > 1 or scaling) and target == "llm"):
        return _refuse(console, "simulate", "--replicas must be >= 1, and fleets run the encoder target only")
    if target == "llm":
        return run_llm(args, workload, spec, console)
    return run_encoder(args, workload, spec, scaling, console)


def run_llm(args: argparse.Namespace, workload: Workload, spec: DeploymentSpec, console: Any) -> int:
    """``simulate --target llm``: the engine ``serve --llm`` would build for ``spec`` on the profile's
    machine (``sim.llm.planned_llm_config``), and its report."""
    try:
        from batchpilot.sim.llm import (
            LLMRequests,
            LLMServiceModel,
            default_llm_cost_model,
            planned_llm_config,
            simulate_llm,
        )
    except ImportError as exc:
        console.print(f"[red]the LLM simulator target is not available: {exc}[/]")
        return 2
    from rich.table import Table

    try:
        dep = planned_llm_config(spec, args.profile)
    except ValueError as exc:
        return _refuse(console, "simulate", exc)
    console.print("\n".join(f"llm deployment: {line}" for line in (*dep.notes, dep.describe())))
    if dep.plan is not None:
        console.print(f"llm memory: {dep.plan.describe()}")
    service = None
    if args.profile:
        cost_model = CostModel.load(args.profile)
        service = LLMServiceModel.from_profile(args.profile)  # the serving path, when the profile has it
    else:
        console.print("[yellow]no --profile: using the stated default_llm_cost_model() (tiny Llama on 2 CPU "
                      "cores)[/]")
        cost_model = default_llm_cost_model()
    if args.tenant:
        return run_llm_tenants(args, console, dep.config, cost_model, service)
    try:
        run = simulate_llm(workload, dep.config, cost_model, noise=args.noise, seed=args.seed,
                           service=service, requests=LLMRequests(args.samples, args.structured_share))
    except ValueError as exc:
        return _refuse(console, "simulate", exc)
    report = run.report(warmup_s=args.warmup_s)
    table = Table(title=f"{workload.name}: {len(workload)} requests (LLM, iteration-level scheduling)")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for k, v in report.rows():
        table.add_row(k, v)
    console.print(table)
    if run.stats.stalled:
        console.print("[red]the scheduler left requests unfinished with nothing scheduled (stalled)[/]")
        return 1
    return 0


def run_encoder(args: argparse.Namespace, workload: Workload, spec: DeploymentSpec,
                scaling: FleetScaling | None, console: Any) -> int:
    """``simulate`` of the encoder deployment: one replica, a fleet, or the config's arms."""
    cost_model = load_cost_model(args, console)
    try:
        deployment = resolve(spec, cost_model)
    except ValueError as exc:
        return _refuse(console, "simulate", exc)
    config = deployment.scheduler
    for note in deployment.notes:
        console.print(f"deployment: {note}")
    console.print(f"deployment: {deployment.describe()}")
    service = load_service(args)
    if service is None and not args.batcher_only:
        console.print("[yellow]the profile has no service model ('service'): predicting the batcher alone; "
                      "re-run `batchpilot profile` to include HTTP, JSON, tokenisation and loaded batches[/]")
    if (armed := run_arms(args, console, workload, spec, cost_model, service)) is not None:
        return armed
    if getattr(args, "tenant", None):
        return run_tenants(args, console, config, cost_model, service)
    fleet = None
    with _progress(console, len(workload)) as progress:
        if args.replicas == 1 and scaling is None:
            run = simulate_encoder(workload, config, cost_model, noise=args.noise, seed=args.seed,
                                   request_sla_s=args.request_sla, progress=progress, service=service)
        else:
            fleet = simulate_fleet(workload, config, cost_model, replicas=args.replicas, router=args.router,
                                   noise=args.noise, seed=args.seed, request_sla_s=args.request_sla,
                                   progress=progress, service=service, autoscale=scaling)
            run = fleet.run
    report = summarize(run, sla_s=args.sla, warmup_s=args.warmup_s)
    where = "" if fleet is None else f" over {fleet.replicas} replicas ({fleet.router})"
    title = f"{workload.name}: {len(workload)} requests, {workload.mean_rate:.2f} req/s offered{where}"
    noisy = fleet is None and args.draws > 1 and draws_batch_times(args.noise, service, cost_model)
    console.print(report_table(report, title + (f" (draw of seed {args.seed})" if noisy else "")))
    drawn = None
    if noisy:
        drawn = encoder_draws(workload, config, cost_model, args.draws, args.seed, args.sla, args.warmup_s,
                              first=report, noise=args.noise, request_sla_s=args.request_sla,
                              service=service)
        console.print(spread_table(drawn, f"the prediction over {args.draws} noise draws"))
    if fleet is not None:
        console.print(replicas_table(fleet))
        if scaling is not None:
            console.print(scaling_table(scaling, run.stats.end_s))
    return write_outputs(args, console, workload, run, report, drawn)


def run_tenants(args: argparse.Namespace, console: Any, config: SchedulerConfig, cost_model: CostModel,
                service: ServiceModel | None) -> int:
    """``simulate --tenant ...``: each tenant's latency under the fair order, FIFO and alone."""
    try:
        loads = [TenantLoad.parse(spec) for spec in args.tenant]
        workload, table = tenant_mix(loads, args.duration_s, args.seed, args.trace)
    except (ValueError, FileNotFoundError) as exc:
        return _refuse(console, "simulate", exc)
    results = compare_orders(workload, table, config, cost_model, service=service, sla_s=args.sla,
                             warmup_s=args.warmup_s, noise=args.noise, seed=args.seed)
    title = (f"{len(loads)} tenants, {len(workload)} requests over {args.duration_s:g} s "
             f"({workload.mean_rate:.2f} req/s offered)")
    console.print(tenants_table(results, table, title))
    return 0


def run_llm_tenants(args: argparse.Namespace, console: Any, config: Any, cost_model: CostModel,
                    service: Any) -> int:
    """``simulate --target llm --tenant ...``: each tenant's TTFT and TPOT under fair and FCFS."""
    try:
        loads = [TenantLoad.parse(spec, "conv-llm") for spec in args.tenant]
        workload, table = tenant_mix(loads, args.duration_s, args.seed, args.trace)
        results = compare_llm_policies(workload, table, config, cost_model, service=service)
    except (ValueError, FileNotFoundError) as exc:
        return _refuse(console, "simulate", exc)
    title = (f"{len(loads)} tenants, {len(workload)} LLM requests over {args.duration_s:g} s "
             f"({workload.mean_rate:.2f} req/s offered)")
    console.print(llm_tenants_table(results, table, title))
    return 0


def write_outputs(args: argparse.Namespace, console: Any, workload: Workload, run: SimRun, report: SimReport,
                  drawn: Drawn | None) -> int:
    """``--json`` and ``--plot``, and the warning of a stalled scheduler."""
    if args.json:
        import dataclasses
        import json

        doc = dataclasses.asdict(report)
        if drawn is not None:  # each metric's median and band over the draws
            doc["draws"] = drawn.to_dict()
        Path(args.json).write_text(json.dumps(doc, indent=2, default=str))
        console.print(f"wrote {args.json}")
    if run.stats.stalled:
        console.print("[red]the scheduler left requests waiting with nothing scheduled (stalled)[/]")
    if args.plot:
        from batchpilot.sim.plots import plot_run

        for path in plot_run(run, args.plot, sla_s=args.sla, title=workload.name):
            console.print(f"wrote {path}")
    return 0


def run_arms(args: argparse.Namespace, console: Any, workload: Workload, primary: DeploymentSpec,
             cost_model: CostModel, service: ServiceModel | None) -> int | None:
    """``simulate`` of a deployment with candidate arms: a table of the arms; None without candidates."""
    rollout = rollout_from_args(args, primary)
    if not rollout.arms:
        return None
    keys = client_keys(len(workload), args.clients, args.seed)
    runs = simulate_arms(workload, keys, primary, rollout, cost_model,
                         ModelLimits.from_meta(cost_model.meta), service)
    reports = {arm: summarize(run, sla_s=args.sla, warmup_s=args.warmup_s) for arm, run in runs.items()}
    console.print(arms_table(workload, rollout, reports, args.clients))
    console.print("arms share no cores here: where a CPU-bound model serves them, each slows the others")
    return 0


# -- batchpilot tune ----------------------------------------------------------------------------

def run_tune(args: argparse.Namespace) -> int:
    if args.max_replicas is not None:
        return run_fleet_tune(args)
    console = make_console()
    try:
        workload = resolve_workload(args)
        spec = spec_from_args(args)
        tc = tune_config(args)
    except (ValueError, FileNotFoundError) as exc:
        return _refuse(console, "tune", exc)
    if args.profile_variants:
        return run_variants(args, workload, tc, spec, console)
    cost_model = load_cost_model(args, console)
    console.print(f"tuning on {workload.name}: {len(workload)} rows, {workload.mean_rate:.2f} req/s at "
                  f"scale 1; {tc.candidates} sampled configs + baselines, {tc.rungs} rungs of successive "
                  "halving")
    tuner = Tuner(workload, cost_model, tc, log=console.print, spec=spec, service=load_service(args))
    result = tuner.run()
    console.print(result_table(result))
    console.print(explain(result))
    path = write_yaml(result, args.output, spec)
    console.print(f"wrote {path} ({result.num_simulations} simulations in {result.seconds:.0f} s)")
    if args.plot:
        from batchpilot.sim.plots import plot_goodput

        png = plot_goodput(tuner.curves(result), Path(args.plot) / "goodput_vs_rate.png", tc.sla_p99_s)
        console.print(f"wrote {png}")
    return 0


def run_variants(args: argparse.Namespace, workload: Workload, tc: TuneConfig, spec: DeploymentSpec,
                 console: Any) -> int:
    """``tune --profile-variants``: one search per profile, the best variant written."""
    console.print(f"tuning on {workload.name} across {len(args.profile_variants)} profiles (one search each)")
    results = tune_variants(workload, args.profile_variants, tc, spec, args.batcher_only, console.print)
    console.print(result_table(results[0].result))
    console.print(variants_table(results))
    path = write_variant_yaml(results[0], args.output, spec)
    console.print(f"wrote {path}: {results[0].label}, {results[0].result.best.label}")
    return 0


def run_fleet_tune(args: argparse.Namespace) -> int:
    """``tune --max-replicas``: the fewest replicas that hold the SLA (``sim.tune.tune_fleet``)."""
    console = make_console()
    try:
        if args.profile_variants:
            raise ValueError("--max-replicas and --profile-variants do not combine; size the fleet with one "
                             "profile")
        workload = resolve_workload(args)
        spec = spec_from_args(args)
        tc = tune_config(args)
        if args.max_replicas < 1:
            raise ValueError(f"--max-replicas must be >= 1, got {args.max_replicas}")
    except (ValueError, FileNotFoundError) as exc:
        return _refuse(console, "tune", exc)
    cost_model = load_cost_model(args, console)
    console.print(f"sizing a fleet on {workload.name}: {len(workload)} rows at {workload.mean_rate:.2f} "
                  f"req/s (the target rate), P99 <= {tc.sla_p99_s:g} s, 1..{args.max_replicas} replicas "
                  f"behind {args.router}; one search of {tc.candidates} configs + baselines per count")
    res = tune_fleet(workload, cost_model, tc, max_replicas=args.max_replicas, router=args.router, spec=spec,
                     service=load_service(args), log=console.print)
    n, chosen = res.chosen
    console.print(result_table(chosen))
    console.print(explain(chosen))
    console.print(fleet_table(res))
    path = write_fleet_yaml(res, args.output, spec)
    if args.plot and res.tuner is not None:
        from batchpilot.sim.plots import plot_goodput

        png = plot_goodput(res.tuner.curves(chosen), Path(args.plot) / "goodput_vs_rate.png", tc.sla_p99_s)
        console.print(f"wrote {png} ({n} replicas)")
    sims = sum(r.num_simulations for _, r in res.searches)
    secs = sum(r.seconds for _, r in res.searches)
    if res.replicas is None:
        console.print(f"[red]no fleet of up to {args.max_replicas} replicas holds P99 <= {tc.sla_p99_s:g} s "
                      f"at {workload.mean_rate:.2f} req/s[/]; wrote {path} for {n} replicas "
                      f"({sims} simulations in {secs:.0f} s)")
        return 1
    console.print(f"[bold]replicas: {n}[/] ({args.router}) hold P99 <= {tc.sla_p99_s:g} s at "
                  f"{workload.mean_rate:.2f} req/s; wrote {path} (per-replica config; {sims} simulations in "
                  f"{secs:.0f} s)")
    return 0


class _progress:
    """A rich progress bar over arrivals for long runs; a no-op callback for short ones."""

    def __init__(self, console: Any, total: int) -> None:
        self.console, self.total = console, total
        self._bar: Any = None

    def __enter__(self) -> Any:
        if self.total < LONG_RUN:
            return None
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

        self._bar = Progress("simulating", BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                             console=self.console, transient=True)
        self._bar.start()
        task = self._bar.add_task("sim", total=self.total)
        return lambda done: self._bar.update(task, completed=done)

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.stop()
