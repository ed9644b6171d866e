"""The LLM routes' serving path: how much later a client sees its first token than the engine makes it.

A client's time to first token is the engine's (queue, prefill, the first step) plus the path around it:
the HTTP request in, the prompt's validation and hand-off to the engine thread, the first SSE chunk
back through the event loop and the client's read. The step profile times the engine alone, so the
simulator adds that path as one constant, ``first_token_delay_s``, measured here: the real app
(``create_app`` with the LLM router, as ``serve --llm`` mounts it) on a free 127.0.0.1 port in this
process, ``REQUESTS`` streamed completions of token-id prompts of spread lengths sent one at a time
(no queueing anywhere), and per request the client's TTFT minus the engine's (the ``engine`` part of
the first chunk's ``Server-Timing`` header); the median is the delay. It is part of the profile, made
before any traffic it predicts. Later tokens pay the same path, so it moves every token alike and the
time per output token is unchanged.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np

from ..bench.loadgen import LoadGenConfig, build_plan, one_by_one_async
from ..runtime.executor import NoopExecutor
from ..sim.traces import Workload
from .app import create_app
from .config import ServerConfig
from .serving_profile import bound_socket, in_thread

REQUESTS = 12
OUTPUT_TOKENS = 4


def measure_first_token_delay(engine: Any, requests: int = REQUESTS,
                              seed: int = 0) -> tuple[float, dict[str, Any]]:
    """Serve ``engine`` (started) in-process and measure the first-token delay (module docstring)."""
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
    gaps = np.array([r.ttft_s - r.server_batcher_s for r in records if r.ok], dtype=float)
    gaps = gaps[np.isfinite(gaps)]
    if gaps.size < 3:
        raise RuntimeError(f"llm serving path: {gaps.size} of {len(records)} requests gave a TTFT and "
                           "the engine's Server-Timing")
    delay = max(float(np.median(gaps)), 0.0)
    return delay, {"requests": len(records), "ok": int(gaps.size), "median_s": delay,
                   "p10_s": float(np.percentile(gaps, 10)), "p90_s": float(np.percentile(gaps, 90))}
