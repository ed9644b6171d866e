"""The LLM routes' serving path: what a live step and a client's first token cost beyond the step profile.

The step profile times forward + sampling of a step shape alone. ``measure_llm_serving_path`` serves the
real app (``create_app`` with the LLM router, as ``serve --llm`` mounts it) on a free 127.0.0.1 port in
this process and measures, with its own traffic, before any traffic it predicts:

1. **The first-token delay.** ``REQUESTS`` streamed completions of token-id prompts of spread lengths,
   sent one at a time (no queueing anywhere); per request the client's TTFT minus the engine's (the
   ``engine`` part of the first chunk's ``Server-Timing`` header). The median is ``first_token_delay_s``.
   Later tokens pay the same path, so it moves every token alike and TPOT is unchanged.
2. **Steps under load.** ``LOADED_REQUESTS`` streamed completions (prompts spread 16-512 tokens, outputs
   16-128) open-loop from a child process (on the cores this process is not pinned to, when there are
   any, as ``bench`` runs its load generator), seeded Poisson in segments alternating between
   ``LOADED_SHARES`` of the rate at which the engine would serve them one at a time (from the step
   profile). Every engine step is observed (``engine.step_observers``); ``LLMFrontEnd.fit_steps`` turns
   them into the speed of the forward under load (``step_alpha``) and what a busy step costs beyond it
   (``step_const_s + step_per_seq_s * seqs``: scheduling, detokenising and delivering each token, the
   event loop streaming it on the same cores, the gap to the next step).
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

import numpy as np

from ..bench.loadgen import LoadGenConfig, build_plan, one_by_one_async
from ..runtime.executor import NoopExecutor
from ..sim.llm_frontend import LLMFrontEnd
from ..sim.traces import Workload
from .app import create_app
from .config import ServerConfig
from .serving_load import alternating_arrivals, send_elsewhere
from .serving_profile import bound_socket, in_thread

REQUESTS = 12
OUTPUT_TOKENS = 4
LOADED_REQUESTS = 40  # ~20-40 s for the tiny Llama on one CPU core
LOADED_SHARES = (1.0, 3.0)  # of the one-at-a-time rate: about 1 and 3-5 sequences running
LOADED_SEGMENTS = 4


def measure_llm_serving_path(engine: Any, cost_model: Any, requests: int = REQUESTS, seed: int = 0,
                             loaded_requests: int = LOADED_REQUESTS) -> tuple[LLMFrontEnd, dict[str, Any]]:
    """Serve ``engine`` (started) in-process and measure its serving path (module docstring) against the
    step profile ``cost_model``. Returns the ``LLMFrontEnd`` and a JSON-ready dict of what was measured."""
    from .llm_routes import make_llm_router

    top = min(int(engine.config.max_model_len) - OUTPUT_TOKENS - 1, 512)
    lengths = [int(x) for x in np.linspace(16, max(top, 16), requests)]
    wl = Workload.from_columns("llm-serving-path", [0.0] * requests, lengths, [OUTPUT_TOKENS] * requests)
    plan = build_plan(wl, "completions", seed=seed)
    sock, port = bound_socket()
    app = create_app(ServerConfig(port=port, request_timeout_s=60.0, drain_timeout_s=5.0), NoopExecutor(),
                     routers=[lambda registry: make_llm_router(engine, registry)],
                     extra_models=[engine.model_name])
    with in_thread(app, sock, "batchpilot-llm-serving-profile") as url:
        config = LoadGenConfig(url, "completions", model=engine.model_name, timeout_s=60.0, progress=False,
                               scrape_interval_s=0)
        asyncio.run(one_by_one_async(plan[:2], config))  # unmeasured: the first steps allocate
        records = asyncio.run(one_by_one_async(plan, config))
        steps: list[Any] = []
        if loaded_requests > 0:
            engine.step_observers.append(steps.append)
            try:
                traffic = _loaded_plan(engine, cost_model, seed, loaded_requests)
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
    return frontend, {"first_token": lone, "loaded": loaded, "loaded_requests": loaded_requests}


def _loaded_plan(engine: Any, cost_model: Any, seed: int, n: int) -> list[Any]:
    """``n`` streamed completions, prompts 16-512 and outputs 16-128 tokens (seeded), at
    ``alternating_arrivals`` in ``LOADED_SEGMENTS`` segments between ``LOADED_SHARES`` of the
    one-at-a-time rate."""
    from ..core.costmodel import StepShape

    rng = np.random.default_rng(seed + 11)
    top = max(min(int(engine.config.max_model_len) - 129, 512), 16)
    prompts = rng.integers(16, top + 1, n)
    outputs = rng.integers(16, 129, n)
    alone = float(np.mean([cost_model.latency(StepShape(int(p), 0, int(p), int(p) ** 2))
                           + (int(o) - 1) * cost_model.latency(StepShape(0, 1, int(p + o // 2)))
                           for p, o in zip(prompts, outputs, strict=True)]))
    gaps = (alone / LOADED_SHARES[0], alone / LOADED_SHARES[1])
    arrivals = alternating_arrivals(n, gaps, random.Random(seed + 13), LOADED_SEGMENTS)
    wl = Workload.from_columns("llm-serving-path-loaded", arrivals, prompts.tolist(), outputs.tolist())
    return build_plan(wl, "completions", seed=seed + 12)
