"""The simulator's answer as a distribution: the same requests replayed under several service-noise draws.

With service noise on (``--noise``, or a profile whose serving path holds loaded residuals), every batch's
time is drawn from the profile's spread, so one simulated run is one sample of what the server may do.
The arrivals are fixed (a trace, or a seeded synthetic workload), so the draws differ only in the batch
times — as two live replays of the same rows do. A tail metric over a thousand requests rests on its ten
slowest: one draw's P99 can sit 20-30% away from another's. ``draw_reports`` runs the simulation once per
seed (``seed``, ``seed + 1``, ...); the prediction of a metric is its median over the draws, and its
5th-95th percentiles are the band a single live run of these requests is expected to fall in.

Contract: ``draw_reports(run_one, draws, seed)`` calls ``run_one(s)`` for ``draws`` consecutive seeds and
keeps the reports in seed order; ``Drawn.median(name)`` and ``Drawn.band(name)`` read ``METRICS`` from
them, over the draws where the metric is defined (a draw that completed nothing has no P50);
``Drawn.central`` is the draw whose P99 is the median (lower middle for an even count), a real run
whose other fields (histograms, utilisation) go with the medians in reports. Nothing here is fitted:
the spread comes from the profile's residuals only. ``sim.target.draws_batch_times`` says whether
draws differ at all.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from batchpilot.sim.metrics import SimReport

BAND = (5.0, 95.0)  # percentiles of the draws that bound the band
DEFAULT_DRAWS = 10


def _failed(r: SimReport) -> float:
    return float(r.num_rejected + r.num_dropped + r.num_unfinished)


METRICS: dict[str, Callable[[SimReport], float]] = {
    "p50": lambda r: r.latency["p50"],
    "p90": lambda r: r.latency["p90"],
    "p99": lambda r: r.latency["p99"],
    "p99.9": lambda r: r.latency["p99.9"],
    "mean": lambda r: r.latency["mean"],
    "p99_all": lambda r: r.p99_all,
    "throughput_rps": lambda r: r.throughput_rps,
    "goodput_rps": lambda r: r.goodput_rps,
    "sla_attainment": lambda r: r.sla_attainment,
    "failed": _failed,
    "mean_batch_size": lambda r: r.mean_batch_size,
}


@dataclass(frozen=True)
class Drawn:
    reports: tuple[SimReport, ...]
    seed: int

    def values(self, name: str) -> np.ndarray:
        return np.array([METRICS[name](r) for r in self.reports], dtype=float)

    def median(self, name: str) -> float:
        """The metric's median over the draws that have it (NaN: a draw that completed nothing)."""
        v = self.values(name)
        v = v[~np.isnan(v)]
        return float(np.median(v)) if v.size else math.nan

    def band(self, name: str) -> tuple[float, float]:
        """The metric's 5th and 95th percentiles over the draws that have it."""
        v = self.values(name)
        v = v[~np.isnan(v)]
        if not v.size:
            return math.nan, math.nan
        # inf (a draw that refused or dropped a request, for the P99 counting those) does not
        # interpolate: take the nearest draw instead
        lo, hi = np.percentile(v, BAND, method="inverted_cdf" if np.isinf(v).any() else "linear")
        return float(lo), float(hi)

    def to_dict(self) -> dict[str, Any]:
        """Per metric of ``METRICS``: ``{"median": m, "band": [p5, p95]}``, with the draws and first seed."""
        out: dict[str, Any] = {"draws": len(self.reports), "seed": self.seed}
        for name in METRICS:
            out[name] = {"median": self.median(name), "band": list(self.band(name))}
        return out

    @property
    def central(self) -> SimReport:
        p99 = self.values("p99")
        order = np.argsort(np.nan_to_num(p99, nan=math.inf), kind="stable")
        return self.reports[int(order[(len(order) - 1) // 2])]


def draw_reports(run_one: Callable[[int], SimReport], draws: int, seed: int = 0) -> Drawn:
    """``run_one(seed + i)`` for ``i < draws`` (``draws >= 1``), as a ``Drawn``."""
    if draws < 1:
        raise ValueError(f"draws must be >= 1, got {draws}")
    return Drawn(tuple(run_one(seed + i) for i in range(draws)), seed)


def encoder_draws(workload: Any, config: Any, cost_model: Any, draws: int, seed: int = 0, sla_s: float = 1.0,
                  warmup_s: float = 0.0, first: SimReport | None = None, **kwargs: Any) -> Drawn:
    """``sim.target.simulate_encoder(workload, config, cost_model, seed=s, **kwargs)`` summarised per draw;
    ``first``: the report of the ``seed`` draw, already run (reused, not run again)."""
    from batchpilot.sim.metrics import summarize
    from batchpilot.sim.target import simulate_encoder

    def one(s: int) -> SimReport:
        if first is not None and s == seed:
            return first
        return summarize(simulate_encoder(workload, config, cost_model, seed=s, **kwargs), sla_s, warmup_s)

    return draw_reports(one, draws, seed)


def spread_table(drawn: Drawn, title: str) -> Any:
    """A rich table of each headline metric's median and 5-95% band over the draws."""
    from rich.table import Table

    from batchpilot.sim.metrics import ms

    t = Table(title=title, show_header=True, header_style="bold")
    for col in ("metric", "median", f"band (P{BAND[0]:g}-P{BAND[1]:g} of {len(drawn.reports)} draws)"):
        t.add_column(col, justify="left" if col == "metric" else "right")
    rows: list[tuple[str, str, Callable[[float], str]]] = [
        ("latency p50", "p50", ms), ("latency p99", "p99", ms), ("P99 incl. rejected/dropped", "p99_all", ms),
        ("throughput req/s", "throughput_rps", lambda x: f"{x:,.2f}"),
        ("goodput req/s", "goodput_rps", lambda x: f"{x:,.2f}"),
        ("rejected / dropped / unfinished", "failed", lambda x: f"{x:,.0f}"),
        ("mean batch size", "mean_batch_size", lambda x: f"{x:.2f}")]
    for label, name, fmt in rows:
        lo, hi = drawn.band(name)
        t.add_row(label, fmt(drawn.median(name)), f"{fmt(lo)} .. {fmt(hi)}")
    return t
