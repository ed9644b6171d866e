"""Measure real LLM steps and fit the step cost model the simulator and planner use.

Synthetic steps over the runner's own KV cache: pure prefills of several lengths, pure decode batches
at several context lengths, and mixes of both. Each point is timed (forward + greedy sampling, the
engine's hot path) and ``CostModel.fit(points, LLM_FEATURES)`` turns them into
``const + prefill_tokens + decode_seqs + kv_tokens + prefill_attn`` coefficients, JSON-serialisable,
loadable by ``batchpilot simulate --workload conv-llm --profile``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from ...core.costmodel import LLM_FEATURES, CostModel, ProfilePoint
from ...core.llm_scheduler import ScheduledChunk, StepPlan
from .model_runner import LLMModelRunner


def _plan(runner: LLMModelRunner, prefills: Sequence[int], decodes: int, decode_ctx: int) -> StepPlan:
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
    for _ in range(decodes):
        chunks.append(ScheduledChunk(sid, decode_ctx - 1, [5], table(decode_ctx), True, True))
        sid += 1
    for n in prefills:
        chunks.append(ScheduledChunk(sid, 0, [7] * n, table(n), True, False))
        sid += 1
    return StepPlan(step_id=0, chunks=chunks)


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
                      decode_batches: Sequence[int] = (1, 2, 4, 8, 16, 32, 64),
                      decode_contexts: Sequence[int] = (64, 256, 1024),
                      mixed_prefills: Sequence[int] = (32, 128, 256),
                      mixed_decodes: Sequence[int] = (1, 4, 16),
                      repeats: int = 7) -> CostModel:
    """Time pure prefills, pure decode batches at several contexts, and mixed steps (a prefill chunk
    beside decodes, what a continuous batch mostly runs), then fit the step model.

    The grid covers the region a small continuous batch lives in (1-16 decodes, prompts of tens to
    hundreds of tokens) densely: a grid of 12 points (prefills 16/128/512, decodes 1/16/64) left the
    fixed cost undetermined, 8 ms in one profile and 13 ms in the next on the same machine. Ten prompt
    lengths: with six, the split between ``prefill_tokens`` and ``prefill_attn`` moved 17x between two
    profiles."""
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
    return CostModel.fit(points, LLM_FEATURES, meta={"source": "profile_llm_steps",
                                                     "block_size": runner.block_size,
                                                     "points": len(points), "repeats": repeats,
                                                     "threads": torch.get_num_threads()})
