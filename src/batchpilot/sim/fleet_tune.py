"""Fleet sizing: the fewest replicas that hold a P99 SLA at the target rate, and their per-replica config.

    batchpilot tune --workload conv-embed --rate-scale 8 --sla-p99 1.0 --max-replicas 4 -o best.yaml

For n = 1, 2, ... up to ``--max-replicas``, the tuner's own search (``sim.tune.Tuner.run``: the same grid
sample, rungs, baselines and capacity bisection) runs with every probe simulating n replicas of the
candidate behind ``--router`` (``sim.fleet.simulate_fleet``) instead of one. The workload as given (its
``--rate-scale``) is the target rate, so n replicas hold the SLA there when the best config's capacity
is a rate scale of at least 1. The first such n is the answer and the search stops; ``-o`` writes that
search's winner, the per-replica ``encoder:`` section, with the replica count and router in its header
(the config file has no fleet section: ``simulate --replicas N --router R --config best.yaml`` runs what
was predicted). When no count up to the maximum holds, the largest count's winner is written and the
command exits 1.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from batchpilot.core.config import SchedulerConfig
from batchpilot.core.costmodel import CostModel
from batchpilot.core.deployment import DeploymentSpec
from batchpilot.sim.fleet import simulate_fleet
from batchpilot.sim.frontend import FrontEnd
from batchpilot.sim.metrics import SimReport, summarize
from batchpilot.sim.traces import Workload
from batchpilot.sim.tune import TuneConfig, Tuner, TuneResult


class FleetTuner(Tuner):
    """The tuner with every probe run as a fleet of ``replicas`` behind ``router``."""

    def __init__(self, workload: Workload, cost_model: CostModel, tc: TuneConfig, *, replicas: int,
                 router: str, log: Callable[[str], None] | None = None, spec: DeploymentSpec | None = None,
                 frontend: FrontEnd | None = None) -> None:
        super().__init__(workload, cost_model, tc, log=log, spec=spec, frontend=frontend)
        self.replicas = replicas
        self.router = router

    def probe(
        self, cfg: SchedulerConfig, wl: Workload, k: float, stop_early: bool = True
    ) -> SimReport | None:
        tc = self.tc
        scaled = wl.scale_rate(k)
        self.num_simulations += 1
        fleet = simulate_fleet(scaled, self.deployed(cfg), self.cost_model, replicas=self.replicas,
                               router=self.router, noise=tc.noise, seed=tc.seed,
                               stop_after_misses=self.stop_rule(scaled) if stop_early else None,
                               frontend=self.frontend)
        if fleet.run.stats.aborted:
            return None
        return summarize(fleet.run, tc.sla_p99_s, tc.warmup_s)


@dataclass
class FleetTuneResult:
    searches: list[tuple[int, TuneResult]]  # (replicas, that count's search), in the order run
    replicas: int | None  # the fewest that hold the SLA at the target rate (None: none up to the max)
    router: str
    tuner: FleetTuner | None = None  # the chosen count's tuner (for its goodput curves)

    @property
    def chosen(self) -> tuple[int, TuneResult]:
        """The answer's search, or the largest count's when none holds."""
        if self.replicas is None:
            return self.searches[-1]
        return next(s for s in self.searches if s[0] == self.replicas)


def tune_fleet(workload: Workload, cost_model: CostModel, tc: TuneConfig, *, max_replicas: int, router: str,
               spec: DeploymentSpec | None = None, frontend: FrontEnd | None = None,
               log: Callable[[str], None] = lambda _: None) -> FleetTuneResult:
    """One tuner search per replica count from 1, up to the first that holds the SLA at scale 1."""
    if max_replicas < 1:
        raise ValueError(f"tune: --max-replicas must be >= 1, got {max_replicas}")
    searches = []
    tuner = None
    for n in range(1, max_replicas + 1):
        tuner = FleetTuner(workload, cost_model, tc, replicas=n, router=router, log=log, spec=spec,
                           frontend=frontend)
        result = tuner.run()
        searches.append((n, result))
        holds = result.best.capacity >= 1.0
        best = result.best
        log(f"{n} replica{'s' if n > 1 else ''}: best {best.label}, capacity x{best.capacity:.3f} "
            f"= {best.rps:.2f} req/s ({'holds' if holds else 'misses'} the SLA at the target rate)")
        if holds:
            return FleetTuneResult(searches, n, router, tuner)
    return FleetTuneResult(searches, None, router, tuner)


def fleet_table(res: FleetTuneResult) -> Any:
    from rich.table import Table

    first = res.searches[0][1]
    t = Table(title=f"replicas for P99 <= {first.sla_p99_s:g} s at {first.workload.mean_rate:.2f} req/s "
                    f"({first.workload.name}, {len(first.workload)} rows, {res.router})", header_style="bold")
    for col in ("replicas", "best config (per replica)", "capacity req/s", "per replica", "x target",
                "P99 at capacity", "holds"):
        t.add_column(col, justify="left" if col.startswith("best") else "right")
    for n, r in res.searches:
        b = r.best
        p99 = f"{b.report.p99_all * 1e3:.0f} ms" if b.report is not None else "-"
        t.add_row(str(n), b.label, f"{b.rps:.2f}", f"{b.rps / n:.2f}", f"{b.capacity:.2f}", p99,
                  "[green]yes[/]" if b.capacity >= 1.0 else "[red]no[/]")
    return t


def write_fleet_yaml(res: FleetTuneResult, path: str | Path, spec: DeploymentSpec | None = None) -> Path:
    """The chosen count's winner as a config file; the replica count and router in its header."""
    from batchpilot.config_file import dump_spec

    n, r = res.chosen
    b = r.best
    verdict = "holds" if res.replicas is not None else "the most tried, does NOT hold"
    header = (f"# batchpilot tune --max-replicas: {r.workload.name} ({len(r.workload)} rows, "
              f"{r.workload.mean_rate:.2f} req/s), P99 <= {r.sla_p99_s:g} s\n"
              f"# replicas: {n} (router {res.router}), {verdict} the SLA at the target rate\n"
              f"# predicted fleet capacity: rate scale {b.capacity:.3f} = {b.rps:.2f} req/s; {b.label}\n"
              f"# run it with: batchpilot simulate --replicas {n} --router {res.router} --config {path}\n")
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    return dump_spec((spec or DeploymentSpec()).replace(encoder=b.config), p, header)


def add_fleet_tune_args(p: argparse.ArgumentParser) -> None:
    """``--max-replicas`` and ``--router`` on the ``tune`` parser: with ``--max-replicas``, fleet sizing."""
    from batchpilot.sim.router import ROUTERS

    p.add_argument("--max-replicas", type=int, default=None, metavar="M",
                   help="find the fewest replicas (1..M) that hold --sla-p99 at the workload's rate, and "
                        "their per-replica config (sim/fleet_tune.py)")
    p.add_argument("--router", choices=ROUTERS, default="power_of_two",
                   help="how a fleet spreads requests (with --max-replicas; default power_of_two)")
    plain = p.get_default("func")
    p.set_defaults(func=lambda args: run_fleet_tune(args) if args.max_replicas is not None else plain(args))


def run_fleet_tune(args: argparse.Namespace) -> int:
    from batchpilot.config_file import spec_from_args
    from batchpilot.sim.cli import load_cost_model, load_frontend, make_console, resolve_workload
    from batchpilot.sim.tune_report import explain, result_table

    console = make_console()
    try:
        if args.profile_variants:
            raise ValueError("--max-replicas and --profile-variants do not combine; size the fleet with one "
                             "profile")
        workload = resolve_workload(args)
        spec = spec_from_args(args)
        tc = TuneConfig(sla_p99_s=args.sla_p99, candidates=args.candidates, noise=args.noise, seed=args.seed,
                        warmup_s=args.warmup_s, paddings=tuple(x.strip() for x in args.paddings.split(",")))
        if args.max_replicas < 1:
            raise ValueError(f"--max-replicas must be >= 1, got {args.max_replicas}")
    except (ValueError, FileNotFoundError) as exc:
        console.print(f"[red]batchpilot tune: {exc}[/]")
        return 2
    cost_model = load_cost_model(args, console)
    console.print(f"sizing a fleet on {workload.name}: {len(workload)} rows at {workload.mean_rate:.2f} "
                  f"req/s (the target rate), P99 <= {tc.sla_p99_s:g} s, 1..{args.max_replicas} replicas "
                  f"behind {args.router}; one search of {tc.candidates} configs + baselines per count")
    res = tune_fleet(workload, cost_model, tc, max_replicas=args.max_replicas, router=args.router, spec=spec,
                     frontend=load_frontend(args), log=console.print)
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
