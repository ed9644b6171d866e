"""The LLM routes' serving path: what a live step and a client's first token cost beyond the step profile.

The step profile times forward + sampling of a step shape alone. ``measure_llm_serving_path`` serves the
real app (``create_app`` with the LLM router, as ``serve --llm`` mounts it) on a free 127.0.0.1 port in
this process and measures, with its own traffic, before any traffic it predicts:

1. **The first-token delay.** ``REQUESTS`` streamed completions of token-id prompts of spread lengths,
   sent one at a time, ``LONE_GAP_S`` apart, from a client process placed as ``bench`` places its load
   generator (``serving_client.lone_elsewhere``): no queueing anywhere; per request the client's TTFT
   minus the engine's (the ``engine`` part of the first chunk's ``Server-Timing`` header). The median
   is ``first_token_delay_s``.
   Later tokens pay the same path, so it moves every token alike and TPOT is unchanged.
2. **Steps under load.** ``LOADED_REQUESTS`` streamed completions (prompts spread 16-512 tokens, outputs
   16-128) open-loop from a child process (on the cores this process is not pinned to, when there are any, as
   ``bench`` runs its load generator), seeded Poisson in segments alternating between ``LOADED_SHARES`` of the
   rate at which the engine would serve them one at a time (from the step profile): about 1, 5-15, 3-5 and
   10-30 sequences per step, with requests arriving while they run. Each share runs in two segments of
   its own, so that the decode-only steps at 4-31 sequences, the counts a loaded server runs most,
   number several hundred per bin of ``step_seq_factors`` and are spread over the phase, not taken in
   one stretch of the machine's speed. A live step of many sequences usually has new
   requests arriving beside it (their HTTP, tokenising, first chunks on the same cores), and such steps ran
   slower than those of a burst's walk-down, where every stream arrived at the start (docs/benchmarks.md,
   conv-llm). Then ``BURST_ROUNDS`` bursts, one after another, of ``burst_streams`` streams (the engine's
   ``max_num_seqs``, at most ``BURST_MAX_SEQS``, as many as its KV pool holds) arriving within
   ``BURST_WINDOW_STEPS`` one-sequence decode steps: every stream of a burst runs at once and, as their
   outputs (16-128 tokens) end, the steps walk down from that many sequences to one, the batch sizes a loaded
   server runs. Every engine step is observed (``engine.step_observers``); ``LLMFrontEnd.fit_steps`` turns
   them into the speed of the forward under load (``step_alpha``) and what a busy step costs beyond it
   (``step_const_s + step_per_seq_s * seqs``: scheduling, detokenising and delivering each token, the event
   loop streaming it on the same cores, the gap to the next step), measured over the sequences per step
   observed (``loaded``: ``mean_seqs``, ``p90_seqs``, ``max_seqs``).
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np

from batchpilot.bench.loadgen import build_plan
from batchpilot.runtime.executor import NoopExecutor
from batchpilot.server.app import create_app
from batchpilot.server.config import ServerConfig
from batchpilot.server.inproc_server import bound_socket, in_thread
from batchpilot.server.serving_client import LONE_GAP_S, lone_elsewhere, send_elsewhere
from batchpilot.server.serving_load import alternating_arrivals
from batchpilot.sim.llm_frontend import LLMFrontEnd
from batchpilot.sim.traces import Workload

REQUESTS = 12
OUTPUT_TOKENS = 4
LOADED_REQUESTS = 240  # with the lone streams and bursts, about two minutes for the tiny Llama on 2 CPU cores
LOADED_SHARES = (1.0, 5.0, 3.0, 10.0)  # of the one-at-a-time rate: about 1, 5-15, 3-5 and 10-30 sequences
LOADED_SEGMENTS = 8  # each share twice, taking turns: a drift of the CPU's speed reaches every share alike
BURST_MAX_SEQS = 64  # the streams of a burst: the engine's max_num_seqs, at most this
BURST_WINDOW_STEPS = 8  # the burst arrives within this many one-sequence decode steps (outputs >= 16)
BURST_ROUNDS = 3  # ~20 s in all for the tiny Llama on one CPU core, 1-3 steps at each count of sequences
BURST_GAP_FACTOR = 1.5  # a burst starts this many of the previous one's predicted seconds after it
OUTPUT_RANGE = (16, 128)  # loaded streams' output tokens, both ends included


def measure_llm_serving_path(engine: Any, cost_model: Any, requests: int = REQUESTS, seed: int = 0,
                             loaded_requests: int = LOADED_REQUESTS,
                             burst: int | None = None) -> tuple[LLMFrontEnd, dict[str, Any]]:
    """Serve ``engine`` (started) in-process and measure its serving path (module docstring) against the
    step profile ``cost_model``. ``burst``: the burst's streams (None: ``burst_streams`` of the engine's
    config; 0: no burst); ``loaded_requests`` 0 skips the loaded phase, burst included. Returns the
    ``LLMFrontEnd`` and a JSON-ready dict of what was measured."""
    from batchpilot.server.llm_routes import make_llm_router

    top = min(int(engine.config.max_model_len) - OUTPUT_TOKENS - 1, 512)
    lengths = [int(x) for x in np.linspace(16, max(top, 16), requests)]
    wl = Workload.from_columns("llm-serving-path", [0.0] * requests, lengths, [OUTPUT_TOKENS] * requests)
    plan = build_plan(wl, "completions", seed=seed)
    sock, port = bound_socket()
    app = create_app(ServerConfig(port=port, request_timeout_s=60.0, drain_timeout_s=5.0), NoopExecutor(),
                     routers=[lambda registry: make_llm_router(engine, registry)],
                     extra_models=[engine.model_name])
    with in_thread(app, sock, "batchpilot-llm-serving-profile") as url:
        # the first two unmeasured (the first steps allocate); from a client process, as bench's
        records = lone_elsewhere(url, engine.model_name, plan[:2] + plan, LONE_GAP_S,
                                 endpoint="completions")[2:]
        steps: list[Any] = []
        streams = burst_streams(engine.config) if burst is None else max(int(burst), 0)
        if loaded_requests > 0:
            engine.step_observers.append(steps.append)
            try:
                wl = loaded_workload(engine.config, cost_model, seed, loaded_requests, streams)
                traffic = build_plan(wl, "completions", seed=seed + 12)
                send_elsewhere(url, engine.model_name, traffic, endpoint="completions")
            finally:
                engine.step_observers.remove(steps.append)
    gaps = np.array([r.ttft_s - r.server_batcher_s for r in records if r.ok], dtype=float)
    gaps = gaps[np.isfinite(gaps)]
    if gaps.size < 3:
        raise RuntimeError(f"llm serving path: {gaps.size} of {len(records)} requests gave a TTFT and "
                           "the engine's Server-Timing")
    delay = max(float(np.median(gaps)), 0.0)
    lone = {"requests": len(records), "ok": int(gaps.size), "median_s": delay,
            "p10_s": float(np.percentile(gaps, 10)), "p90_s": float(np.percentile(gaps, 90))}
    frontend, loaded = LLMFrontEnd.fit_steps(
        cost_model, [r.start for r in steps], [r.forward_s for r in steps], [r.wall_s for r in steps],
        [r.num_seqs for r in steps], [r.features for r in steps], [r.after_idle for r in steps],
        first_token_delay_s=delay)
    return frontend, {"first_token": lone, "loaded": loaded, "loaded_requests": loaded_requests,
                      "burst_streams": streams if loaded_requests > 0 else 0}


def burst_streams(config: Any) -> int:
    """The burst's streams for an engine of ``config`` (``LLMSchedulerConfig``): ``max_num_seqs``, at
    most ``BURST_MAX_SEQS``, and no more than ``_burst_blocks`` of its KV pool holds at once with the
    shortest prompt (16 tokens) and the longest output."""
    per_stream = -(-(16 + OUTPUT_RANGE[1]) // int(config.block_size))  # blocks
    return max(min(int(config.max_num_seqs), BURST_MAX_SEQS, _burst_blocks(config) // per_stream), 0)


def burst_seconds(cost_model: Any, prompts: Any, outputs: Any) -> float:
    """``cost_model``'s seconds for streams of these prompts and outputs started together: each prompt's
    lone prefill, then one decode step per output token of those still running."""
    from batchpilot.core.costmodel import StepShape

    p, o = np.asarray(prompts, dtype=int), np.asarray(outputs, dtype=int)
    total = sum(cost_model.latency(StepShape(int(x), 0, int(x), int(x) ** 2)) for x in p)
    for j in range(1, int(o.max(initial=0))):
        live = o > j
        total += cost_model.latency(StepShape(0, int(live.sum()), int((p[live] + j).sum())))
    return float(total)


def _burst_blocks(config: Any) -> int:
    """The KV blocks the burst may fill: nine tenths of the pool, the rest left to open-loop stragglers."""
    return int(config.num_kv_blocks) * 9 // 10


def loaded_workload(config: Any, cost_model: Any, seed: int, n: int, burst: int) -> Workload:
    """The loaded phase's streams for an engine of ``config`` (``LLMSchedulerConfig``), seeded: ``n``
    open-loop, prompts 16-512 tokens (at most ``max_model_len`` less the longest output), at
    ``alternating_arrivals`` in ``LOADED_SEGMENTS`` segments between ``LOADED_SHARES`` of the
    one-at-a-time rate (``cost_model``'s lone prefill plus decodes); then, after the last of them plus
    twice their mean lone time and a second, ``BURST_ROUNDS`` bursts of ``burst`` streams (<=
    ``burst_streams(config)`` for one to fit the KV pool), each arriving within ``BURST_WINDOW_STEPS``
    of ``cost_model``'s one-sequence decode step, prompts cut so that all of them fit ``_burst_blocks``
    together and, on average, prefill within half the shortest output's steps (so every stream of a
    burst runs at once, and ``fit_steps`` sees steps of ``burst`` sequences down to one). A burst starts
    ``BURST_GAP_FACTOR`` times the previous one's ``burst_seconds`` and a second after that one's
    window. Outputs are ``OUTPUT_RANGE``."""
    from batchpilot.core.costmodel import StepShape

    rng = np.random.default_rng(seed + 11)
    top = max(min(int(config.max_model_len) - OUTPUT_RANGE[1] - 1, 512), 16)
    prompts = rng.integers(16, top + 1, n)
    outputs = rng.integers(OUTPUT_RANGE[0], OUTPUT_RANGE[1] + 1, n)
    alone = float(np.mean([cost_model.latency(StepShape(int(p), 0, int(p), int(p) ** 2))
                           + (int(o) - 1) * cost_model.latency(StepShape(0, 1, int(p + o // 2)))
                           for p, o in zip(prompts, outputs, strict=True)])) if n > 0 else 0.0
    gaps = tuple(alone / share for share in LOADED_SHARES)
    arrivals = alternating_arrivals(n, gaps, random.Random(seed + 13), LOADED_SEGMENTS) if n > 0 else []
    arrivals = list(arrivals)
    if burst > 0:
        fit = _burst_blocks(config) // burst * int(config.block_size) - OUTPUT_RANGE[1]
        prefill = OUTPUT_RANGE[0] // 2 * int(config.max_num_batched_tokens)  # tokens, all prompts together
        b_top = max(min(top, fit, 2 * prefill // burst - 16), 16)
        window = BURST_WINDOW_STEPS * cost_model.latency(StepShape(0, 1, 16))
        start = (arrivals[-1] if arrivals else 0.0) + 2.0 * alone + 1.0
        for _ in range(BURST_ROUNDS):
            b_prompts = rng.integers(16, b_top + 1, burst)
            b_outputs = rng.integers(OUTPUT_RANGE[0], OUTPUT_RANGE[1] + 1, burst)
            arrivals += sorted(start + window * rng.random(burst))
            prompts, outputs = np.r_[prompts, b_prompts], np.r_[outputs, b_outputs]
            start += window + BURST_GAP_FACTOR * burst_seconds(cost_model, b_prompts, b_outputs) + 1.0
    return Workload.from_columns("llm-serving-path-loaded", [float(a) for a in arrivals],
                                 [int(p) for p in prompts], [int(o) for o in outputs])
