"""Measure the serving path around the batcher on this machine: the ``"service"`` part of a profile.

The cost model says what a batch costs the executor; a client sees more. ``measure_serving_path``
serves the real app (``create_app``, the one ``batchpilot serve`` runs) in-process with uvicorn on a
free 127.0.0.1 port, and measures what the simulator's ``sim.service.ServiceModel`` needs:

1. **What a request costs outside the batcher.** Real texts of lengths spread from 4 tokens to the
   model's limit (``models.texts.texts_for_lengths``), each sent ``rounds`` times in a seeded shuffled
   order, strictly one at a time, ``LONE_GAP_S`` apart, from a client process placed as ``bench``
   places its load generator (``lone_elsewhere``): no queueing anywhere, so each request's client
   latency less its ``Server-Timing`` ``batcher`` part is the bare path as a live client sees it
   (tokenising, HTTP, JSON, the client). ``RequestCost.fit`` makes it a line in the tokens, after a
   few unmeasured warm-up requests (``lone_plan``).
2. **The live driver's per-batch overhead.** Each lone request is a batch of one; its ``batcher`` time
   minus its slot's own run time (the batch observer's ``slot_s``: what the cost model stands for) is
   what the driver adds around the model (the scheduling call, collation, the event-loop and thread
   hand-offs); the median, clipped at 0, is ``BatchCost.overhead_s``. The server runs the deployment
   ``serve`` resolves from this profile (``scheduler_config``) without a batching window
   (``max_wait_s = 0``): the policy's, which the simulator models itself.
3. **Batches under serving load.** The model runs slower while the server handles traffic than alone
   in the profiler's loop: the other requests' HTTP, JSON and tokenising share its cores, and the
   machine's speed has moved since the grid. With the server still up, a load generator in another
   process (on the cores this process is not pinned to, when there are any, as ``bench`` runs it)
   sends ``LOADED_REQUESTS`` of the same texts open-loop, in segments taking turns at three rates
   (``LOADED_SHARES``, the last past what one slot serves one at a time). A batch's time under load is
   ``predicted * alpha * token_factor + const_s`` (``fit_loaded``); ``Noise.residuals`` are the spread
   around that line. This traffic is the profile's own, made before any run it predicts.

Bounded: about a minute in all for MiniLM on one pinned CPU core (``serving_path.wall_s``); the server is
shut down (drained, thread joined) before it returns. fastapi, uvicorn and httpx are imported here: the
caller imports this module lazily.
"""

from __future__ import annotations

import dataclasses
import math
import random
import statistics
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
from batchpilot.sim.service import (
    BatchCost,
    Noise,
    RequestCost,
    ServiceModel,
    binned_factors,
)

# The loaded phase of the serving-path profile: how a batch's time grows while the server handles traffic.
#
# ``measure_serving_path`` (item 3 of its docstring) serves the real app and, after its lone requests,
# replays ``LOADED_REQUESTS`` open-loop from a child process (``send_elsewhere``: on the cores the
# profiler is not pinned to, when there are any). Here:
#
# * ``loaded_plan``: the seeded open-loop plan, its lengths spread on a log scale (``log_weights``),
#   segments taking turns at ``LOADED_SHARES`` (``alternating_arrivals``, which the LLM's loaded phase
#   uses too);
# * ``fit_loaded``: the line ``predicted * alpha * token factor + const`` over the batches the server
#   ran, and their spread around it; the token factors per step of a batch's computed tokens
#   (``loaded_token_steps``).

# ~40-60 s of traffic for MiniLM on one CPU core: the phase is the profile's look at the machine's speed
# under load, and on a shared VM that speed wanders by a few percent over seconds (docs/profiler.md)
LOADED_REQUESTS = 1080
# of one slot's one-at-a-time rate: three loads, to see how the rate slows a batch, the last past what
# one slot serves alone, where a batching server's capacity (the rate its predictions are used at) lies
LOADED_SHARES = (0.3, 0.75, 1.25)
LOADED_SEGMENTS = 12  # the loaded traffic takes turns at the shares in this many segments
TOKEN_PRIOR_BATCHES = 10.0  # a token step's factor weighs this many batches at 1 beside its own
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


def fit_loaded(batches: list[Loaded], cost_model: CostModel,
               token_steps: Sequence[int] = (0,)) -> tuple[tuple[float, float], dict[str, Any]]:
    """``slot_s ~ predicted * alpha * step_factor(tokens) + const`` over the loaded batches: ``tokens`` the
    batch's computed tokens, binned at ``token_steps`` (``loaded_token_steps``); ``const`` the seconds
    every batch takes beyond that (``per_batch_const``); ``alpha`` makes the totals agree. Returns
    ``(alpha, const)`` and what was measured, the factors and the residuals around the line among it
    (``batch_and_noise`` makes ``BatchCost`` and ``Noise`` of both)."""
    if len(batches) < 10:
        return (1.0, 0.0), {"batches": len(batches), "note": "too few batches: not measured"}
    batches = sorted(batches, key=lambda b: b.start)
    pred = np.array([cost_model.latency(b.features) for b in batches])
    took = np.array([b.slot_s for b in batches])
    const = per_batch_const(pred, took)
    took_var = np.maximum(took - const, 1e-6)  # the part that scales with the batch
    tokens = np.array([b.features.get("tokens", 0.0) for b in batches])
    base = pred.copy()
    token_f: tuple[float, ...] = ()
    token_n = [len(batches)]
    if len(token_steps) > 1 and base.sum() > 0 and took_var.sum() > 0:
        index = np.searchsorted(np.asarray(token_steps[1:]), tokens, side="right")
        token_f, token_n = binned_factors(index, len(token_steps), took_var,
                                          base * (took_var.sum() / base.sum()), TOKEN_PRIOR_BATCHES)
        base = base * np.asarray(token_f)[index]
    by_tokens = tuple((int(lo), f) for lo, f in zip(token_steps, token_f, strict=False))
    alpha = float(took_var.sum() / base.sum()) if base.sum() > 0 else 1.0
    line = alpha * base + const
    residuals = took / line - 1.0
    return (alpha, const), {
        "batches": len(batches),
        "mean_batch_size": float(np.mean([b.features.get("n", 1.0) for b in batches])),
        "slot_over_predicted": float(took.sum() / pred.sum()), "alpha": alpha, "const_s": const,
        "token_factors": [list(step) for step in by_tokens], "token_batches": token_n,
        "residuals": sorted(float(r) for r in residuals), "residual_std": float(residuals.std()),
        "measured": [{"start": b.start, "slot_s": b.slot_s, "features": b.features, "arrivals": b.arrivals}
                     for b in batches]}


def batch_and_noise(loaded: tuple[float, float], details: dict[str, Any],
                    overhead_s: float) -> tuple[BatchCost, Noise]:
    """``BatchCost`` (with the driver's ``overhead_s``) and ``Noise`` from ``fit_loaded``'s result; takes
    the residuals out of ``details`` (they are written once, in the service model)."""
    alpha, const = loaded
    batch = BatchCost(alpha=alpha, const_s=const, overhead_s=overhead_s,
                      token_factors=tuple(tuple(x) for x in details.get("token_factors", ())))
    noise = Noise(residuals=tuple(details.pop("residuals", ())))
    return batch, noise


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
#   CPU seconds, whether it shared this process's cores, and a row per answered request;
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
    scheduled_s, latency_s, server_tokenize_s, server_batcher_s, input_tokens)``."""
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


def measure_serving_path(executor: Any, cost_model: CostModel, *, requests: int = 24, rounds: int = 2,
                         seed: int = 0, texts_for_length: Callable[[list[int]], list[str]] | None = None,
                         padding: str | None = None,
                         loaded_requests: int = LOADED_REQUESTS) -> tuple[ServiceModel, dict[str, Any]]:
    """Serve ``executor`` in-process and measure its serving path (module docstring): ``requests``
    lengths from 4 tokens to ``executor.max_length``, each sent ``rounds`` times. ``texts_for_length``
    maps token lengths to texts of exactly those lengths (default: ``models.texts.texts_for_lengths``
    with the executor's tokenizer). ``padding`` is what the server would run ("none" or "dynamic";
    default "none", "dynamic" for an executor without a padding-free path, as ``serve`` does).
    Returns the fitted ``ServiceModel`` and a JSON-ready dict of what was measured."""
    if requests < 3 or rounds < 1:
        raise ValueError(f"serving path: requests must be >= 3 and rounds >= 1, got {requests}, {rounds}")
    t_start = time.perf_counter()
    padding = _serving_padding(executor, padding)
    texts, lengths, plan = lone_plan(executor, requests, rounds, seed, texts_for_length)
    warm = sum(p.warmup for p in plan)

    sched = scheduler_config(executor, padding, cost_model)
    traffic = loaded_plan(texts, lengths, cost_model, padding, seed, loaded_requests)
    records, slot_s, batches = _serve_and_send(executor, sched, cost_model, plan, traffic)
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
    request = RequestCost.fit(tok, client, batcher)
    predicted = np.array([cost_model.latency(one_input(int(n), padding)) for n in tok])
    slots = np.array([slot_of[id(r)] for r in ok])
    overhead = batcher - slots
    finite = overhead[np.isfinite(overhead)]
    overhead_s = max(float(np.median(finite)), 0.0) if finite.size else 0.0
    loaded, load_details = fit_loaded(batches, cost_model, loaded_token_steps(executor))
    batch, noise = batch_and_noise(loaded, load_details, overhead_s)
    service = ServiceModel(request, batch, noise)
    details = {
        "requests": len(measured), "ok": len(ok), "warmup_requests": warm, "lengths": len(texts),
        "min_tokens": min(lengths), "max_tokens": max(lengths), "rounds": rounds, "padding": padding,
        "policy": {"name": sched.policy.name, "max_wait_s": sched.policy.max_wait_s},
        "median_client_s": _median(client), "median_tokenize_s": _median(tokenize),
        "median_batcher_s": _median(batcher), "median_slot_s": _median(slots),
        "median_predicted_s": _median(predicted),
        "median_overhead_s": _median(overhead), "loaded": load_details,
        "wall_s": round(time.perf_counter() - t_start, 2),
    }
    return service, details


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
                    ) -> tuple[list[Any], list[float], list[Loaded]]:
    """Start uvicorn on a socket bound here (no port race), send ``plan`` one by one, then
    ``loaded_plan`` open-loop, both from another process, shut down. Returns the lone requests'
    records, each lone batch's slot seconds in the order they ran and each loaded batch."""
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
        if loaded_plan:
            send_elsewhere(config.base_url, config.model or "", loaded_plan)
            time.sleep(0.5)  # the last batches report on the loop
    return records, [b.slot_s for b in seen[:lone]], seen[lone:]



def _median(x: np.ndarray) -> float:
    finite = x[np.isfinite(x)]
    return float(np.median(finite)) if finite.size else float("nan")
