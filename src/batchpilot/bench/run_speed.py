"""How fast a live run's batches ran against the profile: the machine's speed, reported beside an error.

The server's batch log (``serve --batch-log``) holds every batch's slot seconds and features. The
profile prices each of them as the simulator does: ``FrontEnd.batch_seconds`` of the cost model's
prediction at the request rate of the second before the batch started (``rates_before``), counted from
the requests' arrivals at the scheduler that the log holds (as the profile counts it; an older log
without them: the load generator's send times, the same monotonic clock), after the time no batch
ran before it (``idle_before``) and at its busy share (``sim.before_batch``). ``RunSpeed`` is the
ratio of the totals, minus 1 (+5%: the batches took 5% longer than the profile says), and the same ratio over
``WINDOW_S`` windows of the run, so a drift within the run shows as a spread between its windows.

It is a report, never an input of the prediction: a prediction uses the profile file only.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from batchpilot.core.costmodel import CostModel
from batchpilot.runtime.batch_log import LoggedBatch, read_batches
from batchpilot.sim.before_batch import BUSY_EDGES, IDLE_EDGES_S, busy_shares, idle_times
from batchpilot.sim.frontend import FrontEnd, rates_before

WINDOW_S = 15.0
MIN_WINDOW_BATCHES = 10  # a window with fewer batches is left out of the spread
IDLE_BINS_S = (0.0, *IDLE_EDGES_S, math.inf)  # idle before a batch, for ``by_idle`` (the profile's bins)
SIZE_BINS = ((1, 1), (2, 2), (3, 4), (5, 8), (9, 10**9))  # requests in a batch, for ``by_size``
RATE_BINS = (0.0, 5.0, 10.0, 20.0, 30.0, 45.0, 60.0, 75.0, math.inf)  # req/s in the second before a batch


@dataclass(frozen=True)
class RunSpeed:
    speed: float  # total slot seconds / total priced seconds - 1
    batches: int
    windows: tuple[float, ...] = field(default=())  # the same ratio - 1 per WINDOW_S window, in order
    by_idle: tuple[tuple[str, int, float], ...] = ()  # (idle bin, batches, ratio - 1) per IDLE_BINS_S bin
    by_size: tuple[tuple[str, int, float], ...] = ()  # (size bin, batches, ratio - 1) per SIZE_BINS bin
    by_rate: tuple[tuple[str, int, float], ...] = ()  # (rate bin, batches, ratio - 1) per RATE_BINS bin
    by_busy: tuple[tuple[str, int, float], ...] = ()  # (busy bin, batches, ratio - 1) per BUSY_EDGES bin

    @property
    def spread(self) -> str:
        """The windows' lowest and highest speed, e.g. ``-4.0% .. +31.2%`` (``-`` without windows)."""
        if not self.windows:
            return "-"
        return f"{min(self.windows):+.1%} .. {max(self.windows):+.1%}"

    def to_dict(self) -> dict[str, object]:
        return {"speed_vs_profile": self.speed, "batches": self.batches, "window_s": WINDOW_S,
                "windows": list(self.windows), "by_idle": [list(b) for b in self.by_idle],
                "by_size": [list(b) for b in self.by_size], "by_rate": [list(b) for b in self.by_rate],
                "by_busy": [list(b) for b in self.by_busy]}


def priced_seconds(batches: Sequence[LoggedBatch], cost_model: CostModel, frontend: FrontEnd | None,
                   rates: Sequence[float], idle: Sequence[float] | None = None,
                   busy: Sequence[float] | None = None) -> list[float]:
    """What the profile says each batch takes (``batches`` in start order): under serving load at its
    rate, after its idle time (``idle_before``), at its size and busy share (``busy_before``) with
    ``frontend``, else the bare cost model."""
    if frontend is None:
        return [cost_model.latency(b.features) for b in batches]
    idle = idle_before(batches) if idle is None else idle
    busy = busy_before(batches) if busy is None else busy
    return [frontend.batch_seconds(cost_model.latency(b.features), r, t, b.features.get("tokens", 0.0), s)
            for b, r, t, s in zip(batches, rates, idle, busy, strict=True)]


def logged_rates(batches: Sequence[LoggedBatch]) -> list[float]:
    """Per batch (in start order), the request rate of the second before it from the arrivals the batch
    log holds (``rates_before``); a log without them counts each batch's requests at its start."""
    arrivals = ([a for b in batches for a in b.arrivals] if all(b.arrivals for b in batches)
                else [b.start for b in batches for _ in range(b.n)])
    return rates_before([b.start for b in batches], arrivals)


def speed_of(batches: Sequence[LoggedBatch], priced: Sequence[float]) -> RunSpeed:
    """The ratio of the totals, and per ``WINDOW_S`` window from the first batch's start."""
    took, want = sum(b.slot_s for b in batches), sum(priced)
    if not batches or want <= 0:
        return RunSpeed(math.nan, len(batches))
    t0 = batches[0].start
    sums: dict[int, list[float]] = {}
    for b, p in zip(batches, priced, strict=True):
        cell = sums.setdefault(int((b.start - t0) // WINDOW_S), [0.0, 0.0, 0.0])
        cell[0] += b.slot_s
        cell[1] += p
        cell[2] += 1
    windows = tuple(s / p - 1.0 for _, (s, p, n) in sorted(sums.items()) if n >= MIN_WINDOW_BATCHES and p > 0)
    return RunSpeed(took / want - 1.0, len(batches), windows)


def idle_before(batches: Sequence[LoggedBatch]) -> list[float]:
    """Per batch, in start order, how long the server sat with no batch running before it started
    (the first batch's is infinite): ``sim.before_batch.idle_times``."""
    return idle_times([b.start for b in batches], [b.slot_s for b in batches])


def split(batches: Sequence[LoggedBatch], priced: Sequence[float], keys: Sequence[float],
          bins: Sequence[tuple[float, float, str]]) -> tuple[tuple[str, int, float], ...]:
    """The ratio of the totals - 1 per bin ``(lo, hi, label)`` of the batches' ``keys`` (``lo <= key <
    hi``; an infinite ``hi`` takes infinite keys too), for the bins that hold a batch."""
    out = []
    for lo, hi, label in bins:
        cell = [(b.slot_s, p) for b, p, k in zip(batches, priced, keys, strict=True)
                if lo <= k and (k < hi or math.isinf(hi))]
        want = sum(p for _, p in cell)
        if cell and want > 0:
            out.append((label, len(cell), sum(t for t, _ in cell) / want - 1.0))
    return tuple(out)


def by_idle(batches: Sequence[LoggedBatch], priced: Sequence[float]) -> tuple[tuple[str, int, float], ...]:
    """Per ``IDLE_BINS_S`` bin of the idle time before the batch: flat when the profile's idle factors
    price how much slower a batch after an idle server runs than one right behind another."""
    bins = [(lo, hi, f">= {lo * 1e3:g} ms" if math.isinf(hi) else f"{lo * 1e3:g}-{hi * 1e3:g} ms")
            for lo, hi in zip(IDLE_BINS_S, IDLE_BINS_S[1:], strict=False)]
    return split(batches, priced, idle_before(batches), bins)  # the first batch (inf) in the last bin


def by_size(batches: Sequence[LoggedBatch], priced: Sequence[float]) -> tuple[tuple[str, int, float], ...]:
    """Per ``SIZE_BINS`` bin of requests in the batch: flat when the cost model prices a live batch of
    many inputs as well as a lone one."""
    bins = [(lo, hi + 0.5, str(lo) if lo == hi else (f"{lo}+" if hi >= 10**9 else f"{lo}-{hi}"))
            for lo, hi in SIZE_BINS]
    return split(batches, priced, [b.n for b in batches], bins)


def by_rate(batches: Sequence[LoggedBatch], priced: Sequence[float],
            rates: Sequence[float]) -> tuple[tuple[str, int, float], ...]:
    """Per ``RATE_BINS`` bin of the request rate of the second before the batch: flat when the profile
    prices how the serving load slows (or warms) the model."""
    bins = [(lo, hi, f">= {lo:g}/s" if math.isinf(hi) else f"{lo:g}-{hi:g}/s")
            for lo, hi in zip(RATE_BINS, RATE_BINS[1:], strict=False)]
    return split(batches, priced, rates, bins)


def busy_before(batches: Sequence[LoggedBatch]) -> list[float]:
    """Per batch, in start order, the busy share of the second before it (``sim.before_batch``)."""
    return busy_shares([b.start for b in batches], [b.slot_s for b in batches])


def by_busy(batches: Sequence[LoggedBatch], priced: Sequence[float],
            busy: Sequence[float] | None = None) -> tuple[tuple[str, int, float], ...]:
    """Per ``BUSY_EDGES`` bin of the busy share of the second before the batch (``busy_before``, or
    ``busy``): flat when the profile's busy factors price how a busy second speeds the next batch."""
    edges = (0.0, *BUSY_EDGES, math.inf)
    bins = [(lo, hi, f">= {lo:g}" if math.isinf(hi) else f"{lo:g}-{hi:g}")
            for lo, hi in zip(edges, edges[1:], strict=False)]
    return split(batches, priced, busy_before(batches) if busy is None else busy, bins)


def run_speed(batch_log: Path, offset: int, cost_model: CostModel, frontend: FrontEnd | None,
              sent_s: Sequence[float]) -> RunSpeed:
    """The batches logged from byte ``offset`` on against the profile, each at the request rate of the
    second before it: from the arrivals at the scheduler the log holds (``logged_rates``: the clock
    the profile counts its rate on), else from ``sent_s`` (the run's send times, warm-up included);
    by idle time before the batch, by batch size and by rate too."""
    if not batch_log.exists():
        return RunSpeed(math.nan, 0)
    batches, _ = read_batches(batch_log, offset)
    batches.sort(key=lambda b: b.start)  # logged as they finish: with several slots not in start order
    rates = (logged_rates(batches) if batches and all(b.arrivals for b in batches)
             else rates_before([b.start for b in batches], sent_s))
    busy = busy_before(batches)
    priced = priced_seconds(batches, cost_model, frontend, rates, busy=busy)
    return dataclasses.replace(speed_of(batches, priced), by_idle=by_idle(batches, priced),
                               by_size=by_size(batches, priced), by_rate=by_rate(batches, priced, rates),
                               by_busy=by_busy(batches, priced, busy))
