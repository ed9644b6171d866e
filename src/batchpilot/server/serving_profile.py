"""Measure the serving path around the batcher on this machine: the ``"frontend"`` part of a profile.

The cost model says what a batch costs the executor; a client sees more. ``measure_serving_path``
serves the real app (``create_app``, the one ``batchpilot serve`` runs) in-process with uvicorn on a
free 127.0.0.1 port, and measures three things the simulator's ``sim.frontend.FrontEnd`` needs:

1. **The two front-end stages.** Real texts of lengths spread from 4 tokens to the model's limit
   (``sim.texts.texts_for_lengths``), each sent ``rounds`` times in a seeded shuffled order, strictly
   one at a time, ``LONE_GAP_S`` apart, from a client process placed as ``bench`` places its load
   generator (``serving_client.lone_elsewhere``): no queueing anywhere, so each request's
   ``Server-Timing`` split (``tokenize``, ``batcher``) and its client latency are the bare path as a
   live client sees it. ``FrontEnd.fit`` turns them into the serial stage (the tokenizer thread) and
   the delay (HTTP, JSON, the client), after a few unmeasured warm-up requests (``lone_plan``).
2. **The live driver's per-batch overhead.** Each lone request is a batch of one; its ``batcher`` time
   minus its slot's own run time (the batch observer's ``slot_s``: what the cost model stands for) is
   what the driver adds around the model (the scheduling call, collation, the event-loop and thread
   hand-offs); the median, clipped at 0, is ``batch_overhead_s``. Under load, the turnaround from a
   batch's end to the next one's start while requests wait is ``batch_gap_s`` plus
   ``batch_gap_per_input_s`` per input of the batch before (``serving_load.turnaround_line``, phase
   3). The server runs the deployment ``serve`` resolves from this profile (``scheduler_config``)
   without a batching window (``max_wait_s = 0``): the policy's, which the simulator models itself.
3. **Batches under serving load** (``server/serving_load.py``). The model runs slower while the
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
   (``sim.before_batch``), plus ``loaded_const_s`` a batch (``serving_load.per_batch_const``);
   ``loaded_residuals`` are the spread around that line, less the wander of the machine's speed that
   batches of the same two seconds share (``loaded_wander``, ``sim.batch_noise``). How much longer the
   load generator's requests spent outside the batcher than lone ones is the delay stage under load
   (``server/serving_delay.py``). This traffic is the profile's own, made before any run it predicts.
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
import random
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from batchpilot.bench.loadgen import LoadGenConfig, PlannedRequest
from batchpilot.core.config import Padding, PolicyConfig, SchedulerConfig
from batchpilot.core.costmodel import CostModel
from batchpilot.core.deployment import DeploymentSpec, resolve_deployment
from batchpilot.server.app import create_app
from batchpilot.server.build import model_limits
from batchpilot.server.config import ServerConfig
from batchpilot.server.inproc_server import bound_socket, in_thread
from batchpilot.server.service import tokenizer_workers
from batchpilot.server.serving_client import LONE_GAP_S, lone_elsewhere, send_elsewhere
from batchpilot.server.serving_delay import fit_loaded_delay
from batchpilot.server.serving_load import (
    LOADED_REQUESTS,
    LOADED_SEGMENTS,
    LOADED_SHARES,
    Loaded,
    competing_cpu,
    fit_loaded,
    frontend_fields,
    loaded_plan,
    loaded_token_steps,
    one_input,
    thread_cpu_s,
)
from batchpilot.sim.frontend import FrontEnd

WARMUP_REQUESTS = 4
IDLE_S, BUSY_S, CYCLES = 0.25, 0.5, 4  # contention timing: idle, busy, idle, busy, ... idle
CONTENTION_BATCH = (4, 128)  # the background thread's batch: 4 inputs of about 128 tokens


def measure_serving_path(executor: Any, cost_model: CostModel, *, requests: int = 24, rounds: int = 2,
                         seed: int = 0, texts_for_length: Callable[[list[int]], list[str]] | None = None,
                         padding: str | None = None,
                         loaded_requests: int = LOADED_REQUESTS) -> tuple[FrontEnd, dict[str, Any]]:
    """Serve ``executor`` in-process and measure its serving path (module docstring): ``requests``
    lengths from 4 tokens to ``executor.max_length``, each sent ``rounds`` times. ``texts_for_length``
    maps token lengths to texts of exactly those lengths (default: ``sim.texts.texts_for_lengths``
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
        from batchpilot.sim.texts import texts_for_lengths

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
    rows (``serving_delay.DelayRow``)."""
    sock, port = bound_socket()
    app = create_app(ServerConfig(port=port, request_timeout_s=30.0, drain_timeout_s=5.0), executor, sched,
                     cost_model)
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
