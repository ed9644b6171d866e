"""The tuner: which SchedulerConfig carries the most traffic inside a P99 SLA, found in simulation.

Capacity of a config = the highest rate scale k of the workload slice whose simulated P99 (rejected,
dropped and unfinished requests counted as infinitely late) meets the SLA: bracket k geometrically,
then bisect in log space to a relative tolerance. A probe stops early once more requests missed the
SLA than a passing P99 allows. Latency is not perfectly monotone in rate on a real trace (a burst lands
differently), so capacity is "the highest passing probe below the first failure".

Search: successive halving over a seeded sample of a grid (policy x window x max batch x token budget x
grouping/padding/bucketing method). Rung r simulates a prefix of the slice 4^(R-r) times shorter with
a coarser tolerance; the best quarter goes on. A prefix keeps the trace's early burst (trace seconds 40-50,
the one that decides goodput), so cheap rungs rank configs much like the full slice. Baselines and
the batchpilot default are always measured at the last rung:

* static batch padded to the model's max length (fires full batches; a 100 ms safety net);
* fixed window with dynamic padding: TorchServe / Ray Serve / LitServe semantics (Ray's defaults,
  10 requests / 10 ms, and a wider 32 / 50 ms).
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from batchpilot.config_file import add_deployment_args
from batchpilot.core.config import SchedulerConfig
from batchpilot.core.costmodel import CostModel
from batchpilot.core.deployment import DeploymentSpec, ModelLimits, resolve_deployment
from batchpilot.sim.frontend import FrontEnd
from batchpilot.sim.metrics import SimReport, summarize
from batchpilot.sim.target import simulate_encoder
from batchpilot.sim.traces import Workload
from batchpilot.sim.tune_report import explain, result_table, write_yaml
from batchpilot.sim.tune_space import (
    LAYOUTS,
    MAX_BATCH,
    MAX_WAIT_S,
    POLICIES,
    TOKEN_BUDGET,
    Candidate,
    baselines,
    grid,
)

__all__ = ["LAYOUTS", "MAX_BATCH", "MAX_WAIT_S", "POLICIES", "TOKEN_BUDGET", "Candidate", "TuneConfig",
           "TuneResult", "Tuner", "baselines", "explain", "grid", "register", "result_table", "run_tune",
           "write_yaml"]


@dataclass(frozen=True)
class TuneConfig:
    """Search settings. ``paddings`` limits padding modes to what the serving executor supports."""

    sla_p99_s: float = 1.0
    candidates: int = 96  # sampled from the grid (plus baselines and the default)
    rungs: int = 3
    keep: float = 0.25  # fraction promoted to the next rung
    rel_tol: tuple[float, ...] = (0.12, 0.05, 0.02)  # bisection tolerance per rung
    min_rows: int = 400  # the shortest prefix a rung simulates
    warmup_s: float = 0.0
    noise: bool = False
    seed: int = 0
    paddings: tuple[str, ...] = ("max", "dynamic", "bucket", "none")
    max_probes: int = 14

    def __post_init__(self) -> None:
        if self.sla_p99_s <= 0 or self.candidates < 1 or self.rungs < 1 or not 0 < self.keep <= 1:
            raise ValueError("tune: need sla_p99_s > 0, candidates >= 1, rungs >= 1 and keep in (0, 1]")
        if len(self.rel_tol) < self.rungs:
            raise ValueError(f"tune: give one rel_tol per rung ({self.rungs}), got {self.rel_tol}")


@dataclass
class TuneResult:
    candidates: list[Candidate]  # ranked, best first (only those measured at the last rung)
    best: Candidate
    baselines: list[Candidate]
    workload: Workload
    sla_p99_s: float
    seconds: float
    num_simulations: int
    curves: dict[str, list[tuple[float, float, float]]] = field(default_factory=dict)

    def gain_over(self, other: Candidate) -> float:
        return self.best.rps / other.rps if other.rps > 0 else math.inf


class Tuner:
    """Every probe simulates the deployment ``serve`` would run with the candidate as its ``encoder:``
    section and ``spec``'s ``server:`` options (``core.deployment.resolve_deployment``), and, with
    ``frontend``, the serving path the profile measured."""

    def __init__(self, workload: Workload, cost_model: CostModel, tc: TuneConfig,
                 base: SchedulerConfig | None = None, log: Callable[[str], None] | None = None,
                 spec: DeploymentSpec | None = None, frontend: FrontEnd | None = None) -> None:
        self.workload = workload
        self.cost_model = cost_model
        self.tc = tc
        self.spec = spec or DeploymentSpec()
        self.base = base or self.spec.encoder
        self.frontend = frontend and frontend.serving(self.spec.server.tokenizer_workers)
        self.limits = ModelLimits.from_meta(cost_model.meta)
        self.log = log or (lambda _: None)
        self.num_simulations = 0

    def deployed(self, cfg: SchedulerConfig) -> SchedulerConfig:
        """``cfg`` as the server would run it."""
        return resolve_deployment(self.spec.replace(encoder=cfg), self.cost_model, self.limits).scheduler

    # -- one probe and one capacity search ---------------------------------------------------
    def stop_rule(self, scaled: Workload) -> tuple[float, int, float]:
        """``stop_after_misses`` for a probe of ``scaled``: more misses than this, the P99 is lost."""
        tc = self.tc
        n = int((scaled.arrival_s >= tc.warmup_s).sum())
        return tc.sla_p99_s, n - int(math.floor(0.99 * (n - 1))) - 1, tc.warmup_s

    def probe(
        self, cfg: SchedulerConfig, wl: Workload, k: float, stop_early: bool = True
    ) -> SimReport | None:
        """Simulate ``wl`` at rate scale ``k``; None when it stopped early (the SLA was lost for certain)."""
        tc = self.tc
        scaled = wl.scale_rate(k)
        stop = self.stop_rule(scaled) if stop_early else None
        self.num_simulations += 1
        run = simulate_encoder(scaled, self.deployed(cfg), self.cost_model, noise=tc.noise, seed=tc.seed,
                               stop_after_misses=stop, frontend=self.frontend)
        if run.stats.aborted:
            return None
        return summarize(run, tc.sla_p99_s, tc.warmup_s)

    def capacity(self, cand: Candidate, wl: Workload, rel_tol: float, start: float) -> None:
        sla = self.tc.sla_p99_s
        step = 2.0 if cand.rung < 0 else 1.0 + 4 * rel_tol
        passed: dict[float, SimReport] = {}
        failed: list[float] = []

        def test(k: float) -> bool:
            rep = self.probe(cand.config, wl, k)
            ok = rep is not None and rep.p99_all <= sla
            cand.probes.append((k, ok))
            if ok and rep is not None:
                passed[k] = rep
            else:
                failed.append(k)
            return ok

        lo, hi = 0.0, math.inf
        k = start
        for _ in range(self.tc.max_probes):
            if test(k):
                lo = k
                if hi == math.inf:
                    k = k * step
                    continue
            else:
                hi = k
                if lo == 0.0:
                    k = k / step
                    if k < 1e-3:
                        break
                    continue
            if hi / lo <= 1.0 + rel_tol:
                break
            k = math.sqrt(lo * hi)
        # the highest passing probe below the first failure (see module docstring)
        below = [x for x in passed if x < min(failed, default=math.inf)]
        best = max(below, default=0.0)
        cand.capacity = best
        cand.rps = wl.mean_rate * best
        cand.report = passed.get(best)

    # -- the search --------------------------------------------------------------------------
    def run(self) -> TuneResult:
        tc = self.tc
        t0 = time.perf_counter()
        rng = np.random.default_rng(tc.seed)
        pool = grid(self.base, tc)
        pick = rng.choice(len(pool), size=min(tc.candidates, len(pool)), replace=False)
        alive = [pool[i] for i in sorted(pick.tolist())]
        fixed = [*baselines(self.base), Candidate("batchpilot default", self.base, "default")]
        n_full = len(self.workload)
        for rung in range(tc.rungs):
            rows = max(min(tc.min_rows, n_full), n_full // 4 ** (tc.rungs - 1 - rung))
            wl = self.workload.slice(0, rows)
            last = rung == tc.rungs - 1
            group = alive + (fixed if last else [])
            for cand in group:
                start = cand.capacity if cand.capacity > 0 else 1.0
                cand.probes.clear()
                self.capacity(cand, wl, tc.rel_tol[rung], start)
                cand.rung = rung
            alive.sort(key=lambda c: -c.capacity)
            self.log(f"rung {rung}: {len(group)} configs on {rows} rows, tol {tc.rel_tol[rung]:.0%}; best "
                     f"{alive[0].label} x{alive[0].capacity:.3f} ({time.perf_counter() - t0:.0f} s)")
            if not last:
                alive = alive[: max(1, math.ceil(len(alive) * tc.keep))]
        # ties (a coarse bisection lands many configs on one probe) go to the lower P99 at capacity
        ranked = sorted(alive + fixed, key=lambda c: (-c.rps, c.report.p99_all if c.report else math.inf))
        best = next(c for c in ranked if c.kind == "search")
        default = fixed[-1]
        # the default can win, unless its padding mode is one the serving executor lacks (--paddings)
        if default.rps > best.rps and default.config.planner.padding in tc.paddings:
            best = default
        return TuneResult(ranked, best, fixed[:-1], self.workload, tc.sla_p99_s, time.perf_counter() - t0,
                          self.num_simulations)

    def curves(
        self, result: TuneResult, top: int = 3, points: int = 8
    ) -> dict[str, list[tuple[float, float, float]]]:
        """P99 and goodput over a shared sweep of rates for the top configs and the baselines: from
        half the lowest capacity among them to 1.5x the winner's."""
        chosen = [c for c in result.candidates if c.kind == "search"][:top] + result.baselines
        caps = [c.capacity for c in chosen if c.capacity > 0]
        hi = 1.5 * max(result.best.capacity, *caps, 1e-3)
        scales = np.geomspace(0.5 * min(caps, default=hi / 6), hi, points)
        out: dict[str, list[tuple[float, float, float]]] = {}
        for cand in chosen:
            pts = []
            for k in scales.tolist():
                rep = self.probe(cand.config, self.workload, k, stop_early=False)
                if rep is not None:
                    pts.append((self.workload.mean_rate * k, rep.p99_all, rep.goodput_rps))
            out[cand.label] = pts
        result.curves = out
        return out


def register(subparsers: Any) -> None:
    from batchpilot.sim.cli import add_workload_args

    p = subparsers.add_parser("tune", help="find the config with the highest rate inside a P99 SLA",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(p)
    add_deployment_args(p, config_help="base config (its encoder admission, max_len, num_slots and its "
                                       "server section are kept)")
    p.set_defaults(requests=8000)
    p.add_argument("--sla-p99", type=float, default=1.0, help="P99 latency SLA in seconds")
    p.add_argument("--batcher-only", action="store_true",
                   help="leave out the profile's serving path (HTTP, JSON, tokenisation)")
    p.add_argument("-o", "--output", default="best.yaml", help="where to write the winning config")
    p.add_argument("--candidates", type=int, default=TuneConfig.candidates, help="grid points sampled")
    p.add_argument("--paddings", default="max,dynamic,bucket,none",
                   help="padding modes the serving executor supports (comma-separated)")
    p.add_argument("--noise", action="store_true", help="draw batch times from the profile's residuals")
    p.add_argument("--plot", metavar="DIR", help="write goodput_vs_rate.png for the top configs here")
    p.add_argument("--profile-variants", nargs="+", metavar="PROFILE", default=None,
                   help="one profile per backend/precision (`batchpilot profile --all-backends`): search "
                        "each and write the best variant's model: section too (sim/tune_variants.py)")
    p.set_defaults(func=run_tune)


def run_tune(args: argparse.Namespace) -> int:
    from batchpilot.config_file import spec_from_args
    from batchpilot.sim.cli import load_cost_model, load_frontend, make_console, resolve_workload

    console = make_console()
    try:
        workload = resolve_workload(args)
        spec = spec_from_args(args)
        tc = TuneConfig(sla_p99_s=args.sla_p99, candidates=args.candidates, noise=args.noise, seed=args.seed,
                        warmup_s=args.warmup_s, paddings=tuple(x.strip() for x in args.paddings.split(",")))
    except (ValueError, FileNotFoundError) as exc:
        console.print(f"[red]batchpilot tune: {exc}[/]")
        return 2
    if args.profile_variants:
        from batchpilot.sim.tune_variants import run_variants

        return run_variants(args, workload, tc, spec, console)
    cost_model = load_cost_model(args, console)
    console.print(f"tuning on {workload.name}: {len(workload)} rows, {workload.mean_rate:.2f} req/s at "
                  f"scale 1; {tc.candidates} sampled configs + baselines, {tc.rungs} rungs of successive "
                  "halving")
    tuner = Tuner(workload, cost_model, tc, log=console.print, spec=spec, frontend=load_frontend(args))
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
