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

import itertools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from batchpilot.core.config import PlannerConfig, PolicyConfig, SchedulerConfig
from batchpilot.core.costmodel import CostModel
from batchpilot.core.deployment import DeploymentSpec, ModelLimits, resolve_deployment
from batchpilot.sim.fleet import simulate_fleet
from batchpilot.sim.metrics import SimReport, summarize
from batchpilot.sim.service import ServiceModel
from batchpilot.sim.target import simulate_encoder
from batchpilot.sim.traces import Workload

# The tuner's search space: the grid of encoder configs it samples from, and the baselines it always
# measures (a static batch padded to the model's max length; fixed windows with dynamic padding, as
# TorchServe / Ray Serve / LitServe batch).

# (grouping, padding, bucketing method) worth trying: bucket padding needs bucket grouping to pay off,
# and only bucket layouts read the bucketing method
LAYOUTS: tuple[tuple[str, str, str], ...] = (
    ("fifo", "dynamic", "fixed"), ("sorted", "dynamic", "fixed"), ("dp", "dynamic", "fixed"),
    ("bucket", "bucket", "fixed"), ("bucket", "bucket", "quantile"), ("bucket", "bucket", "dp"),
    ("fifo", "none", "fixed"),  # padding-free batches keep queue order whatever the grouping
)
POLICIES: tuple[str, ...] = ("window", "hybrid", "adaptive", "sla")
MAX_BATCH: tuple[int, ...] = (8, 16, 32, 64)
MAX_WAIT_S: tuple[float, ...] = (0.005, 0.02, 0.05, 0.1)
TOKEN_BUDGET: tuple[int, ...] = (0, 8192)


@dataclass
class Candidate:
    label: str
    config: SchedulerConfig
    kind: str = "search"  # search | baseline | default
    capacity: float = 0.0  # rate scale
    rps: float = 0.0  # offered req/s at that scale
    rung: int = -1
    report: SimReport | None = None  # the passing probe at capacity
    probes: list[tuple[float, bool]] = field(default_factory=list)


def baselines(base: SchedulerConfig) -> list[Candidate]:
    max_len = base.planner.max_len
    static = replace(base, policy=PolicyConfig(name="static", max_batch_size=8, max_wait_s=0.1),
                     planner=PlannerConfig(grouping="fifo", padding="max", max_len=max_len))
    out = [Candidate("static bs8, pad to max", static, "baseline")]
    for bs, wait in ((10, 0.01), (32, 0.05)):
        cfg = replace(base, policy=PolicyConfig(name="window", max_batch_size=bs, max_wait_s=wait),
                      planner=PlannerConfig(grouping="fifo", padding="dynamic", max_len=max_len))
        out.append(Candidate(f"window bs{bs} {wait * 1e3:g}ms, dynamic pad", cfg, "baseline"))
    return out


def grid(base: SchedulerConfig, tc: TuneConfig) -> list[Candidate]:
    """Every grid point whose padding mode is allowed, as a labelled config over ``base``."""
    out = []
    for policy, (grouping, padding, method), bs, wait, budget in itertools.product(
            POLICIES, LAYOUTS, MAX_BATCH, MAX_WAIT_S, TOKEN_BUDGET):
        if padding not in tc.paddings:
            continue
        buckets = replace(base.bucketing, method=method)
        pol = replace(base.policy, name=policy, max_batch_size=bs, max_wait_s=wait,
                      min_wait_s=min(base.policy.min_wait_s, wait), sla_s=tc.sla_p99_s,
                      backlog_requests=min(base.policy.backlog_requests, bs))
        plan = replace(base.planner, grouping=grouping, padding=padding, max_batch_tokens=budget)
        label = (f"{policy} bs{bs} {wait * 1e3:g}ms {grouping}/{padding}"
                 + (f"/{method}" if grouping == "bucket" else "") + (f" tok{budget}" if budget else ""))
        out.append(Candidate(label, replace(base, policy=pol, planner=plan, bucketing=buckets)))
    return out


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
    ``service``, the service model the profile measured."""

    def __init__(self, workload: Workload, cost_model: CostModel, tc: TuneConfig,
                 base: SchedulerConfig | None = None, log: Callable[[str], None] | None = None,
                 spec: DeploymentSpec | None = None, service: ServiceModel | None = None) -> None:
        self.workload = workload
        self.cost_model = cost_model
        self.tc = tc
        self.spec = spec or DeploymentSpec()
        self.base = base or self.spec.encoder
        self.service = service
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
                               stop_after_misses=stop, service=self.service)
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


# What a tuning run says: why the winner wins, the ranked table, and the winner as a config file.

def explain(result: TuneResult) -> str:
    """Why the winner wins, in the three terms that decide it: batch size, padding, queueing."""
    b = result.best
    lines = [f"winner: {b.label}: {b.rps:.2f} req/s with P99 <= {result.sla_p99_s:g} s"]
    for base in result.baselines:
        lines.append(f"  vs {base.label}: {base.rps:.2f} req/s -> x{result.gain_over(base):.2f}")
    rows = [("winner", b)] + [(c.label, c) for c in result.baselines]
    lines.append("  at capacity (batch per request = sum(n^2)/sum(n); tail = slowest 1%):")
    for name, c in rows:
        r = c.report
        if r is None:
            continue
        lines.append(
            f"    {name:<34} batch {r.mean_batch_size:4.1f} (per request {r.request_batch_size:4.1f}), "
            f"padding efficiency {r.padding_efficiency:4.0%}, queueing {r.queue_share:4.0%} of latency "
            f"({r.tail_queue_share:4.0%} in the tail), executor {r.utilisation:4.0%} busy")
    return "\n".join(lines)


def write_yaml(result: TuneResult, path: str | Path, spec: DeploymentSpec | None = None) -> Path:
    """The winner as a config file (``encoder:`` and ``server:`` sections) that ``serve --config`` and
    ``simulate --config`` read."""
    from batchpilot.settings import dump_spec

    b = result.best
    header = (f"# batchpilot tune: {result.workload.name} ({len(result.workload)} rows), P99 <= "
              f"{result.sla_p99_s:g} s\n# predicted capacity: rate scale {b.capacity:.3f} = "
              f"{b.rps:.2f} req/s; {b.label}\n")
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    return dump_spec((spec or DeploymentSpec()).replace(encoder=b.config), p, header)


def result_table(result: TuneResult, limit: int = 12) -> Any:
    from rich.table import Table

    t = Table(title=f"capacity at P99 <= {result.sla_p99_s:g} s ({result.workload.name}, "
                    f"{len(result.workload)} rows)")
    for col in ("rank", "config", "kind", "req/s", "scale", "vs best", "batch/req", "pad eff", "queue %",
                "P99 ms"):
        t.add_column(col, justify="left" if col in ("config", "kind") else "right")
    shown = [c for c in result.candidates if c.kind == "search"][:limit]
    shown += [c for c in result.candidates if c.kind != "search"]
    order = {id(c): i + 1 for i, c in enumerate(result.candidates)}
    for c in shown:
        r = c.report
        t.add_row(str(order[id(c)]), c.label, c.kind, f"{c.rps:.2f}", f"{c.capacity:.3f}",
                  f"{c.rps / result.best.rps:.2f}" if result.best.rps else "-",
                  f"{r.request_batch_size:.1f}" if r else "-", f"{r.padding_efficiency:.0%}" if r else "-",
                  f"{r.queue_share:.0%}" if r else "-", f"{r.p99_all * 1e3:.0f}" if r else "-")
    return t


# The tuner across backends and precisions: one profile per variant, one search per profile.
#
#     batchpilot profile --all-backends -o p.json          # p.torch-float32.json, p.torch-bfloat16.json...
#     batchpilot tune --profile-variants p.*.json --sla-p99 1.0 -o best.yaml
#
# A variant is what a profile measured: its backend and precision (``cost_model.meta``: ``backend``,
# ``dtype``) and its serving path. Each variant's search is the ordinary tuner (``sim.tune.Tuner``) on
# that profile's cost model and front end, over the same workload, grid sample and seed; the winner is
# the (variant, config) with the most predicted goodput. The config file written carries the winning
# config in ``encoder:`` and the variant in ``model:`` (``backend``, ``dtype``), and its header names
# the profile to serve it with, so ``serve --profile P --config best.yaml`` runs what was predicted.

@dataclass
class VariantResult:
    profile: str
    backend: str
    dtype: str
    result: TuneResult

    @property
    def label(self) -> str:
        return f"{self.backend}/{self.dtype}"


def tune_variants(workload: Workload, profiles: Sequence[str], tc: TuneConfig, spec: DeploymentSpec,
                  batcher_only: bool = False,
                  log: Callable[[str], None] = lambda _: None) -> list[VariantResult]:
    """One tuner search per profile; ranked by the winner's predicted goodput, best first."""
    out = []
    for path in profiles:
        cost_model = CostModel.load(path)
        meta = cost_model.meta
        service = None if batcher_only else ServiceModel.from_profile(path)
        v = VariantResult(path, str(meta.get("backend", "torch")), str(meta.get("dtype", "float32")),
                          Tuner(workload, cost_model, tc, log=log, spec=spec, service=service).run())
        log(f"{v.label}: best {v.result.best.label}, {v.result.best.rps:.2f} req/s")
        out.append(v)
    return sorted(out, key=lambda v: -v.result.best.rps)


def variants_table(results: Sequence[VariantResult]) -> Any:
    from rich.table import Table

    t = Table(title="the best config of each backend and precision (predicted, P99 within the SLA)")
    for col in ("variant", "best config", "req/s", "vs best", "default req/s", "profile"):
        t.add_column(col, justify="right" if "req/s" in col or col == "vs best" else "left")
    top = results[0].result.best.rps if results else 0.0
    for v in results:
        b = v.result.best
        default = next((c for c in v.result.candidates if c.kind == "default"), None)
        t.add_row(v.label, b.label, f"{b.rps:.2f}", f"{b.rps / top:.2f}" if top else "-",
                  f"{default.rps:.2f}" if default else "-", v.profile)
    return t


def write_variant_yaml(best: VariantResult, path: str | Path, spec: DeploymentSpec) -> Path:
    """The winner as a config file: ``encoder:``, ``server:`` and ``model:`` (its backend and dtype)."""
    from batchpilot.settings import dump_spec

    b, r = best.result.best, best.result
    header = (f"# batchpilot tune --profile-variants: {r.workload.name} ({len(r.workload)} rows), P99 <= "
              f"{r.sla_p99_s:g} s\n# predicted capacity: rate scale {b.capacity:.3f} = {b.rps:.2f} req/s; "
              f"{best.label}, {b.label}\n# serve it with: batchpilot serve --profile {best.profile} "
              f"--config {path}\n")
    model = replace(spec.model, backend=best.backend, dtype=best.dtype)
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    return dump_spec(spec.replace(encoder=b.config, model=model), p, header,
                     sections=("encoder", "server", "model"))


# Fleet sizing: the fewest replicas that hold a P99 SLA at the target rate, and their per-replica config.
#
#     batchpilot tune --workload conv-embed --rate-scale 8 --sla-p99 1.0 --max-replicas 4 -o best.yaml
#
# For n = 1, 2, ... up to ``--max-replicas``, the tuner's own search (``sim.tune.Tuner.run``: the same grid
# sample, rungs, baselines and capacity bisection) runs with every probe simulating n replicas of the
# candidate behind ``--router`` (``sim.fleet.simulate_fleet``) instead of one. The workload as given (its
# ``--rate-scale``) is the target rate, so n replicas hold the SLA there when the best config's capacity
# is a rate scale of at least 1. The first such n is the answer and the search stops; ``-o`` writes that
# search's winner, the per-replica ``encoder:`` section, with the replica count and router in its header
# (the config file has no fleet section: ``simulate --replicas N --router R --config best.yaml`` runs what
# was predicted). When no count up to the maximum holds, the largest count's winner is written and the
# command exits 1.

class FleetTuner(Tuner):
    """The tuner with every probe run as a fleet of ``replicas`` behind ``router``."""

    def __init__(self, workload: Workload, cost_model: CostModel, tc: TuneConfig, *, replicas: int,
                 router: str, log: Callable[[str], None] | None = None, spec: DeploymentSpec | None = None,
                 service: ServiceModel | None = None) -> None:
        super().__init__(workload, cost_model, tc, log=log, spec=spec, service=service)
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
                               service=self.service)
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
               spec: DeploymentSpec | None = None, service: ServiceModel | None = None,
               log: Callable[[str], None] = lambda _: None) -> FleetTuneResult:
    """One tuner search per replica count from 1, up to the first that holds the SLA at scale 1."""
    if max_replicas < 1:
        raise ValueError(f"tune: --max-replicas must be >= 1, got {max_replicas}")
    searches = []
    tuner = None
    for n in range(1, max_replicas + 1):
        tuner = FleetTuner(workload, cost_model, tc, replicas=n, router=router, log=log, spec=spec,
                           service=service)
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
    from batchpilot.settings import dump_spec

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
