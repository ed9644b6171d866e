"""What a batch and a request cost around the scheduler, in simulation, as ``batchpilot profile`` measured it.

The scheduler prices a batch with the cost model; a served request also pays the serving path around
the Batcher, and a served batch's time moves with what ran before it and scatters around its price.
This file models those, each fitted from the profile alone (never from the traffic it predicts):

    fits            ``fit_line`` (a robust ``y ~ a + b x``, ``a, b >= 0``), ``binned_factors`` /
                    ``step_factor`` (a factor per bin of a step function)
    FrontEnd        the serving path: tokenizer and HTTP stages, each ``const + per_token * L``, and
                    the loaded-batch terms (``served_seconds``)
    before a batch  its idle time and how busy the last second was (``BusyWindow``, ``idle_factor``,
                    ``busy_factor``), which move a loaded batch off its price
    noise           ``BatchNoise``: a residual per batch and a wander of the machine's speed, seeded
"""

from __future__ import annotations

import bisect
import dataclasses
import heapq
import json
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np

# -- Fits ------------------------------------------------------------------------------------------

def fit_line(x: np.ndarray, y: np.ndarray, trim: bool = True) -> tuple[float, float]:
    """``y ~ a + b x`` by least squares without the worst 10% of residuals (``trim``), with a, b >= 0 (a
    negative slope or intercept is noise: fall back to the one-parameter fit — the median, or untrimmed
    the mean, so that the fitted line keeps the mean of ``y``)."""
    a, b = _lstsq(x, y)
    keep = np.abs(y - a - b * x) <= np.percentile(np.abs(y - a - b * x), 90)  # drop the scheduler hiccups
    if trim and keep.sum() >= 3:
        a, b = _lstsq(x[keep], y[keep])
    if b < 0 or np.ptp(x) == 0:
        return max(float(np.median(y) if trim else np.mean(y)), 0.0), 0.0
    if a < 0:
        return 0.0, max(float(np.dot(x, y) / np.dot(x, x)), 0.0)
    return a, b


def _lstsq(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    if np.ptp(x) == 0:
        return float(np.mean(y)), 0.0
    coef = np.linalg.lstsq(np.column_stack([np.ones_like(x), x]), y, rcond=None)[0]
    return float(coef[0]), float(coef[1])


def binned_factors(index: np.ndarray, bins: int, took: np.ndarray, line: np.ndarray,
                   prior: float) -> tuple[tuple[float, ...], list[int]]:
    """Per bin ``k`` (the rows with ``index == k``): ``(sum took + prior * m) / (sum line + prior * m)``,
    ``m`` the bin's mean line, so a bin of few rows stays near 1 (none: exactly 1). Normalised so that
    the line times the factors keeps the totals (``sum took``). Returns the factors and the rows per
    bin."""
    factors, counts = [], []
    for k in range(bins):
        cell = index == k
        n = int(cell.sum())
        counts.append(n)
        m = float(line[cell].mean()) if n else 1.0
        factors.append((float(took[cell].sum()) + prior * m) / (float(line[cell].sum()) + prior * m))
    scale = float(line.sum()) / float(sum(line[index == k].sum() * f for k, f in enumerate(factors)))
    return tuple(f * scale for f in factors), counts


def step_factor(steps: Sequence[tuple[int, float]], x: float) -> float:
    """The factor of the last ``(lower_bound, factor)`` of ``steps`` (ascending bounds) not above ``x``;
    1 without steps."""
    return steps[max(bisect.bisect_right([lo for lo, _ in steps], x) - 1, 0)][1] if steps else 1.0


def backfit_factors(bins: Sequence[tuple[np.ndarray, int]], took: np.ndarray, base: np.ndarray,
                    prior: float, rounds: int = 8) -> list[tuple[tuple[float, ...], list[int]]]:
    """Several sets of ``binned_factors`` at once: per set ``(index, bins)``, the factors of
    ``took ~ base * (product of every set's factor for the row)``, each set refitted in turn against
    ``base`` times the others' factors (backfitting, ``rounds`` times), so that a cause that two sets
    both see (a batch after an idle server is also one after a sparse second) lands on the set that
    explains it rather than on the one fitted first. Returns per set its factors and rows per bin."""
    out: list[tuple[tuple[float, ...], list[int]]] = [((1.0,) * n, []) for _, n in bins]
    for _ in range(rounds if len(bins) > 1 else 1):
        for k, (index, n) in enumerate(bins):
            line = base.copy()
            for j, (other, _) in enumerate(bins):
                if j != k:
                    line *= np.asarray(out[j][0])[other]
            out[k] = binned_factors(index, n, took, line * (took.sum() / line.sum()), prior)
    return out


# -- FrontEnd: the serving path --------------------------------------------------------------------
# The serving path around the batcher: what a request spends outside it, as a two-part model.
#
# A live request does more than wait in the Batcher: the HTTP server parses it, the one tokenizer
# thread tokenises it, and the response is JSON-encoded and read back by the client. The core never
# sees that time, so a simulator of the core alone predicts the *batcher's* latency, not the client's.
# ``FrontEnd`` adds it back with two stages, each ``const + per_token * L``:
#
# * ``serial``: ``serial_servers`` servers in FIFO order before the batcher — the tokenizer threads.
#   Request ``i`` reaches the batcher at ``d_i = max(a_i, f) + serial(L_i) * serial_busy_factor``, ``f``
#   the time the earliest server is free (Lindley's recursion for one server), so a burst queues here
#   as it does live, and the batcher sees the burst spread out.
# * ``delay``: time that overlaps across requests (HTTP parsing, response encoding, the client) added
#   to every request's finish time.
#
# The fields:
#
# * ``serial_const_s``, ``serial_per_token_s``: a tokenizer thread's time per request (the
#   ``tokenize`` part of the server's ``Server-Timing`` header) on an idle server.
# * ``serial_servers``: how many tokenizer threads the profiled server had; a deployment that sets
#   ``server.tokenizer_workers`` (``--tokenizer-workers``) runs with that many (``serving``).
# * ``delay_const_s``, ``delay_per_token_s``: the client's latency minus the ``tokenize`` and ``batcher``
#   parts: HTTP, validation, JSON both ways, the client itself.
# * ``delay_loaded_s``, ``delay_rate_coef_s``: how much longer that stage is under open-loop traffic
#   from the load generator in another process than for the lone requests: ``delay_loaded_s +
#   delay_rate_coef_s * rate`` more, ``rate`` the requests that arrived in the ``RATE_WINDOW_S``
#   before (the event loop encodes every response and parses every request, on cores the model
#   shares). Measured by the profile's loaded phase (``profile.serving.fit_loaded_delay``); 0: none.
# * ``batch_overhead_s``: what the live driver adds to every batch around the model (the scheduling call,
#   collation, the hand-offs between the event loop and the slot's threads): the median, over lone
#   requests, of the ``batcher`` part minus the slot's own run time for that batch, clipped at 0.
#   ``batch_gap_s + batch_gap_per_input_s * n``: in its place for a batch that starts as the one before
#   it ends (of ``n`` inputs, answered on the event loop first), the turnaround between the two in the
#   profile's loaded phase as a line in ``n`` (``profile.serving.turnaround_line``); 0: none measured.
# * ``loaded_alpha``, ``loaded_rate_coef``, ``loaded_const_s``: a batch under serving load takes
#   ``predicted * (loaded_alpha + loaded_rate_coef * rate) + loaded_const_s``, ``rate`` being the requests
#   that reached the server in the second before it started (``RATE_WINDOW_S``). Measured by the profile
#   with its own open-loop traffic at three rates (``profile/serving.py``): the model runs slower while
#   the server handles requests (their HTTP, JSON and tokenising share its cores) than alone in the
#   profiler's loop. ``loaded_rate_coef / loaded_alpha`` is the CPU seconds a request costs outside the
#   model thread, accounted; ``loaded_alpha`` the speed of the loaded batches against the profile.
# * ``loaded_residuals``, ``loaded_residual_ref_s``: the spread of those batches around that line
#   (``slot / line - 1``, sorted) in the units of a batch of ``loaded_residual_ref_s`` seconds (their
#   median; 0: relative at every length; ``residual_units``). The simulator draws every batch's time
#   from them (seeded), scaled to the batch's length: the served model's variance, not the profiler's.
#   ``loaded_wander``: the part of that spread the batches of the same ``WANDER_WINDOW_S`` share (the
#   machine's speed moving), drawn per window of simulated time (``sim.service``); 0: none.
# * ``loaded_idle_factors``: one factor per bin of the idle time before a batch (``IDLE_EDGES_S``: under
#   2 ms, 2-10 ms, 10-30 ms, 30-100 ms, 100-300 ms, 300 ms or more, the first batch included), by
#   which that batch's loaded term (before ``loaded_const_s``) is multiplied: a batch right behind
#   another finds the model's weights and the CPU warm, one after the server sat idle does not.
#   Measured by the profile on the same loaded batches (``profile.serving.fit_loaded``); none
#   (old profiles): 1 at every idle time.
# * ``loaded_token_factors``: ``(min_tokens, factor)`` steps from 0 at the thread plan's steps
#   (``models/encoder.py``) and every doubling from 32 tokens (``profile.serving.loaded_token_steps``): a
#   batch's loaded term is also multiplied by its step's factor, since a batch on two threads contends
#   with the front end for the second core and one on one thread does not, and a short batch feels the
#   hand-offs and the threads' synchronisation more than a long one.
#   Measured on the same loaded batches (``profile.serving.fit_loaded``); none: 1 at every size.
# * ``loaded_busy_factors``: one factor per bin of the share of the second before a batch in which a
#   batch ran (``sim.busy``: ``BUSY_EDGES``), by which its loaded term is also multiplied: under
#   sustained load a batch runs faster than between short bursts. Measured on the same loaded batches
#   (``profile.serving.fit_loaded``); none: 1 at every share.
# * ``serial_busy_factor``: how much slower the tokenizer is while the model runs a batch (both share
#   the CPU) than on an idle machine, >= 1; under load the model is nearly always busy, so the serial
#   stage's service time is scaled by it.
#
# ``batchpilot profile`` (``profile/serving.py``) is the one source of these numbers: it serves the
# real app in-process, sends requests one at a time (no queueing anywhere), fits the two stages with
# ``FrontEnd.fit`` and writes the result under the profile's ``"frontend"`` key, which
# ``FrontEnd.from_profile`` reads back. ``FrontEnd.fit`` does the fitting part alone (it leaves the two
# driver fields at their defaults).

RATE_WINDOW_S = 1.0  # a batch's request rate: arrivals in this window before it started
FACTOR_FIELDS = ("loaded_residuals", "loaded_idle_factors", "loaded_token_factors", "loaded_busy_factors")


def check_finite_nonneg(what: str, values: dict[str, float]) -> None:
    """Raise ``ValueError`` naming the first of ``values`` that is not a finite number >= 0."""
    for name, value in values.items():
        if not (math.isfinite(value) and value >= 0.0):
            raise ValueError(f"{what}.{name} = {value!r}; must be a finite number >= 0")


@dataclass(frozen=True)
class FrontEnd:
    serial_const_s: float = 0.0
    serial_per_token_s: float = 0.0
    delay_const_s: float = 0.0
    delay_per_token_s: float = 0.0
    batch_overhead_s: float = 0.0
    serial_busy_factor: float = 1.0
    loaded_alpha: float = 1.0
    loaded_rate_coef: float = 0.0
    loaded_const_s: float = 0.0
    loaded_residuals: tuple[float, ...] = ()
    loaded_residual_ref_s: float = 0.0
    serial_servers: int = 1
    loaded_idle_factors: tuple[float, ...] = ()
    loaded_token_factors: tuple[tuple[int, float], ...] = ()
    delay_loaded_s: float = 0.0
    delay_rate_coef_s: float = 0.0
    loaded_busy_factors: tuple[float, ...] = ()
    batch_gap_s: float = 0.0
    loaded_wander: float = 0.0
    batch_gap_per_input_s: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "loaded_residuals", tuple(sorted(float(r) for r in self.loaded_residuals)))
        for name, edges in (("loaded_idle_factors", IDLE_EDGES_S), ("loaded_busy_factors", BUSY_EDGES)):
            factors = tuple(float(f) for f in getattr(self, name))
            object.__setattr__(self, name, factors)
            if factors and (len(factors) != len(edges) + 1
                            or not all(math.isfinite(f) and f > 0 for f in factors)):
                raise ValueError(f"frontend.{name} must be {len(edges) + 1} positive factors (one per bin) "
                                 f"or none, got {factors!r}; a profile from another batchpilot version: "
                                 "run `batchpilot profile` again")
        steps = tuple((int(lo), float(f)) for lo, f in self.loaded_token_factors)
        object.__setattr__(self, "loaded_token_factors", steps)
        if steps and (steps[0][0] != 0 or any(b[0] <= a[0] for a, b in zip(steps, steps[1:], strict=False))
                      or not all(math.isfinite(f) and f > 0 for _, f in steps)):
            raise ValueError("frontend.loaded_token_factors must be (min_tokens, factor) steps ascending "
                             f"from 0 tokens with positive factors, got {steps!r}")
        if any(not math.isfinite(r) or r <= -1.0 for r in self.loaded_residuals):
            raise ValueError("frontend.loaded_residuals must be finite relative errors > -1")
        check_finite_nonneg("frontend", {k: v for k, v in asdict(self).items() if k not in FACTOR_FIELDS})
        if int(self.serial_servers) != self.serial_servers or self.serial_servers < 1:
            raise ValueError(f"frontend.serial_servers = {self.serial_servers!r}; must be an integer >= 1")
        if self.serial_busy_factor < 1.0:
            raise ValueError(f"frontend.serial_busy_factor = {self.serial_busy_factor!r}; must be >= 1 "
                             "(the tokenizer is never faster with the model busy)")

    def batcher_arrivals(self, arrival_s: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        """When each request reaches the batcher, after the serial stage (non-decreasing when the
        arrivals are). Each service time is scaled by ``serial_busy_factor``: under load the tokenizer
        shares the CPU with a running batch."""
        service = (self.serial_busy_factor * (self.serial_const_s + self.serial_per_token_s
                                              * np.asarray(tokens, dtype=float))).tolist()
        out = np.empty(len(service))
        arrivals = np.asarray(arrival_s, dtype=float).tolist()
        if self.serial_servers == 1:
            free = -math.inf
            for i, (a, c) in enumerate(zip(arrivals, service, strict=True)):
                free = (a if a > free else free) + c
                out[i] = free
            return out
        frees = [-math.inf] * int(self.serial_servers)  # a heap of the servers' free times
        for i, (a, c) in enumerate(zip(arrivals, service, strict=True)):
            f = frees[0]
            out[i] = (a if a > f else f) + c
            heapq.heapreplace(frees, out[i])
        return out

    def batch_seconds(self, predicted_s: float, rate: float = 0.0, idle_s: float = 0.0,
                      tokens: float = 0.0, busy: float = 0.0) -> float:
        """A batch's slot time under serving load, from the cost model's prediction for it, the
        request rate (per second, over the ``RATE_WINDOW_S`` before it starts), how long no batch
        ran before it (``idle_s``), the tokens it computes and its busy share (``sim.busy``)."""
        return served_seconds(predicted_s, (self.loaded_alpha, self.loaded_rate_coef, self.loaded_const_s),
                              rate, idle_s, tokens, self.loaded_idle_factors, self.loaded_token_factors,
                              busy, self.loaded_busy_factors)

    def residual_scale(self, line_s: float) -> float:
        """What a drawn ``loaded_residuals`` entry is multiplied by for a batch of ``line_s`` seconds
        (its loaded line): ``sqrt(ref / line)`` for batches longer than the reference, else 1."""
        return residual_scale(line_s, self.loaded_residual_ref_s)

    def serving(self, tokenizer_workers: int) -> FrontEnd:
        """This serving path on a server with ``tokenizer_workers`` tokenizer threads (the deployment's
        ``server.tokenizer_workers``); 0 keeps the profiled server's count."""
        if tokenizer_workers and tokenizer_workers != self.serial_servers:
            return dataclasses.replace(self, serial_servers=int(tokenizer_workers))
        return self

    def delay(self, tokens: np.ndarray, arrival_s: np.ndarray | None = None) -> np.ndarray:
        """Each request's ``delay`` stage; with its arrival times (sorted), under serving load: plus
        ``delay_loaded_s + delay_rate_coef_s * rate``, ``rate`` the requests that arrived in the
        ``RATE_WINDOW_S`` before it, per second (``rates_at``)."""
        out = self.delay_const_s + self.delay_per_token_s * np.asarray(tokens, dtype=float)
        if arrival_s is None:
            return out
        return out + self.delay_loaded_s + self.delay_rate_coef_s * rates_at(arrival_s)

    @classmethod
    def fit(cls, tokens: np.ndarray, client_s: np.ndarray, tokenize_s: np.ndarray,
            batcher_s: np.ndarray) -> FrontEnd:
        """Fit both stages on requests measured one at a time (no queueing anywhere): per request the
        client's latency and the server's ``tokenize`` and ``batcher`` parts. Rows with a NaN are
        skipped; fewer than 3 usable rows is an error (no Server-Timing header: not a batchpilot server)."""
        tokens, client_s, tokenize_s, batcher_s = (np.asarray(x, dtype=float)
                                                   for x in (tokens, client_s, tokenize_s, batcher_s))
        ok = np.isfinite(tokens) & np.isfinite(client_s) & np.isfinite(tokenize_s) & np.isfinite(batcher_s)
        if ok.sum() < 3:
            raise ValueError(f"front-end fit needs >= 3 requests with Server-Timing, got {int(ok.sum())}")
        length = tokens[ok]
        sc, sp = fit_line(length, tokenize_s[ok])
        dc, dp = fit_line(length, client_s[ok] - tokenize_s[ok] - batcher_s[ok])
        return cls(sc, sp, dc, dp)

    def mean_s(self, tokens: np.ndarray) -> float:
        """Mean time outside the batcher with no queueing (serial + delay), for reports."""
        t = np.asarray(tokens, dtype=float)
        return float(np.mean(self.serial_const_s + self.delay_const_s
                             + (self.serial_per_token_s + self.delay_per_token_s) * t)) if t.size else 0.0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for name in ("loaded_residuals", "loaded_idle_factors", "loaded_busy_factors"):
            d[name] = list(d[name])
        d["loaded_token_factors"] = [list(step) for step in self.loaded_token_factors]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> FrontEnd:
        """The inverse of ``to_dict``; fields it lacks keep their defaults."""
        floats = lambda v: tuple(float(x) for x in v)  # noqa: E731
        conv: dict[str, Any] = {"loaded_residuals": floats, "loaded_idle_factors": floats,
                                "loaded_busy_factors": floats,
                                "loaded_token_factors": lambda v: tuple((int(lo), float(f)) for lo, f in v),
                                "serial_servers": int}
        unknown = sorted(set(d) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"the profile's frontend has unknown fields {', '.join(unknown)}: it was "
                             "written by another batchpilot version; run `batchpilot profile` again")
        return cls(**{k: conv.get(k, float)(v) for k, v in d.items()})

    @classmethod
    def from_profile(cls, path: str | Path) -> FrontEnd | None:
        """The ``"frontend"`` entry of a ``batchpilot profile`` JSON, or None when it has none
        (a profile written with ``--no-serving-path``)."""
        doc = json.loads(Path(path).read_text())
        entry = doc.get("frontend") if isinstance(doc, dict) else None
        return None if entry is None else cls.from_dict(entry)


def served_seconds(predicted_s: float, loaded: tuple[float, float, float], rate: float,
                   idle_s: float = 0.0, tokens: float = 0.0, idle_factors: Sequence[float] = (),
                   token_factors: Sequence[tuple[int, float]] = (), busy: float = 0.0,
                   busy_factors: Sequence[float] = ()) -> float:
    """A batch's line under serving load: ``predicted * (alpha + rate_coef * rate) * idle_factor *
    token_factor * busy_factor + const`` for ``loaded = (alpha, rate_coef, const)``, the factors
    looked up for its idle time, tokens and busy share (``FrontEnd.batch_seconds``, the simulator's
    target: the one formula)."""
    alpha, rate_coef, const = loaded
    factor = (idle_factor(idle_factors, idle_s) * step_factor(token_factors, tokens)
              * busy_factor(busy_factors, busy))
    return predicted_s * (alpha + rate_coef * rate) * factor + const


def residual_units(rel: np.ndarray, line_s: np.ndarray, ref_s: float) -> np.ndarray:
    """Relative residuals of batches of ``line_s`` seconds, put in the units of a batch of ``ref_s``:
    ``rel * sqrt(max(line_s, ref_s) / ref_s)``, at least -0.99 (no batch runs in no time).

    A batch's time beyond its line is stalls: the other work on its cores, the host's. They arrive
    over the batch's run, so their count grows with its length and their spread with its square
    root: a batch twice as long varies sqrt(2) times as much in seconds, 1/sqrt(2) times as much
    relative to its length (a live run's batch log shows long batches far steadier relative to their
    price than short ones). The simulator undoes this per batch
    (``residual_scale``); batches shorter than ``ref_s`` keep their relative spread."""
    if ref_s <= 0:
        return rel
    return np.maximum(rel * np.sqrt(np.maximum(line_s, ref_s) / ref_s), -0.99)


def residual_scale(line_s: float, ref_s: float) -> float:
    """``FrontEnd.residual_scale`` for a reference of ``ref_s`` (0: relative residuals, 1)."""
    return math.sqrt(ref_s / line_s) if 0.0 < ref_s < line_s else 1.0


def rates_before(starts: Sequence[float], arrivals: Sequence[float]) -> list[float]:
    """Per batch start, the requests that arrived in the ``RATE_WINDOW_S`` before it, per second: the
    ``rate`` of ``FrontEnd.batch_seconds`` (the simulator keeps the same count incrementally)."""
    times = sorted(arrivals)
    return [(bisect.bisect_left(times, s) - bisect.bisect_left(times, s - RATE_WINDOW_S)) / RATE_WINDOW_S
            for s in starts]


def rates_at(arrival_s: Sequence[float] | np.ndarray) -> np.ndarray:
    """Per request (sorted arrival times), the requests that arrived in the ``RATE_WINDOW_S`` before
    it, per second (itself not counted): the ``rate`` of ``FrontEnd.delay``."""
    a = np.asarray(arrival_s, dtype=float)
    return (np.arange(a.size) - np.searchsorted(a, a - RATE_WINDOW_S, side="left")) / RATE_WINDOW_S


# -- Before a batch --------------------------------------------------------------------------------
# What ran just before a batch: how long no batch ran (its idle time) and how busy the last second was.
#
# Both move a batch's time under serving load off its price, and both are known when it starts, to
# the simulator as to a batch log, so the profile fits a factor per bin of each (``FrontEnd``'s
# ``loaded_idle_factors`` and ``loaded_busy_factors``) and ``served_seconds`` applies them:
#
# * the idle time (``idle_times``, bins ``IDLE_EDGES_S``): a batch right behind another finds the
#   model's weights and the CPU warm, one after the server sat idle does not;
# * the busy share (``BusyWindow``, bins ``BUSY_EDGES``): the share of the last ``BUSY_WINDOW_S`` in
#   which a batch ran. Unpinned on cores the model shares with the rest of the server, a batch after
#   a second of back-to-back batches runs faster than one after a second of sparse short ones, at the
#   same idle time right before it; pinned to one core hardly (``benchmarks/rate_slope.py --by busy``).
#
# The simulator and the batch-log pricing (``bench.fidelity``) compute both with these functions:
# the one definition on both paths.

# upper edges of the bins of the idle time before a batch (no batch running); the last bin is >= 0.3 s
IDLE_EDGES_S = (0.002, 0.01, 0.03, 0.1, 0.3)
BUSY_WINDOW_S = 1.0  # a batch's busy share: the part of this window before it in which a batch ran
# upper edges of the busy-share bins; the last bin is >= 0.4. Two bins: the profile's loaded phase
# holds ~200 batches, and finer bins' factors moved by 10 points between profiles of one machine
BUSY_EDGES = (0.4,)


class BusyWindow:
    """The union of the batches' run spans, pruned to the last ``BUSY_WINDOW_S``.

    ``add(start, end)`` records a batch's span (starts non-decreasing, spans may overlap: several
    slots); ``share(now)`` is the time in ``[now - BUSY_WINDOW_S, now]`` covered by some span, over
    ``BUSY_WINDOW_S``, in [0, 1]. A span still running at ``now`` counts up to ``now``."""

    def __init__(self) -> None:
        self._spans: deque[list[float]] = deque()  # merged [start, end], ascending, disjoint

    def add(self, start: float, end: float) -> None:
        spans = self._spans
        if spans and start <= spans[-1][1]:
            spans[-1][1] = max(spans[-1][1], end)
        else:
            spans.append([start, end])

    def share(self, now: float) -> float:
        lo = now - BUSY_WINDOW_S
        spans = self._spans
        while spans and spans[0][1] <= lo:
            spans.popleft()
        covered = 0.0
        for start, end in spans:
            if start >= now:
                break
            covered += min(end, now) - max(start, lo)
        return min(max(covered / BUSY_WINDOW_S, 0.0), 1.0)


def busy_shares(starts: Sequence[float], slot_s: Sequence[float]) -> list[float]:
    """Per batch (in start order), ``BusyWindow.share`` at its start over the batches before it."""
    window, out = BusyWindow(), []
    for start, took in zip(starts, slot_s, strict=True):
        out.append(window.share(start))
        window.add(start, start + took)
    return out


def busy_factor(factors: Sequence[float], share: float) -> float:
    """The factor of ``factors`` (one per ``BUSY_EDGES`` bin) for a busy share; 1 without factors."""
    return factors[bisect.bisect_right(BUSY_EDGES, share)] if factors else 1.0


def idle_factor(factors: Sequence[float], idle_s: float) -> float:
    """The factor of ``factors`` (one per ``IDLE_EDGES_S`` bin) for a batch after ``idle_s`` seconds
    with no batch running (``inf``: the first); 1 without factors."""
    return factors[bisect.bisect_right(IDLE_EDGES_S, idle_s)] if factors else 1.0


def idle_times(starts: Sequence[float], slot_s: Sequence[float]) -> list[float]:
    """Per batch (in start order), how long no batch ran before it started: ``inf`` for the first."""
    out, busy_until = [], -math.inf
    for start, took in zip(starts, slot_s, strict=True):
        out.append(max(start - busy_until, 0.0))
        busy_until = max(busy_until, start + took)
    return out


# -- Noise -----------------------------------------------------------------------------------------
# How a served batch's time scatters around its line: a spread per batch and a wander of the machine's speed.
#
# The profile's loaded phase (``profile.serving.fit_loaded``) prices every batch it served by the
# loaded line (``sim.service.served_seconds``) and keeps ``slot / line - 1``. That scatter has two parts
# that matter differently to a queue:
#
# * **per batch**: one batch runs a few percent off and the next one does not. Over the dozen batches a
#   burst takes, it averages out;
# * **the wander**: on a shared machine the speed itself moves, and the batches of the same few seconds
#   run slow (or fast) together. A burst that meets a slow second queues longer at every batch of it,
#   which is what sets a bursty workload's P99.
#
# ``split_wander`` separates them on the loaded batches: the spread of the log of the batches' ratio
# between ``WANDER_WINDOW_S`` windows, beyond what the per-batch spread alone gives windows of their
# size, is the wander's (a standard deviation of the log speed, ``FrontEnd.loaded_wander``); every
# batch's residual with its window's mean taken out is the per-batch part (``loaded_residuals``).
# ``BatchNoise`` draws both, seeded: a residual per batch from the profile's list, and a speed factor per
# window of simulated time (log-normal with mean 1), the same for every batch that starts in it.

WANDER_WINDOW_S = 2.0  # the wander is one speed factor per window of this many seconds
MIN_WINDOW_BATCHES = 4  # a window with fewer loaded batches says nothing about its mean: left out
POOL = 4096  # uniforms drawn at once for the per-batch residuals


def split_wander(starts: Sequence[float], rel: Sequence[float],
                 window_s: float = WANDER_WINDOW_S) -> tuple[float, np.ndarray, int]:
    """``(sigma, within, windows)`` for batches starting at ``starts`` with relative residuals ``rel``
    (> -1) around their line: ``sigma`` the standard deviation of the log speed between windows of
    ``window_s`` (windows of at least ``MIN_WINDOW_BATCHES`` batches; their between-window variance less
    what the within-window spread explains for windows of that many batches, at least 0), ``within``
    each residual with its window's mean log ratio taken out (unchanged in a window that is left out),
    ``windows`` how many windows were used. Fewer than 3 usable windows: sigma 0, residuals unchanged."""
    t = np.asarray(starts, dtype=float)
    logs = np.log1p(np.asarray(rel, dtype=float))
    if t.size == 0:
        return 0.0, np.expm1(logs), 0
    cell = np.floor((t - t.min()) / window_s).astype(int)
    means, variances, counts, members = [], [], [], []
    for c in np.unique(cell):
        idx = np.flatnonzero(cell == c)
        if idx.size >= MIN_WINDOW_BATCHES:
            means.append(float(logs[idx].mean()))
            variances.append(float(logs[idx].var(ddof=1)))
            counts.append(idx.size)
            members.append(idx)
    if len(means) < 3:
        return 0.0, np.expm1(logs), len(means)
    m = np.asarray(means)
    between = float(m.var(ddof=1))
    explained = float(np.mean(np.asarray(variances) / np.asarray(counts)))
    sigma = math.sqrt(max(between - explained, 0.0))
    within = logs.copy()
    centre = float(m.mean())
    for mean, idx in zip(means, members, strict=True):
        within[idx] -= mean - centre  # the window's offset from the others, not the overall level
    return sigma, np.expm1(within), len(means)


class BatchNoise:
    """Draws a served batch's time around its line ``mean`` (``draw``), seeded.

    ``residuals``: relative residuals in the units of a batch of ``ref_s`` seconds (0: relative at every
    length; ``sim.service.residual_scale``), one picked per batch; ``wander``: the standard deviation
    of the log speed between ``WANDER_WINDOW_S`` windows of simulated time, one log-normal factor (mean
    1) per window, the same for every batch that starts in it (0: none). The residual picks come from
    their own stream, so a profile without a wander draws exactly what it drew before one existed."""

    def __init__(self, residuals: Sequence[float], ref_s: float = 0.0, wander: float = 0.0,
                 seed: int = 0, window_s: float = WANDER_WINDOW_S) -> None:
        if wander < 0 or not math.isfinite(wander):
            raise ValueError(f"wander must be a finite standard deviation >= 0, got {wander!r}")
        self._residuals = tuple(residuals)
        self._ref_s = ref_s
        self._rng = np.random.default_rng(seed)
        self._u: list[float] = []
        self._wander = wander
        self._window_s = window_s
        self._speed: dict[int, float] = {}
        self._wander_rng = np.random.default_rng((seed, 1)) if wander > 0 else None

    def speed(self, start_s: float) -> float:
        """The wander's factor for a batch starting at ``start_s`` (1 without a wander)."""
        if self._wander_rng is None:
            return 1.0
        k = int(math.floor(start_s / self._window_s))
        f = self._speed.get(k)
        if f is None:
            s = self._wander
            f = self._speed[k] = math.exp(float(self._wander_rng.normal(0.0, s)) - 0.5 * s * s)
        return f

    def draw(self, mean: float, start_s: float = 0.0) -> float:
        """``mean`` times the window's speed factor, times one plus a drawn residual (scaled down for a
        batch longer than ``ref_s``); never below 0."""
        line = mean
        mean *= self.speed(start_s)
        if not self._residuals:
            return mean
        if not self._u:
            self._u = self._rng.random(POOL).tolist()
        res = self._residuals
        r = res[min(int(self._u.pop() * len(res)), len(res) - 1)] * residual_scale(line, self._ref_s)
        return max(mean * (1.0 + r), 0.0)
