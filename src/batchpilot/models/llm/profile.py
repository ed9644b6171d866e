"""Measure real LLM steps and fit the step cost model the simulator and planner use.

Synthetic steps over the runner's own KV cache: pure prefills of several lengths, pure decode batches
at several context lengths, and mixes of both. Each point is timed (forward + greedy sampling, the
engine's hot path) and ``CostModel.fit(points, LLM_FEATURES)`` turns them into
``const + prefill_tokens + decode_seqs + kv_tokens + prefill_attn + multi_row`` coefficients,
JSON-serialisable, loadable by ``batchpilot simulate --workload conv-llm --profile``.
A runner with swap space also gets its block copies timed (``measure_swap``), recorded in the profile's
``meta`` (``core.preemption.SWAP_META_KEYS``).

``probe_preemption_costs(runner)`` is the engine's start-up probe for ``preemption: auto`` (through
``engine_preemption_costs``): the swap copies and a few short prefills into ``PreemptionCosts``, a
fraction of a second on the tiny Llama on 2 CPU cores.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from batchpilot.core.costmodel import LLM_FEATURES, CostModel, ProfilePoint, nonneg_lstsq
from batchpilot.core.llm_config import LLMSchedulerConfig
from batchpilot.core.llm_scheduler import ScheduledChunk, StepPlan
from batchpilot.core.preemption import SWAP_META_KEYS, PreemptionCosts
from batchpilot.models.llm.model_runner import LLMModelRunner


def _plan(runner: LLMModelRunner, prefills: Sequence[int], decodes: int, decode_ctx: int) -> StepPlan:
    return step_plan(runner, prefills, [decode_ctx] * decodes)


def step_plan(runner: LLMModelRunner, prefills: Sequence[int], decode_contexts: Sequence[int]) -> StepPlan:
    """A synthetic step over ``runner``'s pool (block tables wrap around it): one decode at each of
    ``decode_contexts`` and a fresh prefill chunk of each of ``prefills`` tokens, its decodes in runs
    of the runner's ``decode_run_tokens``."""
    bs = runner.block_size
    next_block = 0
    chunks = []

    def table(n_tokens: int) -> list[int]:
        nonlocal next_block
        nb = -(-n_tokens // bs)
        blocks = [(next_block + i) % runner.num_kv_blocks for i in range(nb)]
        next_block += nb
        return blocks

    sid = 0
    for ctx in decode_contexts:
        chunks.append(ScheduledChunk(sid, ctx - 1, [5], table(ctx), True, True))
        sid += 1
    for n in prefills:
        chunks.append(ScheduledChunk(sid, 0, [7] * n, table(n), True, False))
        sid += 1
    return StepPlan(step_id=0, chunks=chunks, decode_run_tokens=runner.decode_run_tokens)


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
    mostly run. ``benchmarks/llm_step_model.py`` prices shapes outside the grid with the fitted model."""
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
        # ones and bends the fit; round-robin it scales every shape alike (a speed, which ``bench fidelity``
        # reports as "speed vs profile")
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


def _sync(runner: LLMModelRunner) -> None:
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)


def measure_swap(runner: LLMModelRunner, num_blocks: int = 16, repeats: int = 5) -> tuple[float, float]:
    """Median seconds per block of ``runner.swap`` copying ``num_blocks`` blocks (capped by both pools)
    device -> host and host -> device: ``(out_s_per_block, in_s_per_block)``. Overwrites the first
    blocks of both pools: call it with no sequence in the cache (start-up, profiling)."""
    k = min(num_blocks, runner.num_kv_blocks, runner.num_swap_blocks)
    if k < 1:
        raise ValueError("measure_swap: the runner has no swap blocks to copy to")
    pairs = [(b, b) for b in range(k)]
    runner.swap(pairs, pairs)  # warm-up: first touch of the host pages, allocator
    outs, ins = [], []
    for _ in range(repeats):
        _sync(runner)
        t0 = time.perf_counter()
        runner.swap(pairs, [])
        _sync(runner)
        t1 = time.perf_counter()
        runner.swap([], pairs)
        _sync(runner)
        outs.append(t1 - t0)
        ins.append(time.perf_counter() - t1)
    return sorted(outs)[repeats // 2] / k, sorted(ins)[repeats // 2] / k


def measure_prefill(runner: LLMModelRunner, max_len: int = 128, repeats: int = 5) -> tuple[float, float]:
    """Seconds per prefill token and per unit of prefill attention (``T * T`` for a prompt of ``T``):
    ``(a, b)`` of ``const + a T + b T^2`` fitted (least squares, non-negative) on single prefills of 1,
    1/4, 1/2 and all of ``max_len`` tokens (capped by the pool and the positions), the step's fixed
    cost left out. Timed round-robin, the fastest of ``repeats`` per length: on shared cores a step's
    time only ever gains from other work, so the minimum is the runner's own cost."""
    top = max(4, min(max_len, runner.num_kv_blocks * runner.block_size, runner.w.max_position_embeddings))
    sizes = sorted({1, top // 4, top // 2, top})
    plans = [_plan(runner, [n], 0, 0) for n in sizes]
    best = [math.inf] * len(plans)
    with torch.inference_mode():
        for plan in plans:
            runner.forward(plan.chunks).argmax(-1).tolist()  # warm-up
        for _ in range(repeats):
            for k, plan in enumerate(plans):
                t0 = time.perf_counter()
                runner.forward(plan.chunks).argmax(-1).tolist()
                best[k] = min(best[k], time.perf_counter() - t0)
    x = np.array([[1.0, n, n * n] for n in sizes])
    _, per_token, per_attn = nonneg_lstsq(x, np.array(best))
    if per_token == 0.0 and per_attn == 0.0:  # noise flattened the curve: the mean cost of a token
        per_token = max(best[-1] - best[0], best[-1] / 2) / (sizes[-1] - sizes[0])
    return float(per_token), float(per_attn)


def probe_preemption_costs(runner: LLMModelRunner, cost_model: CostModel | None = None) -> PreemptionCosts:
    """What swapping and recomputing cost on this runner: ``measure_swap`` for the copies, and the
    recompute price from ``cost_model`` (an LLM step profile) when given, else ``measure_prefill``."""
    out_s, in_s = measure_swap(runner)
    if cost_model is not None:
        return PreemptionCosts.from_cost_model(cost_model, out_s, in_s)
    per_token, per_attn = measure_prefill(runner)
    return PreemptionCosts(out_s, in_s, per_token, per_attn)


def engine_preemption_costs(runner: Any, config: LLMSchedulerConfig, given: PreemptionCosts | None = None,
                            cost_model: CostModel | None = None) -> PreemptionCosts | None:
    """The costs an engine's scheduler weighs swap against recompute with: ``given`` (e.g.
    ``probe_preemption_costs(runner, profile)`` to price recompute from a step profile); else what this
    runner measured for an earlier engine (``runner.preemption_costs``: a rebuilt engine does not probe
    again); else, for ``preemption: auto`` with swap blocks, ``probe_preemption_costs(runner,
    cost_model)`` (kept on the runner); else None (no comparison to make). Raises ``ValueError`` when
    the config has more swap blocks than the runner holds."""
    have = getattr(runner, "num_swap_blocks", 0)
    if config.num_swap_blocks > have:
        raise ValueError(f"llm engine: the scheduler has {config.num_swap_blocks} swap blocks, the runner "
                         f"{have}; build the runner with num_swap_blocks")
    costs = given or getattr(runner, "preemption_costs", None)
    if costs is None and config.preemption == "auto" and config.num_swap_blocks:
        costs = probe_preemption_costs(runner, cost_model)
    if costs is not None and hasattr(runner, "preemption_costs"):
        runner.preemption_costs = costs
    return costs
