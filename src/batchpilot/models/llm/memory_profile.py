"""What an LLM engine's memory is made of, measured on its runner: the input of ``core/kv_plan.py``.

* weights: the bytes of the runner's tensors (fused weights, embeddings, RoPE tables), counted once;
* KV bytes per token: K and V over every layer, from the cache's own shape and dtype;
* the activation peak of a step (``measure_memory``): every tensor a step allocates above what was
  live when it started, measured by ``models.device.peak_memory_bytes`` (CUDA: the caching
  allocator's high-water mark; CPU: the allocator's events under ``torch.profiler``) on synthetic
  steps: prefills of several lengths (linear in batched tokens), decode batches at several
  contexts (the gather of their keys and values: linear in the context tokens of the largest
  decode group, which the runner's reused buffers hold), and prefill chunks past position 0 (chunked
  prefill, a prefix-cache hit: a gather of their context, a mask and scores of tokens x context). A
  least-squares fit ``fixed + per_token x tokens + per_read_token x read + per_attn x tokens x
  context`` is shifted up by its largest miss, so it
  is at or above every measured step; on CPU the fixed term also takes what running the same steps on
  a fresh thread leaves resident beyond the tensors (``thread_residual``: the allocator arena the
  engine's own thread will hold).

The runner's gather buffers outlive a step (they are reused); each shape is measured with them
released, so the gather it needs is counted, not hidden by a buffer an earlier shape grew.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from batchpilot.core.kv_plan import MemoryProfile
from batchpilot.core.llm_plan import ScheduledChunk, StepPlan, decode_groups
from batchpilot.models.device import peak_memory_bytes
from batchpilot.models.llm.model_runner import LLMModelRunner


def _tensor_bytes(tensors: Sequence[torch.Tensor]) -> int:
    seen: set[int] = set()
    total = 0
    for t in tensors:
        key = t.untyped_storage().data_ptr()
        if key in seen:
            continue
        seen.add(key)
        total += t.untyped_storage().nbytes()
    return total


def weights_bytes(runner: LLMModelRunner) -> int:
    """Bytes of the runner's model tensors (shared storages once), RoPE tables included."""
    w = runner.w
    tensors = [w.embed, w.norm, w.lm_head, runner.cos, runner.sin]
    for layer in w.layers:
        tensors += [layer.input_norm, layer.qkv, layer.o, layer.post_norm, layer.gate_up, layer.down]
    return _tensor_bytes(tensors)


def kv_bytes_per_token(runner: LLMModelRunner) -> int:
    """K and V of one token over every layer."""
    k = runner.k_cache
    return 2 * k.shape[0] * k.shape[2] * k.shape[3] * k.element_size()


def model_memory(runner: LLMModelRunner) -> MemoryProfile:
    """Weights and KV bytes per token, exact from the tensors; no activation terms (``source="none"``)."""
    return MemoryProfile(weights_bytes(runner), kv_bytes_per_token(runner))


def weights_memory(weights: Any, dtype: torch.dtype) -> MemoryProfile:
    """``model_memory`` before any runner exists: the loaded weights (already in ``dtype``, as the loader
    gives them and the runner keeps them) and the RoPE tables the runner will build, KV bytes from the
    model's shape."""
    w = weights
    tensors = [w.embed, w.norm, w.lm_head]
    for layer in w.layers:
        tensors += [layer.input_norm, layer.qkv, layer.o, layer.post_norm, layer.gate_up, layer.down]
    size = torch.empty(0, dtype=dtype).element_size()
    rope = 2 * w.max_position_embeddings * w.head_dim * size
    kv = 2 * len(w.layers) * w.num_kv_heads * w.head_dim * size
    return MemoryProfile(_tensor_bytes(tensors) + rope, kv)


def read_tokens(plan: StepPlan) -> int:
    """Context tokens the step's largest gather holds: decodes sorted by context are split into groups
    (the runner's ``decode_groups``), each padded to its longest, and a prefill chunk past position 0
    gathers its context; each is gathered in turn into the same reused buffers, so the largest is what
    occupies memory."""
    ctx = sorted(c.context_len for c in plan.chunks if c.is_decode)
    late = [c.context_len for c in plan.chunks if not c.is_decode and c.start > 0]
    runs = decode_groups(ctx, plan.decode_run_tokens)
    return max([(b - a) * ctx[b - 1] for a, b in runs] + late, default=0)


def attn_units(plan: StepPlan) -> int:
    """The largest ``tokens x context`` of a prefill chunk past position 0 (its mask and scores)."""
    return max((c.num_tokens * c.context_len for c in plan.chunks if not c.is_decode and c.start > 0),
               default=0)


def _plan(runner: LLMModelRunner, prefill: int, decodes: int, ctx: int, start: int = 0) -> StepPlan:
    bs, nb = runner.block_size, runner.num_kv_blocks
    chunks, nxt = [], 0
    for i in range(decodes):
        blocks = -(-ctx // bs)
        chunks.append(ScheduledChunk(i, ctx - 1, [5], [(nxt + j) % nb for j in range(blocks)], True, True))
        nxt += blocks
    if prefill:
        blocks = -(-(start + prefill) // bs)
        chunks.append(ScheduledChunk(decodes, start, [7] * prefill, [(nxt + j) % nb for j in range(blocks)],
                                     True, False))
    return StepPlan(step_id=0, chunks=chunks, decode_run_tokens=runner.decode_run_tokens)


def _measure(runner: LLMModelRunner, plan: StepPlan) -> float:
    def step() -> None:
        runner.forward(plan.chunks).argmax(-1)

    with torch.inference_mode():
        step()  # warm-up: first calls of a shape allocate caches of their own
        runner.release_buffers()
        return peak_memory_bytes(step, runner.device)


def thread_residual(runner: LLMModelRunner, plans: Sequence[StepPlan], tensor_peak: float) -> float:
    """CPU only: the resident growth of running ``plans`` on a fresh thread (as the engine's own thread
    does) beyond the largest tensor peak. A new thread allocates from a malloc arena of its own, whose
    pages stay resident (``keep_freed_memory``) and which the tensor accounting cannot see; 0 on CUDA."""
    if runner.device.type != "cpu":
        return 0.0
    import threading

    from batchpilot.models.device import used_memory_bytes

    before = used_memory_bytes(runner.device)

    def run() -> None:
        with torch.inference_mode():
            for plan in plans:
                runner.forward(plan.chunks).argmax(-1)

    t = threading.Thread(target=run, name="memory-probe")
    t.start()
    t.join()
    runner.release_buffers()
    return max(0.0, used_memory_bytes(runner.device) - before - tensor_peak)


def measure_memory(runner: LLMModelRunner, prefill_tokens: Sequence[int] = (32, 64, 128, 256, 512),
                   decode_shapes: Sequence[tuple[int, int]] = ((8, 64), (8, 256), (4, 1024), (16, 128),
                                                               (8, 512)),
                   late_chunks: Sequence[tuple[int, int]] = ((128, 384), (256, 768), (512, 1024),
                                                             (128, 1920)),
                   ) -> tuple[MemoryProfile, list[dict[str, float]]]:
    """The runner's ``MemoryProfile`` with measured activation terms, and the measured points
    (``tokens``, ``read``, ``attn``, ``peak_bytes``, ``fit_bytes``). Decode shapes are ``(sequences,
    context)``, late chunks ``(tokens, start)``;
    shapes that do not fit the runner's pool or the model's positions are left out."""
    pool = runner.num_kv_blocks * runner.block_size
    positions = runner.cos.shape[0]  # the model's position limit
    plans = [_plan(runner, n, 0, 0) for n in prefill_tokens if n <= min(pool, positions)]
    plans += [_plan(runner, 0, b, c) for b, c in decode_shapes if b * c <= pool and 1 < c <= positions]
    plans += [_plan(runner, n, 0, 0, start) for n, start in late_chunks if start + n <= min(pool, positions)]
    rows, peaks = [], []
    for plan in plans:
        rows.append((1.0, float(plan.num_batched_tokens), float(read_tokens(plan)), float(attn_units(plan))))
        peaks.append(_measure(runner, plan))
    runner.release_buffers()
    x, y = np.array(rows), np.array(peaks)
    coef = np.clip(np.linalg.lstsq(x, y, rcond=None)[0], 0.0, None)
    coef[0] += max(0.0, float((y - x @ coef).max()))  # at or above every measured step
    coef[0] += thread_residual(runner, plans, float(y.max()))
    fit = x @ coef
    points = [{"tokens": r[1], "read": r[2], "attn": r[3], "peak_bytes": float(p), "fit_bytes": float(f)}
              for r, p, f in zip(rows, peaks, fit, strict=True)]
    base = model_memory(runner)
    profile = MemoryProfile(base.weights_bytes, base.kv_bytes_per_token, float(coef[0]), float(coef[1]),
                            float(coef[2]), source="measured", activation_bytes_per_attn=float(coef[3]))
    return profile, points
