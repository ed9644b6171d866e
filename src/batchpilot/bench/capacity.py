"""Capacity search: the highest rate scale at which P99 latency meets the SLA.

The search is generic over a *probe*: ``probe(rate_scale) -> Summary``. Live, a probe replays the
same contiguous slice of the workload, sped up ``rate_scale`` times and cut to at most ``probe_s``
seconds of sending (each probe is bounded in time), and stops early as soon as the SLA is lost for
certain (more than 1% of the probe's requests already late or failed: no later reply can bring P99
back under the SLA). The fidelity check runs the same search with a simulated probe.

Each live probe replays the busiest ``probe_s`` seconds of the sped-up slice (``probe_rows``), so a
short probe at a low rate still contains the burst that decides P99.

Search: grow the rate geometrically from ``start`` until a probe fails (or ``hi`` passes), then
bisect between the last pass and the first fail until they are within ``rel_tol`` of each other or
``max_probes`` is spent. Latency is not perfectly monotone in rate on a real trace (a burst can land
differently), so the answer is "the highest probed rate that passed below the first failure".
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np

from batchpilot.bench.loadgen import LoadGenConfig, build_plan, replay
from batchpilot.bench.records import RequestRecord, Summary, summarize
from batchpilot.bench.scrape import QUEUE_HINTS, parse_metrics
from batchpilot.sim.traces import Workload


@dataclass(frozen=True)
class CapacityConfig:
    sla_s: float = 1.0
    start: float = 1.0  # first rate scale probed
    growth: float = 2.0  # geometric step while probes pass
    lo: float = 0.05  # never probe below / above these scales
    hi: float = 64.0
    rel_tol: float = 0.1  # stop bisecting when fail / pass < 1 + rel_tol
    max_probes: int = 10
    probe_s: float = 30.0  # live probes: at most this many seconds of arrivals
    cooldown_s: float = 10.0  # live: after a probe, wait (at most this) for the server's queue to drain
    warmup_requests: int = 0

    def __post_init__(self) -> None:
        if not (0 < self.lo <= self.start <= self.hi):
            raise ValueError(f"capacity: need 0 < lo <= start <= hi, got {self.lo}, {self.start}, {self.hi}")
        if self.growth <= 1 or self.rel_tol <= 0 or self.max_probes < 1 or self.sla_s <= 0:
            raise ValueError("capacity: growth must be > 1, rel_tol > 0, max_probes >= 1, sla_s > 0")
        if self.probe_s <= 0:
            raise ValueError(f"capacity.probe_s must be > 0 seconds, got {self.probe_s}")


@dataclass
class Probe:
    rate_scale: float
    passed: bool
    summary: Summary
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class CapacityResult:
    """``rate_scale`` = highest passing scale (0 if none passed); ``rps`` its offered request rate."""

    rate_scale: float
    rps: float
    probes: list[Probe]
    sla_s: float

    def table(self) -> str:
        head = ("scale", "offered/s", "thru/s", "p50 ms", "p99 ms", "errors")
        lines = ["{:>7} {:>9} {:>7} {:>8} {:>8} {:>6}  result".format(*head)]
        for p in sorted(self.probes, key=lambda p: p.rate_scale):
            s = p.summary
            err = s.num_requests - s.num_ok
            lines.append(f"{p.rate_scale:7.3f} {s.offered_rps:9.2f} {s.throughput_rps:7.2f} "
                         f"{s.p50 * 1e3:8.1f} {s.p99 * 1e3:8.1f} {err:6d}  {'pass' if p.passed else 'FAIL'}")
        bound = "" if self.bracketed else " (a lower bound: no probe failed)"
        lines.append(f"capacity: rate scale {self.rate_scale:.3f} = {self.rps:.2f} req/s "
                     f"with P99 <= {self.sla_s:g} s{bound}")
        return "\n".join(lines)

    @property
    def bracketed(self) -> bool:
        """A probe above the answer failed: the capacity is found, not just bounded from below."""
        return any(not p.passed and p.rate_scale > self.rate_scale for p in self.probes)


def search_capacity(probe: Callable[[float], Summary], config: CapacityConfig,
                    on_probe: Callable[[Probe], None] | None = None) -> CapacityResult:
    probes: list[Probe] = []

    def run(k: float) -> bool:
        s = probe(k)
        p = Probe(k, bool(s.sla_met), s)
        probes.append(p)
        if on_probe is not None:
            on_probe(p)
        return p.passed

    good, bad = 0.0, math.inf
    k = config.start
    while len(probes) < config.max_probes:  # grow (or shrink, if the first probe fails)
        if run(k):
            good = k
            if k >= config.hi:
                break
            if bad < math.inf:
                break
            k = min(k * config.growth, config.hi)
        else:
            bad = k
            if good > 0 or k <= config.lo:
                break
            k = max(k / config.growth, config.lo)
    while len(probes) < config.max_probes and good > 0 and bad < math.inf and bad / good > 1 + config.rel_tol:
        k = math.sqrt(good * bad)
        if run(k):
            good = k
        else:
            bad = k
    passed = [p for p in probes if p.passed and p.rate_scale < bad]
    best = max(passed, key=lambda p: p.rate_scale, default=None)
    return CapacityResult(best.rate_scale if best else 0.0, best.summary.offered_rps if best else 0.0,
                          probes, config.sla_s)


def sla_lost(sla_s: float, total: int) -> Callable[[list[RequestRecord]], bool]:
    """``stop_when`` for a probe: true once more than 1% of ``total`` requests are late or failed."""
    budget = max(int(total * 0.01), 0)
    seen = [0, 0]  # records looked at, late among them (``done`` only grows: count incrementally)

    def check(done: list[RequestRecord]) -> bool:
        for r in done[seen[0]:]:
            seen[1] += not r.warmup and (not r.ok or r.latency_s > sla_s)
        seen[0] = len(done)
        return seen[1] > budget

    return check


def wait_idle(base_url: str, max_s: float, poll_s: float = 0.2) -> float:
    """Wait until every queue-like gauge of the server's ``/metrics`` reads 0 (or ``max_s`` passes; a
    server without ``/metrics`` gets the full ``max_s``). Returns the seconds waited."""
    t0 = time.monotonic()
    with httpx.Client(base_url=base_url, timeout=5.0) as client:
        while (waited := time.monotonic() - t0) < max_s:
            try:
                resp = client.get("/metrics")
                values = parse_metrics(resp.text) if resp.status_code == 200 else None
            except (httpx.HTTPError, ValueError):
                values = None
            if values is None:
                time.sleep(max_s - waited)
                break
            queues = [v for k, v in values.items() if any(h in k.lower() for h in QUEUE_HINTS)
                      and not k.split("{")[0].endswith(("_sum", "_count", "_total", "_created"))]
            if not any(queues):
                break
            time.sleep(poll_s)
    return time.monotonic() - t0


def probe_rows(workload: Workload, rate_scale: float, probe_s: float,
               busiest: bool = False) -> tuple[int, int]:
    """``(start, count)``: the rows of one ``probe_s``-second window of the slice sped up ``rate_scale``
    times — the first window, or with ``busiest`` the one holding the most requests (where P99 is
    decided: on conv-embed the burst at trace seconds 40-50). Contiguous rows either way."""
    t = workload.arrival_s / rate_scale
    if not busiest:
        return 0, max(int((t <= probe_s).sum()), 1)
    ends = np.searchsorted(t, t + probe_s, side="right")  # window [t_i, t_i + probe_s] holds rows i..end-1
    start = int(np.argmax(ends - np.arange(len(t))))
    return start, max(int(ends[start]) - start, 1)


def probe_workload(workload: Workload, rate_scale: float, probe_s: float, busiest: bool = False) -> Workload:
    """The rows of ``probe_rows`` sped up ``rate_scale`` times (re-offset to start at 0)."""
    start, count = probe_rows(workload, rate_scale, probe_s, busiest)
    return workload.slice(start, count).scale_rate(rate_scale)


def live_capacity(workload: Workload, loadgen: LoadGenConfig, config: CapacityConfig,
                  texts: list[str] | None = None, tokenizer: Any = None,
                  on_probe: Callable[[Probe], None] | None = None,
                  turn: Callable[[], AbstractContextManager[Any]] = nullcontext) -> CapacityResult:
    """Capacity of the server at ``loadgen.url`` on ``workload`` (texts are built once for the slice).
    Each probe runs inside ``turn()`` (``bench.interleave``: several searches taking turns)."""
    if loadgen.endpoint == "embeddings" and texts is None:
        texts = [p.body["input"] for p in build_plan(workload, "embeddings", tokenizer=tokenizer)]

    def probe(k: float) -> Summary:
        with turn():
            return _probe(k)

    def _probe(k: float) -> Summary:
        start, count = probe_rows(workload, k, config.probe_s, busiest=True)
        wl = workload.slice(start, count).scale_rate(k)
        plan = build_plan(wl, loadgen.endpoint, texts=texts[start: start + count] if texts else None,
                          warmup_requests=config.warmup_requests)
        measured = len(plan) - config.warmup_requests
        res = replay(plan, loadgen, stop_when=sla_lost(config.sla_s, measured), description=f"x{k:.3g}")
        # requests cancelled client-side may still be queued or running server-side: let them drain so
        # the next probe starts on an idle server
        wait_idle(loadgen.base_url, config.cooldown_s if res.stopped_early else min(config.cooldown_s, 2.0))
        return summarize(res.records, config.sla_s)

    return search_capacity(probe, config, on_probe)
