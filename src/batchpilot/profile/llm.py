"""Measure real LLM steps and fit the step cost model the simulator and planner use.

Synthetic steps over the runner's own KV cache: pure prefills of several lengths, pure decode batches
at several context lengths, and mixes of both. Each point is timed (forward + greedy sampling, the
engine's hot path) and ``CostModel.fit(points, LLM_FEATURES)`` turns them into
``const + prefill_tokens + decode_seqs + kv_tokens + prefill_attn + multi_row`` coefficients,
JSON-serialisable, loadable by ``batchpilot simulate --workload conv-llm --profile``.
A runner with swap space also gets its block copies timed (``measure_swap``), recorded in the profile's
``meta`` (``core.llm.scheduler.SWAP_META_KEYS``).

The swap and prefill probes themselves (``measure_swap``, ``probe_preemption_costs``) live with the
runner (``models/llm/runner.py``): the engine runs them at start-up for ``preemption: auto``.

Sections: the step profile; ``batchpilot profile --llm`` (``run_llm``: steps, memory and serving path
written as one profile file); the LLM routes' serving path (``measure_llm_serving_path``).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import random
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from batchpilot.bench.loadgen import build_plan
from batchpilot.core.costmodel import LLM_FEATURES, CostModel, ProfilePoint
from batchpilot.core.deployment import LLM_PRECISIONS, ServingOptions
from batchpilot.core.llm.scheduler import SWAP_META_KEYS, StepPlan
from batchpilot.models.llm.runner import LLMModelRunner, measure_swap, step_plan
from batchpilot.profile.serving import LONE_GAP_S, alternating_arrivals, lone_elsewhere, send_elsewhere
from batchpilot.profile.structured import measure_structured_cost
from batchpilot.runtime.executor import NoopExecutor
from batchpilot.server.app import MountedEngine, ServedModel, create_app
from batchpilot.server.config import ServerConfig
from batchpilot.server.inproc_server import bound_socket, in_thread
from batchpilot.sim.llm import LLMServiceModel
from batchpilot.sim.traces import Workload


def _plan(runner: LLMModelRunner, prefills: Sequence[int], decodes: int, decode_ctx: int) -> StepPlan:
    return step_plan(runner, prefills, [decode_ctx] * decodes)


def time_step(runner: LLMModelRunner, plan: StepPlan, repeats: int = 3) -> float:
    """Median seconds of forward + argmax for one plan (after one warm-up call)."""
    runner.forward(plan.chunks).argmax(-1).tolist()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        runner.forward(plan.chunks).argmax(-1).tolist()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def profile_llm_steps(runner: LLMModelRunner, *,
                      prefill_lengths: Sequence[int] = (16, 32, 48, 64, 96, 128, 192, 256, 384, 512),
                      decode_batches: Sequence[int] = (1, 2, 3, 4, 5, 6, 8, 10, 13, 16, 22, 32, 45, 64),
                      decode_contexts: Sequence[int] = (64, 256, 512, 1024),
                      mixed_prefills: Sequence[int] = (32, 128, 256),
                      mixed_decodes: Sequence[int] = (1, 4, 16),
                      repeats: int = 7) -> CostModel:
    """Time pure prefills, pure decode batches at several contexts, and mixed steps (a prefill chunk
    beside decodes, what a continuous batch mostly runs), then fit the step model.

    The grid covers the region a small continuous batch lives in (1-16 decodes, prompts of tens to
    hundreds of tokens) densely: a grid of 12 points (prefills 16/128/512, decodes 1/16/64) left the
    fixed cost undetermined, 8 ms in one profile and 13 ms in the next on the same machine. Ten prompt
    lengths: with six, the split between ``prefill_tokens`` and ``prefill_attn`` moved 17x between two
    profiles. Decode counts between the powers of two: the runner's matmuls run whole tiles of rows
    (``row_plan.py``), so a step's cost climbs in stairs with its sequences, and powers of two alone
    sit on the stairs' cheap edges. Context 512 beside 64, 256 and 1024: where a conversation's decodes
    mostly run."""
    points = []
    shapes: list[tuple[list[int], int, int]] = []
    shapes += [([n], 0, 1) for n in prefill_lengths]
    shapes += [([], b, c) for b in decode_batches for c in decode_contexts
               if b * c <= runner.num_kv_blocks * runner.block_size]
    mid = decode_contexts[len(decode_contexts) // 2]
    shapes += [([p], b, mid) for p in mixed_prefills for b in mixed_decodes]
    with torch.inference_mode():
        plans = [_plan(runner, prefills, b, ctx) for prefills, b, ctx in shapes]
        for plan in plans:
            runner.forward(plan.chunks).argmax(-1).tolist()  # warm-up: a new shape's first call allocates
        # timed round-robin, every shape once per round: this CPU's speed moves by a quarter within
        # minutes, and timed shape after shape a step of it lands between the cheap shapes and the dear
        # ones and bends the fit; round-robin it scales every shape alike (a speed, which
        # ``profile --recheck`` measures)
        times: list[list[float]] = [[] for _ in plans]
        for _ in range(repeats):
            for plan, t in zip(plans, times, strict=True):
                t0 = time.perf_counter()
                runner.forward(plan.chunks).argmax(-1).tolist()
                t.append(time.perf_counter() - t0)
        points += [ProfilePoint(plan.shape.features(), sorted(t)[len(t) // 2])
                   for plan, t in zip(plans, times, strict=True)]
    # each shape and its time, for ``batchpilot profile --recheck`` (``recheck_steps``)
    step_points = [{"prefills": list(pre), "decodes": b, "context": ctx, "latency_s": p.latency_s}
                   for (pre, b, ctx), p in zip(shapes, points, strict=True)]
    meta = {"source": "profile_llm_steps", "block_size": runner.block_size, "points": len(points),
            "repeats": repeats, "threads": torch.get_num_threads(), "step_points": step_points,
            "row_plan": {str(t): p for t, p in runner.row_plan.padded().items()}}
    if runner.num_swap_blocks:
        meta.update(zip(SWAP_META_KEYS, measure_swap(runner), strict=True))
    return CostModel.fit(points, LLM_FEATURES, meta=meta)


def recheck_steps(runner: LLMModelRunner, step_points: Sequence[dict[str, Any]], repeats: int = 5,
                  max_seconds: float = 0.05) -> list[float]:
    """The median seconds of each of ``step_points`` (``profile_llm_steps``'s shapes) timed again on
    ``runner`` as the profile timed them (one warm-up call each, round-robin); shapes the profile
    measured over ``max_seconds`` are left out (``nan``): the frequent steps, in seconds of work."""
    todo = [i for i, p in enumerate(step_points) if p["latency_s"] <= max_seconds]
    plans = {i: _plan(runner, p["prefills"], p["decodes"], p["context"])
             for i, p in ((i, step_points[i]) for i in todo)}
    times: dict[int, list[float]] = {i: [] for i in todo}
    with torch.inference_mode():
        for plan in plans.values():
            runner.forward(plan.chunks).argmax(-1).tolist()
        for _ in range(repeats):
            for i, plan in plans.items():
                t0 = time.perf_counter()
                runner.forward(plan.chunks).argmax(-1).tolist()
                times[i].append(time.perf_counter() - t0)
    return [sorted(times[i])[len(times[i]) // 2] if i in times else math.nan for i in range(len(step_points))]


# -- batchpilot profile --llm ----------------------------------------------------------------------
# ``batchpilot profile --llm``: the LLM engine's step cost model and memory, written as one profile file.
#
# The engine is built as ``serve --llm`` builds it (``runtime/llm/build.build_llm_engine``: the same
# model, precision and threads), not started. Measured on its runner:
#
# * ``cost_model``: the step time model (``profile/llm.profile_llm_steps``), what ``simulate
#   --target llm --profile`` prices steps with;
# * ``memory``: weights, KV bytes per token, the overhead and the activation peak
#   (``runtime/llm/build.profile_engine_memory``),
#   what ``serve --llm --llm-profile`` and ``simulate --target llm --profile`` plan the KV pool from
#   (``core/llm/config.py``);
# * ``free_bytes``: the device's free memory before the model loaded, so a ``memory_utilization``
#   budget can be planned in the simulator as it would be on this machine;
# * the swap copy times (``cost_model.meta``, from ``profile_llm_steps``), what swap preemption is
#   priced with in the simulator;
# * ``service`` and ``serving_path``: the routes' serving path, measured after the steps on a fresh
#   engine built the same way (the memory burst stopped the first) and started behind the real app
#   (``profile/llm.measure_llm_serving_path``: the first-token delay and a step's price
#   under the profile's own streamed load), what ``simulate --target llm --profile`` times every step
#   with, and what a sequence under a grammar adds to its step (``profile/structured.py``, the
#   ``structured`` entry); ``--no-serving-path`` leaves them out.

def run_llm(args: argparse.Namespace) -> int:
    import torch

    from batchpilot.core.llm.config import MIB
    from batchpilot.models.device import free_memory_bytes, resolve_device
    from batchpilot.runtime.llm.build import BuildOptions, build_llm_engine, profile_engine_memory

    device = resolve_device(args.device)
    if args.dtype not in LLM_PRECISIONS:
        print(f"batchpilot profile --llm: --dtype {args.dtype} is not an LLM precision; use "
              f"{', '.join(LLM_PRECISIONS)}")
        return 2
    free = free_memory_bytes(device)
    t0 = time.perf_counter()
    built_as = BuildOptions(device=str(device), dtype=args.dtype, threads=args.threads or 0, start=False)
    engine = build_llm_engine(args.model, None, built_as, num_swap_blocks=16)  # host blocks: swaps get timed
    runner = engine.runner
    dtype, kv_dtype = runner.precision.chosen, runner.precision.kv_dtype  # auto: what the probe chose
    built_as = dataclasses.replace(built_as, dtype=dtype, kv_dtype=kv_dtype)
    print(f"{engine.model_name} on {device} ({runner.precision.label}, {torch.get_num_threads()} threads), "
          f"loaded in "
          f"{time.perf_counter() - t0:.1f} s; KV pool {runner.num_kv_blocks} blocks x {runner.block_size}")
    t1 = time.perf_counter()
    memory, mem_points = profile_engine_memory(engine)
    print(f"memory: weights {memory.weights_bytes / MIB:.1f} MiB, overhead "
          f"{memory.overhead_bytes / MIB:.1f} MiB, KV {memory.kv_bytes_per_token} B per "
          f"token, activation {memory.activation_fixed_bytes / MIB:.2f} MiB + "
          f"{memory.activation_bytes_per_token:.0f} B per batched token + "
          f"{memory.activation_bytes_per_read_token:.0f} B per gathered context token "
          f"({len(mem_points)} steps measured)")
    model = profile_llm_steps(runner, repeats=args.repeats)
    coef = ", ".join(f"{n}={c:.3g}" for n, c in zip(model.feature_names, model.latency_coef, strict=True))
    print(f"step model: {coef}  (seconds per feature unit)")
    model.meta.update(device=str(device), dtype=dtype, kv_dtype=kv_dtype, model=engine.model_name,
                      model_path=args.model,
                      date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"))
    doc: dict[str, Any] = {
        "kind": "llm",
        "cost_model": model.to_dict(),
        "memory": memory.to_dict(),
        "memory_points": mem_points,
        "free_bytes": free,
        "model_max_len": int(runner.cos.shape[0]),  # the model's positions: max_model_len when not given
        "device": device.type,
        "meta": {"model": engine.model_name, "device": str(device), "dtype": dtype, "kv_dtype": kv_dtype,
                 "threads": torch.get_num_threads(), "torch": torch.__version__,
                 "seconds": time.perf_counter() - t1},
    }
    if not args.no_serving_path:
        del engine, runner  # the memory burst shut that engine down: the serving path gets a fresh one
        fresh = build_llm_engine(args.model, None, built_as)
        per_seq, doc["structured"] = measure_structured_cost(fresh)  # before it starts: its runner is free
        print(f"structured outputs: a sequence under a JSON schema adds {per_seq * 1e3:.3f} ms to its step "
              f"({doc['structured']['seqs']} decoding sequences, all under the schema against none)")
        doc["service"], doc["serving_path"] = serving_path(fresh, model)
        doc["service"]["structured_s_per_seq"] = per_seq
    Path(args.output).write_text(json.dumps(doc, indent=2))
    print(f"wrote {args.output} in {time.perf_counter() - t1:.1f} s")
    return 0


def serving_path(engine: Any, cost_model: Any, **measure: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """Start ``engine`` (built, never started), measure its serving path through the real app and shut
    it down; returns the ``service`` entry and what was measured (``serving_path``). ``measure``:
    keyword arguments of ``measure_llm_serving_path`` (``loaded_requests``, ...)."""

    t0 = time.perf_counter()
    engine.start()
    try:
        service, details = measure_llm_serving_path(engine, cost_model, **measure)
    finally:
        engine.shutdown()
    print(f"serving path: first token {service.first_token_delay_s * 1e3:.2f} ms after the engine's "
          f"({details['first_token']['ok']} lone streams); under load a step takes "
          f"{service.step_alpha:.3f} x the step model + {service.step_const_s * 1e3:.2f} ms + "
          f"{service.step_per_seq_s * 1e3:.3f} ms per sequence ({details['loaded'].get('steps', 0)} "
          f"steps) in {time.perf_counter() - t0:.1f} s; the forward by sequences per step: "
          + ", ".join(f"x{f:.3f} from {lo}" for lo, f in service.step_seq_factors))
    return service.to_dict(), details


# -- The LLM routes' serving path ------------------------------------------------------------------
# The LLM routes' serving path: what a live step and a client's first token cost beyond the step profile.
#
# The step profile times forward + sampling of a step shape alone. ``measure_llm_serving_path`` serves the
# real app (``create_app`` with the LLM router, as ``serve --llm`` mounts it) on a free 127.0.0.1 port in
# this process and measures, with its own traffic, before any traffic it predicts:
#
# 1. **The first-token delay.** ``REQUESTS`` streamed completions of token-id prompts of spread lengths,
#    sent one at a time, ``LONE_GAP_S`` apart, from a client process placed as ``bench`` places its load
#    generator (``profile.serving.lone_elsewhere``): no queueing anywhere; per request the client's TTFT
#    minus the engine's (the ``engine`` part of the first chunk's ``Server-Timing`` header). The median
#    is ``first_token_delay_s``.
#    Later tokens pay the same path, so it moves every token alike and TPOT is unchanged.
# 2. **Steps under load.** ``LOADED_REQUESTS`` streamed completions (prompts spread 16-512 tokens, outputs
#    16-128) open-loop from a child process (on the cores this process is not pinned to, when there are
#    any, as
#    ``bench`` runs its load generator), seeded Poisson in segments alternating between ``LOADED_SHARES``
#    of the
#    rate at which the engine would serve them one at a time (from the step profile): about 1, 5-15, 3-5 and
#    10-30 sequences per step, with requests arriving while they run. Each share runs in two segments of
#    its own, so that the decode-only steps at 4-31 sequences, the counts a loaded server runs most,
#    number several hundred per bin of ``step_seq_factors`` and are spread over the phase, not taken in
#    one stretch of the machine's speed. A live step of many sequences usually has new
#    requests arriving beside it (their HTTP, tokenising, first chunks on the same cores), and such steps ran
#    slower than those of a burst's walk-down, where every stream arrived at the start (docs/benchmarks.md,
#    conv-llm). Then ``BURST_ROUNDS`` bursts, one after another, of ``burst_streams`` streams (the engine's
#    ``max_num_seqs``, at most ``BURST_MAX_SEQS``, as many as its KV pool holds) arriving within
#    ``BURST_WINDOW_STEPS`` one-sequence decode steps: every stream of a burst runs at once and, as their
#    outputs (16-128 tokens) end, the steps walk down from that many sequences to one, the batch sizes a
#    loaded server runs. Every engine step is observed (``engine.step_observers``);
#    ``LLMServiceModel.fit_steps`` turns them into the speed of the forward under load (``step_alpha``)
#    and what a busy step costs beyond it (``step_const_s + step_per_seq_s * seqs``: scheduling,
#    detokenising and delivering each token, the event loop streaming it on the same cores, the gap to
#    the next step), measured over the sequences per step observed (``loaded``: ``mean_seqs``,
#    ``p90_seqs``, ``max_seqs``).

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
                             burst: int | None = None) -> tuple[LLMServiceModel, dict[str, Any]]:
    """Serve ``engine`` (started) in-process and measure its serving path (module docstring) against the
    step profile ``cost_model``. ``burst``: the burst's streams (None: ``burst_streams`` of the engine's
    config; 0: no burst); ``loaded_requests`` 0 skips the loaded phase, burst included. Returns the
    ``LLMServiceModel`` and a JSON-ready dict of what was measured."""
    from batchpilot.server.llm.routes import make_llm_router

    top = min(int(engine.config.max_model_len) - OUTPUT_TOKENS - 1, 512)
    lengths = [int(x) for x in np.linspace(16, max(top, 16), requests)]
    wl = Workload.from_columns("llm-serving-path", [0.0] * requests, lengths, [OUTPUT_TOKENS] * requests)
    plan = build_plan(wl, "completions", seed=seed)
    sock, port = bound_socket()
    app = create_app(ServerConfig(port=port, drain_timeout_s=5.0,
                                  serving=ServingOptions(request_timeout_s=60.0)),
                     [ServedModel(NoopExecutor())],
                     [MountedEngine(lambda registry: make_llm_router(engine, registry), engine.model_name)])
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
    service, loaded = LLMServiceModel.fit_steps(
        cost_model, [r.start for r in steps], [r.forward_s for r in steps], [r.wall_s for r in steps],
        [r.num_seqs for r in steps], [r.features for r in steps], [r.after_idle for r in steps],
        first_token_delay_s=delay)
    return service, {"first_token": lone, "loaded": loaded, "loaded_requests": loaded_requests,
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
