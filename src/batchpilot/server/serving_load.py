"""The loaded phase of the serving-path profile: how a batch's time grows while the server handles traffic.

``server.serving_profile.measure_serving_path`` (item 3 of its docstring) serves the real app and,
after its lone requests, replays ``LOADED_REQUESTS`` open-loop from a child process
(``serving_client.send_elsewhere``: on the cores the profiler is not pinned to, when there are any). Here:

* ``loaded_plan``: the seeded open-loop plan, its lengths spread on a log scale (``log_weights``),
  segments taking turns at ``LOADED_SHARES`` (``alternating_arrivals``, which the LLM's loaded phase
  uses too);
* ``thread_cpu_s`` / ``competing_cpu``: the CPU seconds per request that competed with the model
  (every thread of this process but the model's, plus the load generator when it shares the cores);
* ``fit_loaded``: the line ``predicted * alpha * (1 + competing_cpu_s * rate) * size factor * idle
  factor * busy factor + const`` over the batches the server ran, and their spread around it: the
  size factors per step of a batch's computed tokens (``loaded_token_steps``), the idle factors
  per bin of the time no batch ran before it, the busy factors per bin of the share of the second
  before it in which a batch ran (``sim.before_batch``), all three fitted together
  (``line_fit.backfit_factors``).
"""

from __future__ import annotations

import dataclasses
import math
import random
import statistics
from collections.abc import Sequence
from typing import Any

import numpy as np

from batchpilot.bench.loadgen import PlannedRequest
from batchpilot.core.costmodel import BatchShape, CostModel, nonneg_lstsq
from batchpilot.sim.batch_noise import split_wander
from batchpilot.sim.before_batch import BUSY_EDGES, IDLE_EDGES_S, busy_shares, idle_times
from batchpilot.sim.frontend import rates_before, residual_units
from batchpilot.sim.line_fit import backfit_factors, fit_line

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
    in which a batch ran (``sim.before_batch.busy_shares``, a factor per ``BUSY_EDGES`` bin);
    ``const`` the seconds every batch takes beyond that (``per_batch_const``); ``alpha`` makes the
    totals agree. Returns ``(alpha, alpha * competing_cpu_s, const)`` (``FrontEnd``'s loaded line)
    and what was measured, the factors among it (``frontend_fields`` makes ``FrontEnd`` fields of
    both); the residuals around the line are split into the wander of the speed between windows and
    the part of each batch (``sim.batch_noise.split_wander``; ``wander`` False: kept whole)."""
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
    """The loaded line's token steps: 0, the executor's thread plan's steps (``models/threads.py``; none
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
