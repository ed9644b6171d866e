"""Multi-tenant workloads, and what each tenant got: the simulator's and the load generator's.

    --tenant NAME:rate=R[,weight=W][,workload=conv-embed][,start=ROW][,lengths=SPEC]

Each tenant sends its own stream at ``rate`` requests per second: rows ``start..`` of a standard workload
or trace (conv-embed by default) sped up or slowed down to that mean rate, or a synthetic arrival process
(``workload=poisson``, ``renewal``, ...: ``sim.synthetic``) with ``lengths`` (a length spec whose
parameters are separated by ``/``: ``lognormal:median=64/sigma=0.5``). The streams are merged by arrival
time into one ``Workload`` whose ``tenant`` column names each row's tenant; the weights form the
``TenantTable`` the scheduler gets. ``per_tenant`` splits a run's results by tenant, ``jain`` and
``backlogged_service`` say how evenly the weighted service was shared.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from batchpilot.core.config import SchedulerConfig
from batchpilot.core.costmodel import CostModel
from batchpilot.core.tenants import TenantSpec, TenantTable
from batchpilot.sim.service import ServiceModel
from batchpilot.sim.synthetic import ARRIVALS, synthetic_workload
from batchpilot.sim.target import DONE, SimRun, simulate_encoder
from batchpilot.sim.traces import Workload, load_workload


@dataclass(frozen=True)
class TenantLoad:
    """One tenant's traffic and weight."""

    name: str
    rate: float  # requests per second
    weight: float = 1.0
    workload: str = "conv-embed"
    start: int = 0  # the first row of a trace-based workload
    lengths: str = "lognormal:median=128,sigma=0.8"  # synthetic workloads only

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("a tenant needs a name")
        if not self.rate > 0:
            raise ValueError(f"tenant {self.name!r}: rate must be > 0 requests/s, got {self.rate}")
        TenantSpec(weight=self.weight)  # validates the weight
        object.__setattr__(self, "lengths", self.lengths.replace("/", ","))

    @classmethod
    def parse(cls, spec: str, workload: str = "conv-embed") -> TenantLoad:
        """``"search:rate=4,weight=2,start=1000"`` (``lengths`` parameters separated by ``/``); ``workload``
        is the default (``simulate --target llm``: conv-llm)."""
        name, _, rest = spec.partition(":")
        fields: dict[str, str] = {}
        for part in filter(None, rest.split(",")):
            key, eq, value = part.partition("=")
            if not eq or key.strip() not in ("rate", "weight", "workload", "start", "lengths"):
                raise ValueError(f"--tenant {spec!r}: expected NAME:rate=R[,weight=W][,workload=W]"
                                 f"[,start=ROW][,lengths=SPEC], got {part!r}")
            fields[key.strip()] = value.strip()
        if "rate" not in fields:
            raise ValueError(f"--tenant {spec!r}: give its rate (requests/s), e.g. {name or 'a'}:rate=5")
        return cls(name.strip(), float(fields["rate"]), float(fields.get("weight", 1.0)),
                   fields.get("workload", workload), int(fields.get("start", 0)),
                   fields.get("lengths", cls.lengths))

    def stream(self, duration_s: float, seed: int = 0, trace: str | None = None) -> Workload:
        """This tenant's arrivals over ``duration_s`` seconds."""
        n = max(2, math.ceil(self.rate * duration_s) + 1)
        kind = self.workload.partition(":")[0]
        if kind in ARRIVALS:
            return synthetic_workload(f"{kind}:rate={self.rate:g}", n, self.lengths, seed)
        wl = load_workload(self.workload, start=self.start, count=n, trace=trace)
        if len(wl) < 2 or wl.mean_rate <= 0:
            raise ValueError(f"tenant {self.name!r}: rows {self.start}.. of {self.workload} are too few")
        return wl.scale_rate(self.rate / wl.mean_rate)


def tenant_mix(loads: Sequence[TenantLoad], duration_s: float, seed: int = 0,
               trace: str | None = None) -> tuple[Workload, TenantTable]:
    """Every tenant's stream over ``duration_s`` seconds merged by arrival (ties: the order of
    ``loads``), and the table of their weights."""
    if not loads:
        raise ValueError("tenant_mix: no tenants")
    names = [t.name for t in loads]
    if len(set(names)) != len(names):
        raise ValueError(f"tenant names must differ, got {names}")
    parts = [t.stream(duration_s, seed + i, trace) for i, t in enumerate(loads)]
    parts = [p.slice(0, int(np.searchsorted(p.arrival_s, duration_s, side="right")) or 1) for p in parts]
    t = np.concatenate([p.arrival_s for p in parts])
    order = np.argsort(t, kind="stable")
    cols = [np.concatenate([getattr(p, c) for p in parts])[order]
            for c in ("input_tokens", "output_tokens", "priority")]
    tenant = np.concatenate([np.full(len(p), name) for p, name in zip(parts, names, strict=True)])[order]
    wl = Workload("+".join(names), t[order], *cols, tenant=tenant)
    return wl, TenantTable({x.name: TenantSpec(weight=x.weight) for x in loads})


@dataclass(frozen=True)
class TenantReport:
    """What one tenant got in a run (requests arriving from ``warmup_s`` on)."""

    tenant: str
    requests: int
    completed: int
    failed: int  # refused, dropped or unfinished
    offered_rps: float
    p50_s: float
    p99_s: float  # of completed requests
    p99_all_s: float  # failures counted as infinitely late
    goodput_rps: float  # finished within the SLA, per second of the run
    tokens_s: float  # input tokens served per second


def per_tenant(run: SimRun, sla_s: float = 1.0, warmup_s: float = 0.0) -> list[TenantReport]:
    """``run``'s results split by ``run.workload.tenant`` (one ``default`` tenant without the column)."""
    wl, rec = run.workload, run.record
    tenants = wl.tenant if wl.tenant is not None else np.full(len(wl), "default")
    status = np.asarray(rec.status)
    finish = np.asarray(rec.finish_s, dtype=float)
    measured = wl.arrival_s >= warmup_s
    span = max(float(np.nanmax(finish)) - warmup_s, 1e-9) if np.isfinite(finish).any() else 1e-9
    out = []
    for name in sorted(set(tenants.tolist())):
        mine = measured & (tenants == name)
        done = mine & (status == DONE)
        lat = finish[done] - wl.arrival_s[done]
        n = int(mine.sum())
        arrivals = wl.arrival_s[mine]
        offered = (n - 1) / max(float(arrivals[-1] - arrivals[0]), 1e-9) if n > 1 else 0.0
        all_lat = np.where(done, finish - wl.arrival_s, np.inf)[mine]
        p99_all = float(np.quantile(all_lat, 0.99, method="higher")) if n else math.nan
        out.append(TenantReport(name, n, int(done.sum()), n - int(done.sum()), offered,
                                float(np.percentile(lat, 50)) if lat.size else math.nan,
                                float(np.percentile(lat, 99)) if lat.size else math.nan, p99_all,
                                float((lat <= sla_s).sum()) / span,
                                float(wl.input_tokens[done].sum()) / span))
    return out


def jain(values: Sequence[float]) -> float:
    """Jain's fairness index: 1 when all are equal, 1/n when one has everything."""
    x = np.asarray(values, dtype=float)
    return float(x.sum() ** 2 / (len(x) * (x * x).sum())) if len(x) and (x * x).sum() > 0 else math.nan


def _busy(arrival: np.ndarray, dispatch: np.ndarray) -> list[tuple[float, float]]:
    """The union of ``[arrival, dispatch)`` intervals: when a tenant had work waiting."""
    order = np.argsort(arrival, kind="stable")
    out: list[tuple[float, float]] = []
    for a, d in zip(arrival[order].tolist(), dispatch[order].tolist(), strict=True):
        if not d > a:
            continue
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], d))
        else:
            out.append((a, d))
    return out


def _intersect(x: list[tuple[float, float]], y: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out, i, j = [], 0, 0
    while i < len(x) and j < len(y):
        lo, hi = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        if lo < hi:
            out.append((lo, hi))
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return out


def backlogged_service(run: SimRun, table: TenantTable) -> tuple[tuple[float, float], dict[str, float]]:
    """The longest stretch of time during which every tenant of the workload had work waiting, and each
    tenant's input tokens dispatched in it divided by its weight (what the fair order equalises)."""
    wl = run.workload
    if wl.tenant is None:
        raise ValueError("backlogged_service: the workload has no tenant column")
    dispatch = np.asarray(run.record.dispatch_s, dtype=float)
    names = sorted(set(wl.tenant.tolist()))
    common: list[tuple[float, float]] | None = None
    for name in names:
        mine = (wl.tenant == name) & np.isfinite(dispatch)
        busy = _busy(wl.arrival_s[mine], dispatch[mine])
        common = busy if common is None else _intersect(common, busy)
    if not common:
        return (0.0, 0.0), {name: 0.0 for name in names}
    lo, hi = max(common, key=lambda iv: iv[1] - iv[0])
    inside = (dispatch >= lo) & (dispatch < hi)
    tokens = wl.input_tokens
    return (lo, hi), {name: float(tokens[inside & (wl.tenant == name)].sum()) / table.spec(name).weight
                      for name in names}


def only(workload: Workload, tenant: str) -> Workload:
    """The rows of one tenant, at their own times (the first no longer at 0)."""
    return _rows(workload, np.asarray(_tenants(workload) == tenant), f"{workload.name}:{tenant}")


def except_(workload: Workload, tenants: Sequence[str]) -> Workload:
    """The rows of every tenant but ``tenants``, at their own times."""
    name = f"{workload.name}-{'-'.join(tenants)}"
    return _rows(workload, ~np.isin(_tenants(workload), list(tenants)), name)


def _tenants(workload: Workload) -> np.ndarray:
    if workload.tenant is None:
        raise ValueError(f"{workload.name}: the workload has no tenant column")
    return workload.tenant


def _rows(workload: Workload, m: np.ndarray, name: str) -> Workload:
    return Workload(name, workload.arrival_s[m], workload.input_tokens[m], workload.output_tokens[m],
                    workload.priority[m], _tenants(workload)[m])


ORDERS = ("fair", "fcfs")


def compare_orders(workload: Workload, table: TenantTable, config: SchedulerConfig, cost_model: CostModel,
                   *, service: ServiceModel | None = None, sla_s: float = 1.0, warmup_s: float = 0.0,
                   noise: bool = False, seed: int = 0, alone: bool = True, without: Sequence[str] = ()
                   ) -> dict[str, dict[str, TenantReport]]:
    """Each tenant's report under each queue order of ``ORDERS`` (``config`` otherwise as given); with
    ``without``, the other tenants' rows alone (key ``"without"``, under ``config``'s order); with
    ``alone``, each tenant with its own rows only: ``{order: {tenant: report}}``."""
    out: dict[str, dict[str, TenantReport]] = {}
    for order in ORDERS:
        cfg = dataclasses.replace(config, queue_order=order)
        run = simulate_encoder(workload, cfg, cost_model, noise=noise, seed=seed, service=service,
                               tenants=table)
        out[order] = {r.tenant: r for r in per_tenant(run, sla_s, warmup_s)}
    if without and workload.tenant is not None:
        run = simulate_encoder(except_(workload, without), config, cost_model, noise=noise, seed=seed,
                               service=service, tenants=table)
        out["without"] = {r.tenant: r for r in per_tenant(run, sla_s, warmup_s)}
    if alone and workload.tenant is not None:
        out["alone"] = {}
        for name in sorted(set(workload.tenant.tolist())):
            run = simulate_encoder(only(workload, name), config, cost_model, noise=noise, seed=seed,
                                   service=service, tenants=table)
            out["alone"].update({r.tenant: r for r in per_tenant(run, sla_s, warmup_s)})
    return out


@dataclass(frozen=True)
class LLMTenantReport:
    """What one tenant got in an LLM run: TTFT and time per output token (of its finished requests)."""

    tenant: str
    requests: int
    completed: int
    failed: int  # refused or expired
    ttft_p50_s: float
    ttft_p99_s: float
    tpot_p50_s: float
    tpot_p99_s: float
    output_tokens_s: float  # of its finished requests, per second of the run


def per_tenant_llm(run: Any) -> list[LLMTenantReport]:
    """An ``LLMSimRun``'s results split by its workload's tenant column."""
    wl, rec = run.workload, run.record
    tenants = wl.tenant if wl.tenant is not None else np.full(len(wl), "default")
    first, finish = np.asarray(rec.first_token_s, dtype=float), np.asarray(rec.finish_s, dtype=float)
    out_tokens = np.asarray(rec.num_output, dtype=float)
    ok = np.array([r is None for r in rec.rejected]) & np.isfinite(finish)
    span = max(float(np.nanmax(finish)) - float(wl.arrival_s[0]), 1e-9) if ok.any() else 1e-9
    out = []
    for name in sorted(set(tenants.tolist())):
        mine = tenants == name
        done = mine & ok
        ttft = first[done] - wl.arrival_s[done]
        many = done & (out_tokens > 1)
        tpot = (finish[many] - first[many]) / (out_tokens[many] - 1)

        def q(x: np.ndarray, p: float) -> float:
            return float(np.percentile(x, p)) if x.size else math.nan
        out.append(LLMTenantReport(name, int(mine.sum()), int(done.sum()), int(mine.sum() - done.sum()),
                                   q(ttft, 50), q(ttft, 99), q(tpot, 50), q(tpot, 99),
                                   float(out_tokens[done].sum()) / span))
    return out


LLM_POLICIES = ("fair", "fcfs")


def compare_llm_policies(workload: Workload, table: TenantTable, config: Any, cost_model: CostModel, *,
                         service: Any = None, without: Sequence[str] = ()
                         ) -> dict[str, dict[str, LLMTenantReport]]:
    """Each tenant's TTFT and TPOT under each LLM policy of ``LLM_POLICIES`` (``config``, an
    ``LLMSchedulerConfig``, otherwise as given) and, with ``without``, the other tenants' rows alone
    under ``config``'s policy: ``{policy or "without": {tenant: report}}``."""
    from batchpilot.sim.llm import simulate_llm

    runs = {policy: (workload, dataclasses.replace(config, policy=policy)) for policy in LLM_POLICIES}
    if without and workload.tenant is not None:
        runs["without"] = (except_(workload, without), config)
    return {key: {r.tenant: r for r in per_tenant_llm(simulate_llm(wl, cfg, cost_model, service=service,
                                                                   tenants=table))}
            for key, (wl, cfg) in runs.items()}


def llm_tenants_table(results: dict[str, dict[str, LLMTenantReport]], table: TenantTable, title: str) -> Any:
    """A rich table: per tenant, its weight, then TTFT P50 / P99 and TPOT P99 per policy."""
    from rich.table import Table

    out = Table(title=title)
    out.add_column("tenant")
    out.add_column("weight", justify="right")
    for policy in results:
        out.add_column(f"{policy} TTFT P50 / P99 ms", justify="right")
        out.add_column(f"{policy} TPOT P99 ms", justify="right")
        out.add_column(f"{policy} failed", justify="right")
    for name in next(iter(results.values())):
        row = [name, f"{table.spec(name).weight:g}"]
        for reports in results.values():
            r = reports.get(name)
            row += ([f"{r.ttft_p50_s * 1e3:.0f} / {r.ttft_p99_s * 1e3:.0f}", f"{r.tpot_p99_s * 1e3:.1f}",
                     f"{r.failed}"] if r else ["-", "-", "-"])
        out.add_row(*row)
    return out


def tenants_table(results: dict[str, dict[str, TenantReport]], table: TenantTable, title: str) -> Any:
    """A rich table: per tenant, its weight and offered rate, then P50 / P99 / failures per order."""
    from rich.table import Table

    out = Table(title=title)
    out.add_column("tenant")
    out.add_column("weight", justify="right")
    out.add_column("offered req/s", justify="right")
    for order in results:
        out.add_column(f"{order} P50 / P99 ms", justify="right")
        out.add_column(f"{order} failed", justify="right")
    first = next(iter(results.values()))
    for name, rep in first.items():
        row = [name, f"{table.spec(name).weight:g}", f"{rep.offered_rps:.2f}"]
        for reports in results.values():
            r = reports.get(name)
            row += [f"{r.p50_s * 1e3:.0f} / {r.p99_s * 1e3:.0f}" if r else "-", f"{r.failed}" if r else "-"]
        out.add_row(*row)
    return out
