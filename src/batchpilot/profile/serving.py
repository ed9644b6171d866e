"""Measure the serving path around the batcher on this machine: the ``"frontend"`` part of a profile.

The cost model says what a batch costs the executor; a client sees more. ``measure_serving_path``
serves the real app (``create_app``, the one ``batchpilot serve`` runs) in-process with uvicorn on a
free 127.0.0.1 port, and measures three things the simulator's ``sim.service.FrontEnd`` needs:

1. **The two front-end stages.** Real texts of lengths spread from 4 tokens to the model's limit
   (``models.texts.texts_for_lengths``), each sent ``rounds`` times in a seeded shuffled order, strictly
   one at a time, ``LONE_GAP_S`` apart, from a client process placed as ``bench`` places its load
   generator (``profile.serving.lone_elsewhere``): no queueing anywhere, so each request's
   ``Server-Timing`` split (``tokenize``, ``batcher``) and its client latency are the bare path as a
   live client sees it. ``FrontEnd.fit`` turns them into the serial stage (the tokenizer thread) and
   the delay (HTTP, JSON, the client), after a few unmeasured warm-up requests (``lone_plan``).
2. **The live driver's per-batch overhead.** Each lone request is a batch of one; its ``batcher`` time
   minus its slot's own run time (the batch observer's ``slot_s``: what the cost model stands for) is
   what the driver adds around the model (the scheduling call, collation, the event-loop and thread
   hand-offs); the median, clipped at 0, is ``batch_overhead_s``. Under load, the turnaround from a
   batch's end to the next one's start while requests wait is ``batch_gap_s`` plus
   ``batch_gap_per_input_s`` per input of the batch before (``profile.serving.turnaround_line``, phase
   3). The server runs the deployment ``serve`` resolves from this profile (``scheduler_config``)
   without a batching window (``max_wait_s = 0``): the policy's, which the simulator models itself.
3. **Batches under serving load** (``profile/serving.py``). The model runs slower while the
   server handles traffic than alone in the profiler's loop: the other requests' HTTP, JSON and
   tokenising share its cores, and the machine's speed has moved since the grid. With the server
   still up, a load generator in another process (on the cores this process is not pinned to, when
   there are any, as ``bench`` runs it) sends ``LOADED_REQUESTS`` of the same texts open-loop, in
   segments taking turns at three rates (``LOADED_SHARES``, the last past what one slot serves one
   at a time). The CPU each request costs outside the model thread is accounted and reported
   (``cpu.competing_cpu_s``: this process's threads from ``/proc`` less the model's, plus the load
   generator's while it replays when it shares the cores); it is not a slope of the line, which the
   loaded batches do not show beside the factors (docs/profiler.md). A batch's time under load is
   ``predicted * loaded_alpha``, times a factor per size step
   (``loaded_token_factors``), per idle time before it and per busy share of the second before it
   (``sim.service``), plus ``loaded_const_s`` a batch (``profile.serving.per_batch_const``);
   ``loaded_residuals`` are the spread around that line, less the wander of the machine's speed that
   batches of the same two seconds share (``loaded_wander``, ``sim.service``). How much longer the
   load generator's requests spent outside the batcher than lone ones is the delay stage under load
   (``profile/serving.py``). This traffic is the profile's own, made before any run it predicts.
4. **Tokenizer/model contention.** ``executor.tokenize`` of a fixed list of texts is timed with the
   model idle and while another thread runs model batches back to back (``prepare + run``, as the
   profiler makes them); the ratio of the medians (>= 1) is ``serial_busy_factor``: under load the
   tokenizer thread shares the CPU with a running batch.

Bounded: about 70 s in all for MiniLM on one pinned CPU core (``serving_path.wall_s``; the loaded
phase about 55 s of it, the gaps between the 52 lone requests of the default 24 lengths x 2 rounds +
4 warm-ups 10 s); the server is shut down (drained, thread joined) before it returns. fastapi,
uvicorn and httpx are imported here: the caller imports this module lazily.
"""

from __future__ import annotations

import dataclasses
import math
import random
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from batchpilot.bench.loadgen import LoadGenConfig, PlannedRequest
from batchpilot.core.config import Padding, PolicyConfig, SchedulerConfig
from batchpilot.core.costmodel import BatchShape, CostModel, nonneg_lstsq
from batchpilot.core.deployment import DeploymentSpec, ServingOptions, resolve_deployment
from batchpilot.server.app import ServedModel, create_app
from batchpilot.server.build import model_limits
from batchpilot.server.config import ServerConfig
from batchpilot.server.inproc_server import bound_socket, in_thread
from batchpilot.server.service import tokenizer_workers
from batchpilot.sim.service import (
    BUSY_EDGES,
    IDLE_EDGES_S,
    FrontEnd,
    backfit_factors,
    busy_shares,
    fit_line,
    idle_times,
    rates_at,
    rates_before,
    residual_units,
    split_wander,
)

# The serving path's delay stage under load: ``FrontEnd.delay_loaded_s`` and ``delay_rate_coef_s``.
#
# The profile's lone requests (``lone_plan``, one at a time from a client process) give the
# ``delay`` stage of an idle server: HTTP, validation, JSON both ways, the client. Under open-loop
# traffic it is longer: the event loop parses every arriving request and encodes every response, a
# batch's answers leave one after another, and all of it shares the cores with the model; the load
# generator is another process with many connections open. The loaded phase (``serving_load``) sends
# its traffic from such a process, which reports each answered request (``DelayRow``); here each
# request's delay beyond the lone line (its *excess*) is set against the arrival rate before it.
#
# The fit: per segment of the loaded plan (segments take turns at ``LOADED_SHARES`` of one slot's rate,
# ``alternating_arrivals``), the median excess and the median rate; then ``excess ~ delay_loaded_s +
# delay_rate_coef_s * rate`` through the points of the segments below one slot's one-at-a-time rate
# (share < 1), both >= 0 (``service.fit_line``). Medians, not means: the shift is what moves a
# prediction's P50, and a few requests held up by a pause of the host would pull a mean toward a
# delay most requests never see. Not the segments past one slot's rate: there the model runs without
# a break while the queue grows, and the excess measured in them (0.6-4.8 ms in the profiles of three
# fidelity matrices, ``benchmarks/fidelity.py`` at commits 43f68a3, 566b02d and f5c37f3) is not what
# a server at 50-80% of its predicted capacity sees: fitted through them, the line put the live median
# outside the batcher 0.6-1.1 ms too high on average in each of those matrices (docs/profiler.md, "The
# delay under load").

# per answered request of the loaded phase: (index in the plan, scheduled_s, latency_s,
# server_tokenize_s, server_batcher_s, input_tokens)
DelayRow = tuple[float, float, float, float, float, float]
MIN_ROWS = 20


def fit_loaded_delay(rows: list[DelayRow], frontend: FrontEnd, planned: int, segments: int,
                     shares: Sequence[float] = ()) -> tuple[float, float, dict[str, object]]:
    """``(delay_loaded_s, delay_rate_coef_s, details)`` from the loaded phase's ``rows`` of a plan of
    ``planned`` requests in ``segments`` segments taking turns at ``shares`` of one slot's rate
    (module docstring: the line goes through the segments below 1; all of them without shares, or
    when none is below 1); ``(0, 0, ...)`` with a note when fewer than ``MIN_ROWS`` requests have
    every part measured."""
    arr = np.asarray(rows, dtype=float).reshape(-1, 6)
    arr = arr[np.isfinite(arr).all(axis=1)]
    if len(arr) < MIN_ROWS or planned <= 0 or segments <= 0:
        return 0.0, 0.0, {"requests": int(len(arr)), "note": "too few answered requests: not measured"}
    arr = arr[np.argsort(arr[:, 1], kind="stable")]
    index, scheduled, latency, tokenize, batcher, tokens = arr.T
    excess = latency - tokenize - batcher - frontend.delay(tokens)
    rate = rates_at(scheduled)
    per = max(planned // segments, 1)
    segment = np.minimum(index // per, segments - 1)
    points = [(float(np.median(rate[segment == k])), float(np.median(excess[segment == k])),
               int((segment == k).sum()), shares[k % len(shares)] if shares else 0.0)
              for k in range(segments) if (segment == k).sum() >= 3]
    below = [p for p in points if p[3] < 1.0] or points
    x = np.array([p[0] for p in below])
    y = np.array([p[1] for p in below])
    const, coef = fit_line(x, y, trim=False) if len(below) >= 2 else (max(float(np.median(excess)), 0.0),
                                                                       0.0)
    return const, coef, {
        "requests": int(len(arr)), "median_excess_s": float(np.median(excess)),
        "mean_excess_s": float(np.mean(excess)),
        "segments": [{"rate": p[0], "median_excess_s": p[1], "requests": p[2], "share": p[3],
                      "fitted": p in below} for p in points],
        "const_s": const, "rate_coef_s": coef}


# The loaded phase of the serving-path profile: how a batch's time grows while the server handles traffic.
#
# ``profile.serving.measure_serving_path`` (item 3 of its docstring) serves the real app and,
# after its lone requests, replays ``LOADED_REQUESTS`` open-loop from a child process
# (``profile.serving.send_elsewhere``: on the cores the profiler is not pinned to, when there are any). Here:
#
# * ``loaded_plan``: the seeded open-loop plan, its lengths spread on a log scale (``log_weights``),
#   segments taking turns at ``LOADED_SHARES`` (``alternating_arrivals``, which the LLM's loaded phase
#   uses too);
# * ``thread_cpu_s`` / ``competing_cpu``: the CPU seconds per request that competed with the model
#   (every thread of this process but the model's, plus the load generator when it shares the cores);
# * ``fit_loaded``: the line ``predicted * alpha * (1 + competing_cpu_s * rate) * size factor * idle
#   factor * busy factor + const`` over the batches the server ran, and their spread around it: the
#   size factors per step of a batch's computed tokens (``loaded_token_steps``), the idle factors
#   per bin of the time no batch ran before it, the busy factors per bin of the share of the second
#   before it in which a batch ran (``sim.service``), all three fitted together
#   (``service.backfit_factors``).

# ~40-60 s of traffic for MiniLM on one CPU core: the phase is the profile's look at the machine's speed
# under load, and on a shared VM that speed wanders by a few percent over seconds (docs/profiler.md)
LOADED_REQUESTS = 1080
# of one slot's one-at-a-time rate: three loads, to see how the rate slows a batch, the last past what
# one slot serves alone, where a batching server's capacity (the rate its predictions are used at) lies
LOADED_SHARES = (0.3, 0.75, 1.25)
LOADED_SEGMENTS = 12  # the loaded traffic takes turns at the shares in this many segments
IDLE_PRIOR_BATCHES = 10.0  # an idle bin's factor weighs this many batches at 1 beside its own
# computed tokens per batch at which the loaded line's token factors change, beside the thread plan's
# steps: under load a batch's time over its lone price depends on its size (the hand-offs and the
# threads' synchronisation weigh most on short multi-threaded batches), not only on its thread count
LOADED_TOKEN_EDGES = (32, 64, 128, 256, 512, 1024)


def one_input(length: int, padding: str) -> BatchShape:
    return BatchShape.ragged([length]) if padding == "none" else BatchShape.padded([length], length)


@dataclasses.dataclass
class Loaded:
    """One batch the server ran: its features, slot seconds, start and its requests' arrivals."""

    features: dict[str, float]
    slot_s: float
    start: float
    arrivals: list[float]


def loaded_plan(texts: list[str], lengths: list[int], cost_model: CostModel, padding: str,
                seed: int, n: int) -> list[PlannedRequest]:
    """``n`` of the texts, seeded, picked with ``log_weights`` (the same share of requests in every
    doubling of length, so every ``LOADED_TOKEN_EDGES`` bin sees batches), at ``alternating_arrivals``
    taking turns at the ``LOADED_SHARES`` of the rate at which one slot serves them alone (the cost
    model's mean lone latency)."""
    if n <= 0:
        return []
    rng = random.Random(seed + 7)
    pick = rng.choices(range(len(texts)), weights=log_weights(lengths), k=n)
    alone = max(statistics.mean(cost_model.latency(one_input(lengths[i], padding)) for i in pick), 1e-4)
    times = alternating_arrivals(n, tuple(alone / share for share in LOADED_SHARES), rng)
    return [PlannedRequest(k, t, lengths[i], 0, {"input": texts[i]})
            for k, (t, i) in enumerate(zip(times, pick, strict=True))]


def log_weights(lengths: Sequence[int]) -> list[float]:
    """Per length, the log-width of the lengths nearer to it than to its neighbours (cut at their
    geometric means, within the shortest and the longest): picked with these weights, lengths spread
    evenly on a log scale."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    xs = [max(float(lengths[i]), 1.0) for i in order]
    cuts = [xs[0], *(math.sqrt(a * b) for a, b in zip(xs, xs[1:], strict=False)), xs[-1]]
    out = [0.0] * len(lengths)
    for k, i in enumerate(order):
        out[i] = max(math.log(cuts[k + 1] / cuts[k]), 1e-3)  # one length alone, or two equal: still picked
    return out


def alternating_arrivals(n: int, mean_gaps_s: Sequence[float], rng: random.Random,
                         segments: int = LOADED_SEGMENTS, pause_s: float = 1.0) -> list[float]:
    """Poisson arrival times of ``n`` requests in ``segments`` segments of equal count that take turns
    at the mean gaps (segment ``k`` at ``mean_gaps_s[k % len(mean_gaps_s)]``), ``pause_s`` between
    segments.

    Taking turns, not one part at each rate after the other: this CPU's speed drifts within seconds,
    and a drift between the parts would read as a slope of the time against the rate."""
    per = max(n // segments, 1)
    t, out, last = 0.0, [], 0
    for k in range(n):
        segment = min(k // per, segments - 1)
        gap = mean_gaps_s[segment % len(mean_gaps_s)]
        t += rng.expovariate(1.0 / gap) + (pause_s if segment != last else 0.0)
        last = segment
        out.append(t)
    return out


def fit_loaded(batches: list[Loaded], cost_model: CostModel, competing_cpu_s: float = 0.0,
               token_steps: Sequence[int] = (0,),
               wander: bool = True) -> tuple[tuple[float, float, float], dict[str, Any]]:
    """``slot_s ~ predicted * alpha * (1 + competing_cpu_s * rate) * step_factor(tokens) *
    idle_factor(idle) * busy_factor(busy) + const`` over the loaded batches: ``rate`` the requests that
    arrived in the ``RATE_WINDOW_S`` before the batch started, per second; ``tokens`` the batch's
    computed tokens, binned at ``token_steps`` (``loaded_token_steps``); ``idle`` the time no batch
    ran before it (binned at ``IDLE_EDGES_S``); ``busy`` the share of the second before it
    in which a batch ran (``sim.service.busy_shares``, a factor per ``BUSY_EDGES`` bin);
    ``const`` the seconds every batch takes beyond that (``per_batch_const``); ``alpha`` makes the
    totals agree. Returns ``(alpha, alpha * competing_cpu_s, const)`` (``FrontEnd``'s loaded line)
    and what was measured, the factors among it (``frontend_fields`` makes ``FrontEnd`` fields of
    both); the residuals around the line are split into the wander of the speed between windows and
    the part of each batch (``sim.service.split_wander``; ``wander`` False: kept whole)."""
    if len(batches) < 10:
        return (1.0, 0.0, 0.0), {"batches": len(batches), "note": "too few batches: not measured"}
    batches = sorted(batches, key=lambda b: b.start)
    rate = np.array(rates_before([b.start for b in batches], [a for b in batches for a in b.arrivals]))
    pred = np.array([cost_model.latency(b.features) for b in batches])
    took = np.array([b.slot_s for b in batches])
    starts = [b.start for b in batches]
    idle = np.array(idle_times(starts, took.tolist()))
    base = pred * (1.0 + competing_cpu_s * rate)
    const = per_batch_const(base, took)
    took_var = np.maximum(took - const, 1e-6)  # the part that scales with the batch
    tokens = np.array([b.features.get("tokens", 0.0) for b in batches])
    sets = [(np.searchsorted(np.asarray(IDLE_EDGES_S), idle, side="right"), len(IDLE_EDGES_S) + 1),
            (np.searchsorted(np.asarray(BUSY_EDGES), busy_shares(starts, took.tolist()), side="right"),
             len(BUSY_EDGES) + 1)]
    if len(token_steps) > 1:
        sets.append((np.searchsorted(np.asarray(token_steps[1:]), tokens, side="right"), len(token_steps)))
    fitted = [((), [])] * 3
    if base.sum() > 0 and took_var.sum() > 0:
        fitted = backfit_factors(sets, took_var, base, IDLE_PRIOR_BATCHES)
        for (index, _), (factors, _) in zip(sets, fitted, strict=False):
            base = base * np.asarray(factors)[index]
    (idle_f, idle_n), (busy_f, busy_n) = fitted[:2]
    token_f, token_n = fitted[2] if len(fitted) > 2 else ((), [len(batches)])
    by_tokens = tuple((int(lo), f) for lo, f in zip(token_steps, token_f, strict=False))
    alpha = float(took_var.sum() / base.sum()) if base.sum() > 0 else 1.0
    # for comparison only: the slope a least-squares fit of ``predicted * (a + b * rate)`` would give
    w = 1.0 / np.maximum(took, 1e-6)
    a, b = nonneg_lstsq(np.column_stack([pred, pred * rate]) * w[:, None], took * w)
    fitted_s = float(b / a) if a > 0 else math.nan
    line = alpha * base + const
    ref_s = float(np.median(line))
    rel = took / line - 1.0
    sigma, within, windows = split_wander(starts, rel) if wander else (0.0, rel, 0)
    residuals = residual_units(within, line, ref_s)
    return (alpha, alpha * competing_cpu_s, const), {
        "batches": len(batches),
        "mean_batch_size": float(np.mean([b.features.get("n", 1.0) for b in batches])),
        "rate_min": float(rate.min()), "rate_max": float(rate.max()), "rate_mean": float(rate.mean()),
        "slot_over_predicted": float(took.sum() / pred.sum()), "alpha": alpha,
        "competing_cpu_s": competing_cpu_s, "rate_coef": alpha * competing_cpu_s, "const_s": const,
        "least_squares_s_per_request": fitted_s, "idle_factors": list(idle_f), "idle_batches": idle_n,
        "token_factors": [list(step) for step in by_tokens], "token_batches": token_n,
        "busy_factors": list(busy_f), "busy_batches": busy_n,
        "residuals": sorted(float(r) for r in residuals), "residual_std": float(residuals.std()),
        "residual_ref_s": ref_s, "wander": sigma, "wander_windows": windows,
        "turnaround_s": turnaround(batches), "turnaround_line": list(turnaround_line(batches)),
        "measured": [{"start": b.start, "slot_s": b.slot_s, "features": b.features, "arrivals": b.arrivals}
                     for b in batches]}


def frontend_fields(loaded: tuple[float, float, float], details: dict[str, Any]) -> dict[str, Any]:
    """``FrontEnd``'s ``loaded_*`` fields from ``fit_loaded``'s result; takes the residuals out of
    ``details`` (they are written once, in the front end)."""
    alpha, rate_coef, const = loaded
    return {"loaded_alpha": alpha, "loaded_rate_coef": rate_coef, "loaded_const_s": const,
            "loaded_residuals": tuple(details.pop("residuals", ())),
            "loaded_residual_ref_s": details.pop("residual_ref_s", 0.0),
            "loaded_idle_factors": tuple(details.get("idle_factors", ())),
            "loaded_busy_factors": tuple(details.get("busy_factors", ())),
            "loaded_token_factors": tuple(tuple(x) for x in details.get("token_factors", ())),
            "batch_gap_s": details.get("turnaround_line", (details.get("turnaround_s", 0.0),))[0],
            "batch_gap_per_input_s": details.get("turnaround_line", (0.0, 0.0))[1],
            "loaded_wander": details.get("wander", 0.0)}


def turnaround_gaps(batches: Sequence[Loaded], window_s: float = 0.0) -> list[tuple[float, float]]:
    """``(inputs of the batch before, gap)`` for every batch whose first request arrived more than
    ``window_s`` (the batching window) before the batch before it ended: the gap from that end to its
    start, where nothing but the driver stood between the two. In start order."""
    ordered = sorted(batches, key=lambda b: b.start)
    return [(a.features.get("n", 1.0), b.start - (a.start + a.slot_s))
            for a, b in zip(ordered, ordered[1:], strict=False)
            if b.arrivals and min(b.arrivals) < a.start + a.slot_s - window_s]


def turnaround(batches: Sequence[Loaded], min_gaps: int = 10, window_s: float = 0.0) -> float:
    """The mean of ``turnaround_gaps``: the slot's turnaround under load (the scheduling call, the
    hand-offs, and the event loop's other work before it gets to the queue); at least 0, and 0 with
    fewer than ``min_gaps`` of them."""
    gaps = [g for _, g in turnaround_gaps(batches, window_s)]
    return max(float(np.mean(gaps)), 0.0) if len(gaps) >= min_gaps else 0.0


def turnaround_line(batches: Sequence[Loaded], min_gaps: int = 10,
                    window_s: float = 0.0) -> tuple[float, float]:
    """``(const_s, per_input_s)``: ``turnaround_gaps`` as a line in the inputs of the batch before,
    least squares with both at least 0 (``fit_line``, not trimmed: the line keeps the gaps' mean at
    their mean size; a slope of 0 is ``turnaround``). The batch that ended is answered on the event
    loop, one handler per input (its response encoded and written), on the cores the slot's thread
    shares: the bigger it was, the later the next run begins. (0, 0) with fewer than ``min_gaps``."""
    pairs = turnaround_gaps(batches, window_s)
    if len(pairs) < min_gaps:
        return 0.0, 0.0
    sizes, gaps = np.asarray([n for n, _ in pairs]), np.maximum(np.asarray([g for _, g in pairs]), 0.0)
    return fit_line(sizes, gaps, trim=False)


def per_batch_const(base: np.ndarray, took: np.ndarray) -> float:
    """The seconds every batch takes beyond its share of ``base`` (``took ~ a * base + const``, least
    squares on relative errors, both >= 0): the driver's fixed cost per batch under load (the
    hand-offs to and from the slot's thread while the event loop serves other requests), which a
    batch of one short input feels most and a long batch hardly at all. None (0) unless the batches'
    prices span at least a factor of 2: among batches of one price a constant and a speed are one;
    at most half the median batch's time."""
    if len(took) < 10 or base.min() <= 0 or base.max() < 2.0 * base.min():
        return 0.0
    w = 1.0 / np.maximum(took, 1e-6)
    _, const = nonneg_lstsq(np.column_stack([base, np.ones_like(base)]) * w[:, None], took * w)
    return float(min(const, 0.5 * float(np.median(took))))


def loaded_token_steps(executor: Any) -> list[int]:
    """The loaded line's token steps: 0, the executor's thread plan's steps (``models/encoder.py``; none
    without a plan) and ``LOADED_TOKEN_EDGES``."""
    plan = getattr(executor, "threads", None)
    return sorted({0, *(int(lo) for lo, _ in (plan.steps if plan is not None else ())), *LOADED_TOKEN_EDGES})


def thread_cpu_s(pid: int | str = "self") -> dict[int, float]:
    """CPU seconds (user + system) of each thread of process ``pid`` (default this one); empty where
    ``/proc`` is not."""
    import os

    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    out: dict[int, float] = {}
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            out[int(tid)] = (int(fields[11]) + int(fields[12])) / tick  # utime, stime (fields 14, 15)
    except OSError:
        return {}
    return out


def competing_cpu(before: dict[int, float], after: dict[int, float], child_cpu_s: float,
                  child_shares_cores: bool, requests: int,
                  model_threads: int = 1) -> tuple[float, dict[str, Any]]:
    """CPU seconds per request that competed with the model: every thread's but the ``model_threads``
    busiest ones' (the model's: the thread that runs it and torch's intra-op workers) between
    ``before`` and ``after``, plus the load generator's ``child_cpu_s`` when it ran on this process's
    cores."""
    deltas = sorted((after[t] - before.get(t, 0.0) for t in after), reverse=True)
    if not deltas or requests <= 0:
        return 0.0, {"note": "no per-thread CPU times (no /proc): competing CPU not measured"}
    k = max(int(model_threads), 1)
    model, others = float(sum(deltas[:k])), float(sum(deltas[k:]))
    total = others + (child_cpu_s if child_shares_cores else 0.0)
    return total / requests, {"model_threads": k, "model_threads_cpu_s": model, "other_threads_cpu_s": others,
                              "load_generator_cpu_s": child_cpu_s,
                              "load_generator_shares_cores": child_shares_cores, "requests": requests}


# The serving-path profile's client: a process of its own, placed where ``bench`` places its load generator.
#
# A client inside the profiler's process shares its cores and its interpreter with the server it
# measures, and never waits on another core; the live load generator (``bench``, ``bench fidelity``) is
# another process on the cores the server is not pinned to, and between two requests both sides sleep.
# What a request costs outside the batcher depends on both. So the profile sends its traffic from a
# child process (``multiprocessing`` spawn) on ``other_cores`` (all cores when this process is pinned to
# none), and reports back what it saw:
#
# * ``send_elsewhere``: a plan replayed open-loop at its times (the loaded phase); returns the child's
#   CPU seconds, whether it shared this process's cores, and per answered request a
#   ``profile.serving.DelayRow`` tuple;
# * ``lone_elsewhere``: a plan sent strictly one request at a time with ``gap_s`` of silence between
#   two (the lone requests of ``measure_serving_path``: each one alone in the server, none queued); returns
#   every request's ``RequestRecord``.
#
# A child that dies before it reports is a ``RuntimeError`` that says so.

LONE_GAP_S = 0.2  # silence between two lone requests: both sides sleep, as between a live server's requests
CHILD_TIMEOUT_S = 600.0  # the most a child's traffic may take before the profile gives up on it


def send_elsewhere(url: str, model: str, plan: Sequence[PlannedRequest],
                   endpoint: str = "embeddings") -> tuple[float, bool, list[Any]]:
    """Replay ``plan`` open-loop from a child process on the cores this one is not pinned to (if any).
    Returns the child's CPU seconds while it replayed (its start-up, before the first request, is
    not traffic), whether it ran on this process's cores, and per answered request ``(index,
    scheduled_s, latency_s, server_tokenize_s, server_batcher_s, input_tokens)``
    (``profile.serving.DelayRow``)."""
    cpu, rows = _run_child(url, model, plan, endpoint, None)
    return float(cpu), other_cores() is None, rows


def lone_elsewhere(url: str, model: str, plan: Sequence[PlannedRequest], gap_s: float,
                   endpoint: str = "embeddings") -> list[Any]:
    """Send ``plan`` one request at a time, ``gap_s`` seconds apart (from one answer to the next
    request), from a child process placed as ``send_elsewhere``'s; every request's ``RequestRecord``
    in plan order."""
    if not gap_s >= 0:
        raise ValueError(f"serving path: the gap between lone requests must be >= 0 s, got {gap_s}")
    return list(_run_child(url, model, plan, endpoint, float(gap_s))[1])


def _run_child(url: str, model: str, plan: Sequence[PlannedRequest], endpoint: str,
               gap_s: float | None) -> tuple[float, list[Any]]:
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    receive, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=replay_child, args=(url, model, list(plan), endpoint, send, gap_s),
                        daemon=True)
    child.start()
    send.close()
    try:
        cpu, rows = receive.recv() if receive.poll(CHILD_TIMEOUT_S) else (math.nan, [])
    except EOFError:  # the child ended without reporting: it failed
        cpu, rows = math.nan, []
    child.join(60)
    if child.exitcode != 0 or (gap_s is None and not math.isfinite(cpu)):
        raise RuntimeError(f"serving path: the load generator process exited with {child.exitcode}")
    return cpu, rows


def other_cores() -> set[int] | None:
    """The cores this process is not pinned to, where the load generator runs; None when it is
    pinned to none of them (it then shares this process's cores)."""
    import os

    if not hasattr(os, "sched_getaffinity"):
        return None
    mine, every = os.sched_getaffinity(0), set(range(os.cpu_count() or 1))
    rest = every - mine
    return rest if rest and len(mine) < len(every) else None


def replay_child(url: str, model: str, plan: list[PlannedRequest], endpoint: str = "embeddings",
                 report: Any = None, gap_s: float | None = None) -> None:
    """The client process: on ``other_cores`` when there are any; ``gap_s`` None: ``replay`` open-loop
    and send the CPU seconds the replay took (all its threads) and its answered requests' rows;
    else one request at a time ``gap_s`` apart and send ``(nan, records)``. Sent to ``report`` (a
    pipe's end), if given."""
    import asyncio
    import os
    import time

    from batchpilot.bench.loadgen import one_by_one_async, replay
    from batchpilot.bench.serverproc import client_keepalive_s  # the in-process server keeps ServerConfig's

    rest = other_cores()
    if rest is not None:
        os.sched_setaffinity(0, rest)
    config = LoadGenConfig(url, endpoint, model=model, timeout_s=120.0,  # type: ignore[arg-type]
                           progress=False, scrape_interval_s=0, keepalive_s=client_keepalive_s())
    out: tuple[float, list[Any]]
    if gap_s is not None:
        out = (math.nan, asyncio.run(one_by_one_async(plan, config, gap_s=gap_s)))
    else:
        cpu0 = time.process_time()
        result = replay(plan, config)
        out = (time.process_time() - cpu0,
               [(float(r.index), r.scheduled_s, r.latency_s, r.server_tokenize_s, r.server_batcher_s,
                 float(r.input_tokens)) for r in result.records if r.ok and not r.warmup])
    if report is not None:
        report.send(out)
        report.close()


WARMUP_REQUESTS = 4
IDLE_S, BUSY_S, CYCLES = 0.25, 0.5, 4  # contention timing: idle, busy, idle, busy, ... idle
CONTENTION_BATCH = (4, 128)  # the background thread's batch: 4 inputs of about 128 tokens


def measure_serving_path(executor: Any, cost_model: CostModel, *, requests: int = 24, rounds: int = 2,
                         seed: int = 0, texts_for_length: Callable[[list[int]], list[str]] | None = None,
                         padding: str | None = None,
                         loaded_requests: int = LOADED_REQUESTS) -> tuple[FrontEnd, dict[str, Any]]:
    """Serve ``executor`` in-process and measure its serving path (module docstring): ``requests``
    lengths from 4 tokens to ``executor.max_length``, each sent ``rounds`` times. ``texts_for_length``
    maps token lengths to texts of exactly those lengths (default: ``models.texts.texts_for_lengths``
    with the executor's tokenizer). ``padding`` is what the server would run ("none" or "dynamic";
    default "none", "dynamic" for an executor without a padding-free path, as ``serve`` does).
    Returns the fitted ``FrontEnd`` and a JSON-ready dict of what was measured."""
    if requests < 3 or rounds < 1:
        raise ValueError(f"serving path: requests must be >= 3 and rounds >= 1, got {requests}, {rounds}")
    t_start = time.perf_counter()
    padding = _serving_padding(executor, padding)
    texts, lengths, plan = lone_plan(executor, requests, rounds, seed, texts_for_length)
    warm = sum(p.warmup for p in plan)

    sched = scheduler_config(executor, padding, cost_model)
    traffic = loaded_plan(texts, lengths, cost_model, padding, seed, loaded_requests)
    records, slot_s, batches, (competing_s, cpu_details), loaded_rows = _serve_and_send(
        executor, sched, cost_model, plan, traffic)
    if len(slot_s) != len(records):
        raise RuntimeError(f"serving path: {len(records)} lone requests ran as {len(slot_s)} batches")
    slot_of = {id(r): took for r, took in zip(records, slot_s, strict=True)}
    measured = [r for r in records if not r.warmup]
    ok = [r for r in measured if r.ok]
    if len(ok) < 3:
        errors = sorted({r.error for r in measured if r.error})[:3]
        raise RuntimeError(f"serving path: {len(ok)} of {len(measured)} requests answered "
                           f"({'; '.join(errors) or 'no Server-Timing header'})")
    tok = np.array([r.input_tokens for r in ok], dtype=float)
    client = np.array([r.latency_s for r in ok])
    tokenize = np.array([r.server_tokenize_s for r in ok])
    batcher = np.array([r.server_batcher_s for r in ok])
    fitted = FrontEnd.fit(tok, client, tokenize, batcher)
    predicted = np.array([cost_model.latency(one_input(int(n), padding)) for n in tok])
    slots = np.array([slot_of[id(r)] for r in ok])
    overhead = batcher - slots
    finite = overhead[np.isfinite(overhead)]
    overhead_s = max(float(np.median(finite)), 0.0) if finite.size else 0.0

    idle, busy = _contention(executor, texts, lengths, padding)
    idle_s, busy_s = statistics.median(idle), statistics.median(busy)
    factor = max(busy_s / idle_s, 1.0) if idle_s > 0 else 1.0
    loaded, load_details = fit_loaded(batches, cost_model, 0.0, loaded_token_steps(executor))  # no slope
    load_details["cpu"] = {**cpu_details, "competing_cpu_s": competing_s}
    delay_const, delay_coef, delay_details = fit_loaded_delay(loaded_rows, fitted, len(traffic),
                                                              LOADED_SEGMENTS, LOADED_SHARES)
    frontend = dataclasses.replace(fitted, batch_overhead_s=overhead_s, serial_busy_factor=factor,
                                   serial_servers=tokenizer_workers(ServerConfig()),
                                   delay_loaded_s=delay_const, delay_rate_coef_s=delay_coef,
                                   **frontend_fields(loaded, load_details))
    details = {
        "requests": len(measured), "ok": len(ok), "warmup_requests": warm, "lengths": len(texts),
        "min_tokens": min(lengths), "max_tokens": max(lengths), "rounds": rounds, "padding": padding,
        "policy": {"name": sched.policy.name, "max_wait_s": sched.policy.max_wait_s},
        "median_client_s": _median(client), "median_tokenize_s": _median(tokenize),
        "median_batcher_s": _median(batcher), "median_slot_s": _median(slots),
        "median_predicted_s": _median(predicted),
        "median_overhead_s": _median(overhead),
        "tokenize_texts": len(texts), "tokenize_idle_s": idle_s,
        "tokenize_busy_s": busy_s, "tokenize_idle_samples": len(idle),
        "tokenize_busy_samples": len(busy), "fit": fitted.to_dict(), "loaded": load_details,
        "loaded_delay": delay_details,
        "wall_s": round(time.perf_counter() - t_start, 2),
    }
    return frontend, details


def _serving_padding(executor: Any, padding: str | None) -> Padding:
    if padding not in (None, "none", "dynamic"):
        raise ValueError(f"serving path: padding must be 'none' or 'dynamic', got {padding!r}")
    if padding == "dynamic":
        return "dynamic"
    supported = getattr(executor, "supports_padding_free", lambda: True)()
    return "none" if supported else "dynamic"


def lone_plan(executor: Any, requests: int = 24, rounds: int = 2, seed: int = 0,
              texts_for_length: Callable[[list[int]], list[str]] | None = None,
              ) -> tuple[list[str], list[int], list[PlannedRequest]]:
    """The lone requests (item 1 of the module docstring): one text per length of ``requests`` spread
    from 4 tokens to the model's limit, each ``rounds`` times in a seeded shuffled order, after
    ``WARMUP_REQUESTS`` unmeasured ones. Returns the texts, their token counts as the server counts
    them, and the plan."""
    top = int(executor.max_length)
    wanted = sorted({int(round(x)) for x in np.linspace(min(4, top), top, requests)})
    if texts_for_length is None:
        from batchpilot.models.texts import texts_for_lengths

        texts = texts_for_lengths(executor.tokenizer, wanted, seed=seed)
    else:
        texts = list(texts_for_length(wanted))
    lengths = [len(ids) for ids in executor.tokenize(texts)]  # what the server will count
    order = [i for i in range(len(texts)) for _ in range(rounds)]
    random.Random(seed).shuffle(order)
    warm = [len(texts) - 1, 0, len(texts) // 2, len(texts) - 1][:WARMUP_REQUESTS]
    plan = [PlannedRequest(k, 0.0, lengths[i], 0, {"input": texts[i]}, warmup=k < len(warm))
            for k, i in enumerate(warm + order)]
    return texts, lengths, plan


def scheduler_config(executor: Any, padding: Padding, cost_model: CostModel) -> SchedulerConfig:
    """The deployment ``serve`` resolves from this profile by default (``core.deployment``: lengths
    clamped to the model's, pipelining as the grid's collation share decides), with this padding and
    no batching window (a lone request dispatches at once: the window is the policy's, and the
    simulator models it). The loaded phase measures batches as the server will run them."""
    base = SchedulerConfig()
    cfg = dataclasses.replace(base, policy=PolicyConfig(max_wait_s=0.0),
                              planner=dataclasses.replace(base.planner, padding=padding))
    return resolve_deployment(DeploymentSpec(encoder=cfg), cost_model, model_limits(executor)).scheduler


def _serve_and_send(executor: Any, sched: SchedulerConfig, cost_model: CostModel,
                    plan: Sequence[PlannedRequest], loaded_plan: Sequence[PlannedRequest] = (),
                    ) -> tuple[list[Any], list[float], list[Loaded], tuple[float, dict[str, Any]], list[Any]]:
    """Start uvicorn on a socket bound here (no port race), send ``plan`` one by one, then
    ``loaded_plan`` open-loop, both from another process, shut down. Also returns each lone batch's slot
    seconds in the order they ran, each loaded batch's (features, slot seconds), the CPU seconds
    per loaded request that competed with the model (``competing_cpu``) and the loaded requests'
    rows (``profile.serving.DelayRow``)."""
    sock, port = bound_socket()
    app = create_app(ServerConfig(port=port, drain_timeout_s=5.0,
                                  serving=ServingOptions(request_timeout_s=30.0)),
                     [ServedModel(executor, sched, cost_model)])
    seen: list[Loaded] = []
    app.state.service.batcher.batch_observers.append(
        lambda batch, start, took: seen.append(Loaded({**batch.shape.features(), "n": float(batch.size)},
                                                      took, start, [r.arrival for r in batch.requests])))
    with in_thread(app, sock, "batchpilot-serving-profile") as url:
        config = LoadGenConfig(url, model=app.state.service.model_name, timeout_s=30.0, progress=False,
                               scrape_interval_s=0)
        records = lone_elsewhere(config.base_url, config.model or "", plan, LONE_GAP_S)
        lone = len(seen)
        cpu: tuple[float, dict[str, Any]] = (0.0, {"note": "no loaded phase"})
        rows: list[Any] = []
        if loaded_plan:
            before = thread_cpu_s()
            child_s, shares, rows = send_elsewhere(config.base_url, config.model or "", loaded_plan)
            time.sleep(0.5)  # the last batches report on the loop
            cpu = competing_cpu(before, thread_cpu_s(), child_s, shares, len(loaded_plan),
                                model_threads(executor))
    return records, [b.slot_s for b in seen[:lone]], seen[lone:], cpu, rows


def model_threads(executor: Any) -> int:
    """Threads that run the model's forward: the most its thread plan uses, else its pool's size."""
    plan = getattr(executor, "threads", None)
    return int(plan.max_threads if plan is not None else getattr(executor, "num_threads", 1) or 1)


def _contention(executor: Any, texts: list[str], lengths: list[int],
                padding: str) -> tuple[list[float], list[float]]:
    """Seconds per ``executor.tokenize(texts)`` call with the model idle and while a thread runs
    ``prepare + run`` of one batch back to back (``CONTENTION_BATCH`` copies of the text nearest its
    length, batched with ``make_batch`` as the profiler does), in ``CYCLES`` alternations so that a
    neighbour's load or a drift of the CPU's speed falls on both sides alike."""
    from batchpilot.models.encoder import make_batch

    n, length = CONTENTION_BATCH
    nearest = min(range(len(texts)), key=lambda i: abs(lengths[i] - length))
    ids = executor.tokenize([texts[nearest]])[0]
    batch = make_batch([list(ids)] * n, padding, int(executor.max_length))
    executor.run(executor.prepare(batch))  # this shape's first call allocates
    busy_flag, stop = threading.Event(), threading.Event()

    def model_loop() -> None:
        while not stop.is_set():
            if busy_flag.wait(0.01):
                executor.run(executor.prepare(batch))

    def call() -> Any:
        return executor.tokenize(texts)

    idle: list[float] = []
    busy: list[float] = []
    worker = threading.Thread(target=model_loop, name="batchpilot-contention", daemon=True)
    worker.start()
    try:
        for _ in range(CYCLES):
            idle += _time_calls(call, IDLE_S)
            busy_flag.set()
            time.sleep(0.02)  # the first batch is under way
            busy += _time_calls(call, BUSY_S)
            busy_flag.clear()
            time.sleep(0.1)  # the batch in flight ends (a few of them at most: MiniLM 4 x 128 ~ 50 ms)
        idle += _time_calls(call, IDLE_S)
    finally:
        stop.set()
        busy_flag.set()
        worker.join(30)
    return idle, busy


def _time_calls(call: Callable[[], Any], seconds: float, min_calls: int = 5,
                max_calls: int = 2000) -> list[float]:
    """Time ``call`` repeatedly for about ``seconds`` (at least ``min_calls``, at most ``max_calls``)."""
    out: list[float] = []
    end = time.perf_counter() + seconds
    while len(out) < max_calls and (len(out) < min_calls or time.perf_counter() < end):
        t0 = time.perf_counter()
        call()
        out.append(time.perf_counter() - t0)
    return out


def _median(x: np.ndarray) -> float:
    finite = x[np.isfinite(x)]
    return float(np.median(finite)) if finite.size else float("nan")
