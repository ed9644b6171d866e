"""Runs one scheduler step on a decoder (a family of ``weights.FAMILIES``) over a paged KV cache.

Every token of the step (prefill chunks and decodes alike) goes through the dense layers as one
packed ``[T, D]`` matrix: no padding between chunks, two fused matmuls per block (qkv, gate_up) plus o
and down (``dense.Dense``: through oneDNN's packed weights where that measured faster); ``row_plan``
(the row plan section) may add up to three rows to ``T`` where the matmuls run faster with them, rows
never written to the cache, attended to or sampled. Only attention differs by chunk kind, and it reads
keys/values through block tables:

* decodes (1-token chunks): sorted by context length and split into runs of at most
  ``decode_run_tokens`` padded keys (``core.llm.scheduler.decode_groups``), one
  batched SDPA each (so short contexts are not padded to the longest). Keys are gathered block-wise
  into ``[B, KV, L_max, hd]`` with a length mask (none when every context is ``L_max``); the query heads of
  a GQA group are folded into the query axis (``[B, KV, G, hd]``) so the KV heads are never repeated.
* prefill chunks: one SDPA each. A chunk starting at position 0 attends over its own fresh keys with
  ``is_causal``; a later chunk (chunked prefill, prefix-cache hit) gathers its context from the cache
  and uses an offset causal mask.

A layer with a sliding window (``LayerWeights.window``) masks the keys more than ``window - 1`` positions
behind each query; the cache still holds them (no block is freed for falling out of a window). A layer
that soft-caps its attention scores (Gemma 2) runs the same attention spelled out (``_attend``), since
SDPA cannot cap. The family's other terms (q/k/v bias, q/k norms, Gemma's norms, scaled embeddings,
activation, final soft-cap) are data of the weights, applied in ``_layer`` and ``_logits``.

Each layer writes the step's K/V into the cache (``index_copy_`` on slot numbers
``block_table[pos // bs] * bs + pos % bs``) before attention reads it. The cache has its own precision
(``kv_dtype``, default the weights'): K/V are rounded to it when written, and attention over cached keys
runs at it (the queries rounded to it, the output back to the weights' precision), so a float16 cache
beside float32 weights is read once at half the bytes. Logits are computed only for chunks that sample
(the last token of a finished prefill, every decode).

The cost of a step on a CPU, beyond its matmuls, is the number of small ops: each costs microseconds of
dispatch, and the first op after a matmul that streamed megabytes of weights runs with cold caches. So
q and k are RoPE'd together (``_rope``: one roll), an RMSNorm is one ``torch.rms_norm``, a step of one
decode run attends without a mask or an output copy where it can, and the step's layout is built in
numpy, one tensor per kind.

Swap space: ``num_swap_blocks`` host blocks of K and V (``[layers, blocks, block_size, kv_heads,
head_dim]``, pinned memory beside a CUDA cache, plain ``torch.empty`` on CPU so swap space never used
costs no resident memory). ``swap(out_pairs, in_pairs)`` makes a plan's block copies, whole blocks per
layer; the driver calls it before the step's ``forward``.

Sections, in order: the row plan (the token row counts the dense layers run fastest at), the runner,
and what is measured on a runner (its memory, the preemption and prefill costs the engine prices with).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from batchpilot.core.costmodel import CostModel, nonneg_lstsq
from batchpilot.core.llm.config import DECODE_RUN_TOKENS, LLMSchedulerConfig, MemoryProfile
from batchpilot.core.llm.scheduler import PreemptionCosts, ScheduledChunk, StepPlan, decode_groups
from batchpilot.models.device import peak_memory_bytes
from batchpilot.models.llm.dense import Dense
from batchpilot.models.llm.weights import ACTIVATIONS, LayerWeights, LlamaWeights

# -- The row plan ----------------------------------------------------------------------------------
# The row counts a step's dense layers run fastest at, measured on the runner's own weights.
#
# Every token of a step goes through the dense layers as one ``[T, D]`` matrix (``model_runner``). A
# matrix multiply's time need not be monotone in its row count: the BLAS kernels work in tiles of rows,
# and a kernel for a few rows can cost more than the next tile. Whether it does is the machine's and the
# layout's: with oneDNN's any-row layout (``dense.py``) on an AMD EPYC the tiny Llama's matrices ran
# 1, 2 and 4 rows in 2.53, 2.64 and 2.72 ms (``benchmarks/llm_step.py``'s layouts table), flat within
# noise, and the plan pads nothing there. So it is measured.
#
# ``RowPlan.measure`` times the matmuls every token row pays (qkv, o, gate_up, down of every layer: all
# of them, so the weights stream from memory as in a step, where one layer's alone would stay in the
# caches and misjudge one row, a matrix x vector, against four) for each row count up to ``MAX_ROWS +
# LOOKAHEAD``, and ``rows(t)`` is the count the runner pads a step of ``t`` rows to: the cheapest count
# in ``[t, t + LOOKAHEAD]`` when it is at least ``MARGIN`` faster than ``t`` itself, else ``t``: a
# count's time is the fastest of ``REPEATS`` runs (other work on shared cores only ever adds to it),
# and the margin is wide because padding rows also cost every op of the step beyond the matmuls and a
# flat curve must not be padded on noise. The
# padding rows are computed and discarded (``model_runner``: never written to the KV cache, never
# attended to, never sampled). Above ``MAX_ROWS`` (mostly steps with a prefill chunk, where a few rows
# are a small share) rows are not padded. ``RowPlan()`` pads nothing: a runner built without a plan
# runs its exact row counts.

MAX_ROWS = 32  # padded up to here (decodes and short chunks: where a tile's rows are a large share)
LOOKAHEAD = 3  # at most this many padding rows
MARGIN = 0.10  # pad only when the padded count is at least this much faster
REPEATS = 5  # timed runs per row count (the fastest counts); one untimed run first


@dataclass(frozen=True)
class RowPlan:
    """``pad_to[t]``: the rows a step of ``t`` token rows runs (``t < len(pad_to)``); ``t`` beyond."""

    pad_to: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        bad = [t for t, p in enumerate(self.pad_to) if p < t]
        if bad:
            t = bad[0]
            raise ValueError(f"row plan: pad_to[{t}] = {self.pad_to[t]} is fewer rows than {t}")

    def rows(self, t: int) -> int:
        return self.pad_to[t] if 0 <= t < len(self.pad_to) else t

    def padded(self) -> dict[int, int]:
        """The counts that are padded, and to what (for logs and the profile's meta)."""
        return {t: p for t, p in enumerate(self.pad_to) if p != t}

    @classmethod
    def from_times(cls, seconds: Sequence[float], max_rows: int = MAX_ROWS, lookahead: int = LOOKAHEAD,
                   margin: float = MARGIN) -> RowPlan:
        """The plan from ``seconds[t]``, the dense layers' time at ``t`` rows (``seconds[0]`` unused),
        known up to ``max_rows + lookahead`` at least (module docstring)."""
        if len(seconds) < max_rows + lookahead + 1:
            raise ValueError(f"row plan: {len(seconds)} timings, need {max_rows + lookahead + 1}")
        pad_to = [0]
        for t in range(1, max_rows + 1):
            best = min(range(t, t + lookahead + 1), key=lambda r: (seconds[r], r))
            pad_to.append(best if seconds[best] < (1.0 - margin) * seconds[t] else t)
        return cls(tuple(pad_to))

    @classmethod
    def measure(cls, weights: Sequence[torch.Tensor | Dense], device: torch.device, dtype: torch.dtype,
                max_rows: int = MAX_ROWS, lookahead: int = LOOKAHEAD, repeats: int = REPEATS) -> RowPlan:
        """Time ``x @ w.T`` for every ``w`` of ``weights`` (the dense matrices, ``[out, in]``, or the
        runner's ``Dense`` matrices as they multiply, packed or not) at each row count, round-robin over
        the counts ``repeats`` times (a drift in the machine's speed then moves every count alike), and
        plan from each count's fastest run."""
        counts = range(1, max_rows + lookahead + 1)
        gen = torch.Generator(device="cpu").manual_seed(0)
        width = max(int(w.shape[1]) for w in weights)
        source = torch.randn(counts[-1], width, generator=gen).to(device, dtype)
        inputs = [[source[:t, : int(w.shape[1])].contiguous() for w in weights] for t in counts]
        runs: list[list[float]] = [[] for _ in counts]
        with torch.inference_mode():
            for xs in inputs:
                _matmuls(xs, weights)
            for _ in range(repeats):
                for xs, times in zip(inputs, runs, strict=True):
                    _sync(device)
                    t0 = time.perf_counter()
                    _matmuls(xs, weights)
                    _sync(device)
                    times.append(time.perf_counter() - t0)
        return cls.from_times([0.0] + [min(t) for t in runs], max_rows, lookahead)


def _matmuls(xs: Sequence[torch.Tensor], weights: Sequence[torch.Tensor | Dense]) -> None:
    for x, w in zip(xs, weights, strict=True):
        if isinstance(w, Dense):
            w(x)
        else:
            x @ w.T


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def keep_freed_memory() -> bool:
    """Tell glibc malloc to serve big blocks from the heap and never give freed memory back to the OS.

    A CPU step allocates multi-MB activations; with glibc defaults each one is a fresh ``mmap`` whose
    pages fault in on first touch, which measured ~25% of a decode/prefill step here. Process-wide and
    idempotent; a no-op (False) where glibc is not the allocator.
    """
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        libc = ctypes.CDLL(name)
        m_trim_threshold, m_mmap_threshold = -1, -3
        return bool(libc.mallopt(m_mmap_threshold, 1 << 30) and libc.mallopt(m_trim_threshold, 1 << 31))
    except (OSError, AttributeError):
        return False


def release_freed_memory() -> bool:
    """Hand the heap's free pages back to the OS now (glibc ``malloc_trim``), which ``keep_freed_memory``
    otherwise keeps: after a start-up probe, so its freed tensors are not counted as the engine's own.
    False where glibc is not the allocator."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        return bool(ctypes.CDLL(name).malloc_trim(0))
    except (OSError, AttributeError):
        return False


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # HF LlamaRMSNorm's float32 ``x * rsqrt(mean(x^2) + eps)``: torch.rms_norm gives it bit for bit in one
    # call (for token-identical greedy output), then the cast back and the weight, in HF's order (float32
    # rows: the weight in the same call, which is the same product; no casts to pay for)
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return torch.rms_norm(x, (x.shape[-1],), weight, eps)
    return weight * torch.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def _rms_norm_plus_one(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Gemma's RMSNorm (DecoderSpec.norm_plus_one): scaled by (1 + w) in float32, then cast, as HF does it
    return (torch.rms_norm(x.float(), (x.shape[-1],), eps=eps) * (1.0 + weight.float())).to(x.dtype)


def _rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """HF's ``x * cos + rotate_half(x) * sin``, with ``rotate_half(x) = cat(-x2, x1)`` written as
    ``roll(x, half) * signed_sin`` (the sin table's first half negated, ``_rope_table``): the same
    products and sums, bit for bit, in four ops instead of seven."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


def _softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    return torch.tanh(x / cap) * cap


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
            softcap: float | None, causal: bool = True) -> torch.Tensor:
    """``q`` over ``k``/``v`` where ``mask`` is True (None: causal over a fresh chunk's own keys, or, with
    ``causal`` False, every key). SDPA, unless the layer soft-caps its scores, which SDPA cannot: then
    spelled out in HF eager's order (scale, ``tanh(s / c) * c``, mask, softmax in float32)."""
    if softcap is None:
        if mask is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    scores = _softcap(torch.matmul(q, k.transpose(-1, -2)) * scale, softcap)
    if mask is None and causal:
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)


Window = int | None  # a layer's sliding window (LayerWeights.window); None: full attention


@dataclass
class DecodeRun:
    """Decodes in rows ``r0:r1`` (sorted by context), attended as one batch over the first ``length`` keys
    of their gathered ``blocks`` (each run's tables padded to its longest; ``length`` its longest
    context)."""

    r0: int
    r1: int
    blocks: torch.Tensor
    length: int
    # per layer window: the keys each decode sees, [n, 1, 1, length]; None: every one (all contexts are
    # ``length`` long, within the window)
    masks: dict[Window, torch.Tensor | None]


@dataclass
class PrefillRun:
    """A prefill chunk in rows ``r0:r1`` over positions ``start:stop``; one from position 0 attends to its own
    fresh keys (``ctx_blocks`` None), a later one gathers positions ``0:stop`` from the cache."""

    r0: int
    r1: int
    stop: int
    ctx_blocks: torch.Tensor | None
    masks: dict[Window, torch.Tensor | None]  # per layer window, [tokens, stop]; None: plain causal


@dataclass
class StepLayout:
    """Where a step's chunks sit in the packed ``[T, D]`` rows, and what every layer's attention reads."""

    decodes: list[ScheduledChunk]  # rows 0..len-1, sorted by context
    prefills: list[ScheduledChunk]  # then each chunk's rows contiguously
    ids: torch.Tensor  # [T] token ids, padding rows (RowPlan) last
    slots: torch.Tensor  # [real] cache slots of the real rows
    real: int
    rope: list[tuple[torch.Tensor, torch.Tensor]]  # (cos, sin) [T, 1, hd] per RoPE table
    decode_runs: list[DecodeRun]
    prefill_runs: list[PrefillRun]


@dataclass
class LayerDense:
    """A layer's four dense matrices as the runner multiplies by them (``dense.Dense``: plain or packed)."""

    qkv: Dense  # with the layer's q/k/v bias, where its family has one
    o: Dense
    gate_up: Dense
    down: Dense

    def all(self) -> tuple[Dense, ...]:
        return (self.qkv, self.o, self.gate_up, self.down)


class LLMModelRunner:
    """Owns the weights and the KV cache (``[layers, slots, kv_heads, head_dim]`` for K and for V).

    ``dtype`` is the weights' and the activations'; ``kv_dtype`` the cache's (default: ``dtype``): keys
    and values are rounded to it when written, and attention over them runs at it. ``packed``: the dense
    matrices multiply through oneDNN's packed copies (``dense.py``; ``dense.packing_pays`` measures
    whether that pays)."""

    def __init__(self, weights: LlamaWeights, num_kv_blocks: int, block_size: int,
                 device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                 decode_run_tokens: int = DECODE_RUN_TOKENS, num_swap_blocks: int = 0,
                 kv_dtype: torch.dtype | None = None, packed: bool = False) -> None:
        self.decode_run_tokens = decode_run_tokens
        self.threads: int | None = None  # CPU intra-op threads of the threads that run it (None: every core)
        self.row_plan = RowPlan()  # the row counts the dense layers run (RowPlan; none padded)
        self.rows_run = 0  # the token rows the last forward's dense layers ran, padding included
        self.max_gather_tokens = 0  # the most context tokens one gather holds (0: unbounded doubling)
        self.kv_dtype = kv_dtype or dtype
        self._buffers = [torch.empty(0, dtype=self.kv_dtype, device=device) for _ in range(2)]
        self.device = torch.device(device)
        self.dtype = dtype
        self.block_size = block_size
        self.num_kv_blocks = num_kv_blocks
        w = weights
        self.w = w
        tied = w.lm_head.data_ptr() == w.embed.data_ptr()  # one tensor (Gemma), kept one on the device
        for name in ("embed", "norm", "lm_head"):
            setattr(w, name, getattr(w, name).to(self.device, dtype))
        if tied:
            w.lm_head = w.embed
        for layer in w.layers:
            for name in LayerWeights.TENSORS:
                if getattr(layer, name) is not None:
                    setattr(layer, name, getattr(layer, name).to(self.device, dtype))
        self.num_heads, self.num_kv_heads, self.head_dim = w.num_heads, w.num_kv_heads, w.head_dim
        self.group = self.num_heads // self.num_kv_heads
        self.pack(packed)
        self.precision: Any = None  # the builder's LLMPrecisionReport: how this precision was chosen
        shape = (len(w.layers), num_kv_blocks * block_size, self.num_kv_heads, self.head_dim)
        self.k_cache = torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
        self.v_cache = torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
        self.num_swap_blocks = num_swap_blocks
        self.preemption_costs: PreemptionCosts | None = None  # measured on this runner by its first engine
        host = (len(w.layers), num_swap_blocks, block_size, self.num_kv_heads, self.head_dim)
        pin = self.device.type == "cuda"
        self.k_swap = torch.empty(host, dtype=self.kv_dtype, pin_memory=pin)
        self.v_swap = torch.empty(host, dtype=self.kv_dtype, pin_memory=pin)
        # RoPE tables: [0] every layer's, [1] the sliding layers' where they have their own (Gemma 3)
        self.rope = [self._rope_table(w.inv_freq, w.attention_scaling)]
        if w.local_inv_freq is not None:
            self.rope.append(self._rope_table(w.local_inv_freq, w.local_attention_scaling))
        self.cos, self.sin = self.rope[0]
        self.scale = w.attn_scale or self.head_dim**-0.5
        # what the family adds, as the functions and constants the layers apply (weights.DecoderSpec)
        self.norm = _rms_norm_plus_one if w.spec.norm_plus_one else _rms_norm
        self.act = ACTIVATIONS[w.activation]
        scale = w.embed.shape[1] ** 0.5 if w.spec.embed_scaled else None  # HF rounds it to the dtype too
        self.embed_scale = None if scale is None else torch.tensor(scale, dtype=dtype, device=self.device)
        self.windows: list[Window] = sorted({layer.window for layer in w.layers}, key=lambda x: x or 0)

    def _rope_table(self, inv_freq: torch.Tensor, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.arange(self.w.max_position_embeddings, dtype=torch.float32)
        freqs = pos[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos() * scaling, emb.sin() * scaling
        sin[:, : sin.shape[1] // 2] *= -1  # signed: rotate_half's negation folded in (``_rope``)
        return cos.to(self.device, self.dtype), sin.to(self.device, self.dtype)

    def pack(self, packed: bool) -> None:
        """Multiply by oneDNN's packed copies of the dense matrices (``dense.py``), or by the plain ones."""
        self.packed = packed

        def dense(w: torch.Tensor, bias: torch.Tensor | None = None) -> Dense:
            return Dense(w, bias, packed)

        self.dense = [LayerDense(dense(layer.qkv, layer.qkv_bias), dense(layer.o), dense(layer.gate_up),
                                 dense(layer.down)) for layer in self.w.layers]
        self.head = dense(self.w.lm_head)

    def share_dense(self, other: LLMModelRunner) -> None:
        """Multiply by ``other``'s matrices (the same weights: an arm of its engine), packed as it packs."""
        self.packed, self.dense, self.head = other.packed, other.dense, other.head

    def plan_rows(self) -> RowPlan:
        """Measure and keep the row counts the dense layers run fastest at (``RowPlan.measure`` on every
        layer's matrices, as they multiply; about 2 s for the tiny Llama on one CPU core)."""
        dense = [d for layer in self.dense for d in layer.all()]
        self.row_plan = RowPlan.measure(dense, self.device, self.dtype)
        return self.row_plan

    @property
    def kv_cache_bytes(self) -> int:
        return 2 * self.k_cache.numel() * self.k_cache.element_size()

    @property
    def swap_space_bytes(self) -> int:
        return 2 * self.k_swap.numel() * self.k_swap.element_size()

    @torch.inference_mode()
    def swap(self, out_pairs: Sequence[tuple[int, int]], in_pairs: Sequence[tuple[int, int]]) -> None:
        """Copy whole KV blocks, K and V of every layer: ``out_pairs`` ``(device_block, host_block)``
        first, then ``in_pairs`` ``(host_block, device_block)`` (``StepPlan.swap_out`` / ``swap_in``).
        Returns when the copies are done; the next ``forward`` may overwrite the swapped-out blocks."""
        bs, kv, hd = self.block_size, self.num_kv_heads, self.head_dim
        caches = ((self.k_cache, self.k_swap), (self.v_cache, self.v_swap))
        if out_pairs:
            src = torch.tensor([d for d, _ in out_pairs], device=self.device)
            dst = torch.tensor([h for _, h in out_pairs])
            for cache, host in caches:
                for li in range(cache.shape[0]):
                    blocks = cache[li].view(-1, bs, kv, hd).index_select(0, src)
                    host[li].index_copy_(0, dst, blocks.to("cpu"))
        if in_pairs:
            src = torch.tensor([h for h, _ in in_pairs])
            dst = torch.tensor([d for _, d in in_pairs], device=self.device)
            for cache, host in caches:
                for li in range(cache.shape[0]):
                    blocks = host[li].index_select(0, src).to(self.device)
                    cache[li].view(-1, bs, kv, hd).index_copy_(0, dst, blocks)

    def release_buffers(self) -> None:
        """Drop the reused gather buffers (the memory profiler measures each step's gather from zero)."""
        self._buffers = [torch.empty(0, dtype=self.kv_dtype, device=self.device) for _ in range(2)]

    def _gather(self, blocks_view: torch.Tensor, index: torch.Tensor, slot: int) -> torch.Tensor:
        """``index_select`` of whole blocks into a reused buffer: a fresh multi-MB tensor per call costs
        page faults that measured 3x the copy itself on CPU. Callers finish with a buffer before the
        next gather into the same ``slot`` (attention runs between), so reuse is safe."""
        shape = (index.numel(), *blocks_view.shape[1:])
        numel = shape[0] * blocks_view[0].numel()
        buf = self._buffers[slot]
        if buf.numel() < numel:
            # grow by doubling, but never past the largest gather a step can make (the memory plan's)
            grow = max(numel, 2 * buf.numel())
            if self.max_gather_tokens:
                grow = max(numel, min(grow, self.max_gather_tokens * blocks_view[0, 0].numel()))
            buf = torch.empty(grow, dtype=blocks_view.dtype, device=blocks_view.device)
            self._buffers[slot] = buf
        out = buf[:numel].view(shape)
        torch.index_select(blocks_view, 0, index, out=out)
        return out

    def _decode_groups(self, ctx_sorted: list[int]) -> list[tuple[int, int]]:
        """Split decodes (sorted by context) into runs padded to their own longest context: the core's
        rule (``core.llm.scheduler.decode_groups``), which the cost model's KV features count too."""
        return decode_groups(ctx_sorted, self.decode_run_tokens)

    @torch.inference_mode()
    def forward(self, chunks: Sequence[ScheduledChunk]) -> torch.Tensor:
        """Run one step; return float32 logits ``[num_sampling_chunks, vocab]`` in chunk order."""
        if not chunks:
            return torch.empty(0, self.w.vocab_size)
        step = self._layout(chunks)
        x = self.w.embed[step.ids]
        if self.embed_scale is not None:
            x = x * self.embed_scale
        for li, layer in enumerate(self.w.layers):
            x = self._layer(li, layer, x, step)
        return self._logits(x, chunks, step)

    def _layout(self, chunks: Sequence[ScheduledChunk]) -> StepLayout:
        """The step's rows, cache slots, RoPE rows and attention runs, built in numpy (one tensor each,
        not a few small tensors per sequence)."""
        dev, bs = self.device, self.block_size
        # decodes sorted by context length, so each run pads its gathered keys to a similar length
        decodes = sorted((c for c in chunks if c.num_tokens == 1), key=lambda c: c.context_len)
        prefills = [c for c in chunks if c.num_tokens > 1]
        ids = [c.token_ids[0] for c in decodes]
        positions = [c.start for c in decodes]
        slots = [c.block_table[p // bs] * bs + p % bs for c, p in zip(decodes, positions, strict=True)]
        pos_parts, slot_parts = [np.array(positions, dtype=np.int64)], [np.array(slots, dtype=np.int64)]
        for c in prefills:  # rows: decodes first, then each prefill chunk contiguously
            ids.extend(c.token_ids)
            pos = np.arange(c.start, c.context_len, dtype=np.int64)
            pos_parts.append(pos)
            slot_parts.append(np.asarray(c.block_table, dtype=np.int64)[pos // bs] * bs + pos % bs)
        real = len(ids)  # the step's token rows; the dense layers run runner.rows(real) (RowPlan)
        pad = self.row_plan.rows(real) - real
        self.rows_run = real + pad
        ids.extend([0] * pad)
        pos_parts.append(np.zeros(pad, dtype=np.int64))
        pos_t = torch.from_numpy(np.concatenate(pos_parts)).to(dev)
        decode_runs = [self._decode_run(decodes[g0:g1], g0)
                       for g0, g1 in self._decode_groups([c.context_len for c in decodes])]
        prefill_runs, row = [], len(decodes)
        for c in prefills:
            prefill_runs.append(self._prefill_run(c, row))
            row += c.num_tokens
        rope = [(cos.index_select(0, pos_t)[:, None, :], sin.index_select(0, pos_t)[:, None, :])
                for cos, sin in self.rope]
        return StepLayout(decodes, prefills, torch.tensor(ids, device=dev),
                          torch.from_numpy(np.concatenate(slot_parts)).to(dev), real, rope, decode_runs,
                          prefill_runs)

    def _decode_run(self, group: Sequence[ScheduledChunk], r0: int) -> DecodeRun:
        bs = self.block_size
        lengths = [c.context_len for c in group]
        longest = lengths[-1]  # the group is sorted by context
        max_blocks = -(-longest // bs)
        if lengths[0] == longest and all(w is None or longest <= w for w in self.windows):
            # every decode sees every key of the gather (a lone decode, a group of one length): no masks
            blocks = [b for c in group for b in c.block_table[:max_blocks]]
            return DecodeRun(r0, r0 + len(group), torch.tensor(blocks, device=self.device), longest,
                             dict.fromkeys(self.windows))
        ctx = np.array(lengths, dtype=np.int64)
        tables = np.zeros((len(group), max_blocks), dtype=np.int64)
        for i, c in enumerate(group):
            nb = -(-c.context_len // bs)
            tables[i, :nb] = c.block_table[:nb]
        keys = np.arange(longest)[None, :]
        seen = keys < ctx[:, None]
        equal = bool(ctx.min() == longest)  # every key of the gather is seen: no mask
        full = None if equal else torch.from_numpy(seen).to(self.device)[:, None, None, :]
        masks = {window: full if window is None or longest <= window else
                 torch.from_numpy(seen & (keys >= ctx[:, None] - window)).to(self.device)[:, None, None, :]
                 for window in self.windows}
        return DecodeRun(r0, r0 + len(group), torch.from_numpy(tables.reshape(-1)).to(self.device), longest,
                         masks)

    def _prefill_run(self, c: ScheduledChunk, r0: int) -> PrefillRun:
        start, stop = c.start, c.context_len
        ctx_blocks = None
        if start:
            ctx_blocks = torch.tensor(c.block_table[: -(-stop // self.block_size)], device=self.device)
        masks: dict[Window, torch.Tensor | None] = {}
        for window in self.windows:
            windowed = window is not None and stop > window
            if not start and not windowed:
                masks[window] = None  # causal over its own keys: SDPA's is_causal
                continue
            q_pos, k_pos = torch.arange(start, stop)[:, None], torch.arange(stop)[None, :]
            seen = k_pos <= q_pos
            if window is not None and windowed:
                seen &= k_pos > q_pos - window
            masks[window] = seen.to(self.device)
        return PrefillRun(r0, r0 + c.num_tokens, stop, ctx_blocks, masks)

    def _layer(self, li: int, layer: LayerWeights, x: torch.Tensor, step: StepLayout) -> torch.Tensor:
        """One decoder layer over the step's rows; what a family adds is in ``layer`` (None: absent)."""
        eps, T = self.w.rms_norm_eps, x.shape[0]
        H, KV, hd = self.num_heads, self.num_kv_heads, self.head_dim
        dense = self.dense[li]
        qkv = dense.qkv(self.norm(x, layer.input_norm, eps))
        qk = qkv[:, : (H + KV) * hd].view(T, H + KV, hd)  # q and k side by side: RoPE'd together
        v = qkv[:, (H + KV) * hd :].view(T, KV, hd)
        if layer.q_norm is not None and layer.k_norm is not None:
            q, k = self.norm(qk[:, :H], layer.q_norm, eps), self.norm(qk[:, H:], layer.k_norm, eps)
            qk = torch.cat((q, k), dim=1)
        qk = _rope(qk, *step.rope[int(layer.local_rope)])
        q, k = qk[:, :H], qk[:, H:]
        if step.real < T:  # the row plan's padding rows are never written
            k, v = k[: step.real], v[: step.real]
        self.k_cache[li].index_copy_(0, step.slots, k if k.dtype == self.kv_dtype else k.to(self.kv_dtype))
        self.v_cache[li].index_copy_(0, step.slots, v if v.dtype == self.kv_dtype else v.to(self.kv_dtype))
        attn = dense.o(self._attention(li, layer, q, k, v, step).view(T, H * hd))
        x = x + (attn if layer.attn_out_norm is None else self.norm(attn, layer.attn_out_norm, eps))
        gate, up = dense.gate_up(self.norm(x, layer.mlp_norm, eps)).chunk(2, dim=-1)
        mlp = dense.down(self.act(gate) * up)
        return x + (mlp if layer.mlp_out_norm is None else self.norm(mlp, layer.mlp_out_norm, eps))

    def _attention(self, li: int, layer: LayerWeights, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   step: StepLayout) -> torch.Tensor:
        """``[T, H, hd]``: each decode run and prefill chunk attends to its keys in layer ``li``'s cache,
        within the layer's window."""
        bs, H, KV, hd, G = self.block_size, self.num_heads, self.num_kv_heads, self.head_dim, self.group
        # gather whole blocks (bs * KV * hd contiguous values each), not single slots
        kb, vb = self.k_cache[li].view(-1, bs, KV, hd), self.v_cache[li].view(-1, bs, KV, hd)
        if not step.prefill_runs and len(step.decode_runs) == 1 and step.real == q.shape[0]:
            return self._decode_attention(step.decode_runs[0], layer, q, kb, vb)  # its rows are the step's
        out = torch.empty(q.shape[0], H, hd, dtype=q.dtype, device=q.device)
        out[step.real :] = 0  # padding rows: computed by the dense layers, read by nothing
        for d in step.decode_runs:
            out[d.r0 : d.r1] = self._decode_attention(d, layer, q, kb, vb)
        for p in step.prefill_runs:
            if p.ctx_blocks is None:
                kp, vp = k[p.r0 : p.r1], v[p.r0 : p.r1]
            else:
                kp = self._gather(kb, p.ctx_blocks, 0).view(-1, KV, hd)[: p.stop]
                vp = self._gather(vb, p.ctx_blocks, 1).view(-1, KV, hd)[: p.stop]
            kp = kp.repeat_interleave(G, dim=1).transpose(0, 1)[None]
            vp = vp.repeat_interleave(G, dim=1).transpose(0, 1)[None]
            qc = q[p.r0 : p.r1].transpose(0, 1)[None].to(kp.dtype)  # at the cache's precision (below)
            oc = _attend(qc, kp, vp, p.masks[layer.window], self.scale, layer.softcap)
            out[p.r0 : p.r1] = oc[0].transpose(0, 1)
        return out

    def _decode_attention(self, d: DecodeRun, layer: LayerWeights, q: torch.Tensor, kb: torch.Tensor,
                          vb: torch.Tensor) -> torch.Tensor:
        """``[n, H, hd]``: one decode run over its gathered keys, the GQA group folded into the query axis."""
        n, KV, G, hd = d.r1 - d.r0, self.num_kv_heads, self.group, self.head_dim
        keys = d.blocks.numel() * self.block_size // n
        kd = self._gather(kb, d.blocks, 0).view(n, keys, KV, hd)[:, : d.length].transpose(1, 2)
        vd = self._gather(vb, d.blocks, 1).view(n, keys, KV, hd)[:, : d.length].transpose(1, 2)
        # attended at the cache's precision: a KV cache below the weights' (float32 weights, float16 KV) is
        # read once, at its size, and the queries are rounded to it, as llama.cpp does with its f16 cache
        qd = q[d.r0 : d.r1].reshape(n, KV, G, hd).to(kd.dtype)
        od = _attend(qd, kd, vd, d.masks[layer.window], self.scale, layer.softcap, causal=False)
        return od.reshape(n, self.num_heads, hd).to(q.dtype)

    def _logits(self, x: torch.Tensor, chunks: Sequence[ScheduledChunk], step: StepLayout) -> torch.Tensor:
        """Logits of the rows that sample: a decode's row, a finished prefill's last row."""
        w = self.w
        last_row = {c.seq_id: i for i, c in enumerate(step.decodes)}
        for c, p in zip(step.prefills, step.prefill_runs, strict=True):
            last_row[c.seq_id] = p.r1 - 1
        rows = [last_row[c.seq_id] for c in chunks if c.sample]
        if not rows:
            return torch.empty(0, w.vocab_size)
        if rows != list(range(x.shape[0])):  # not every row, in order (a lone decode's is): pick them
            x = x[torch.tensor(rows, device=self.device)]
        logits = self.head(self.norm(x, w.norm, w.rms_norm_eps))
        if w.final_softcap is not None:
            logits = _softcap(logits, w.final_softcap)
        return logits.float()


# -- Memory and speed, measured on the runner ------------------------------------------------------
# What an LLM engine's memory is made of, measured on its runner: the input of ``core/llm/config.py``.
#
# * weights: the bytes of the runner's tensors (fused weights, embeddings, RoPE tables), counted once;
# * KV bytes per token: K and V over every layer, from the cache's own shape and dtype;
# * the activation peak of a step (``measure_memory``): every tensor a step allocates above what was
#   live when it started, measured by ``models.device.peak_memory_bytes`` (CUDA: the caching
#   allocator's high-water mark; CPU: the allocator's events under ``torch.profiler``) on synthetic
#   steps: prefills of several lengths (linear in batched tokens), decode batches at several
#   contexts (the gather of their keys and values: linear in the context tokens of the largest
#   decode group, which the runner's reused buffers hold), and prefill chunks past position 0 (chunked
#   prefill, a prefix-cache hit: a gather of their context, a mask and scores of tokens x context). A
#   least-squares fit ``fixed + per_token x tokens + per_read_token x read + per_attn x tokens x
#   context`` is shifted up by its largest miss, so it
#   is at or above every measured step; on CPU the fixed term also takes what running the same steps on
#   a fresh thread leaves resident beyond the tensors (``thread_residual``: the allocator arena the
#   engine's own thread will hold).
#
# The runner's gather buffers outlive a step (they are reused); each shape is measured with them
# released, so the gather it needs is counted, not hidden by a buffer an earlier shape grew.

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
    """Bytes of the runner's model tensors (shared storages once), RoPE tables and packed copies of the
    dense matrices (``dense.Dense.nbytes``) included."""
    w = runner.w
    tensors = [w.embed, w.norm, w.lm_head, *(t for table in runner.rope for t in table)]
    for layer in w.layers:
        tensors += layer.tensors()
    packed = sum(d.nbytes for layer in runner.dense for d in layer.all()) + runner.head.nbytes
    return _tensor_bytes(tensors) + packed


def kv_bytes_per_token(runner: LLMModelRunner) -> int:
    """K and V of one token over every layer."""
    k = runner.k_cache
    return 2 * k.shape[0] * k.shape[2] * k.shape[3] * k.element_size()


def model_memory(runner: LLMModelRunner) -> MemoryProfile:
    """Weights and KV bytes per token, exact from the tensors; no activation terms (``source="none"``)."""
    return MemoryProfile(weights_bytes(runner), kv_bytes_per_token(runner))


def weights_memory(weights: Any, dtype: torch.dtype, kv_dtype: torch.dtype | None = None,
                   packed: bool = False) -> MemoryProfile:
    """``model_memory`` before any runner exists: the loaded weights (already in ``dtype``, as the loader
    gives them and the runner keeps them), their packed copies when ``packed``, and the RoPE tables the
    runner will build; KV bytes from the model's shape and ``kv_dtype`` (default ``dtype``)."""
    w = weights
    tensors = [w.embed, w.norm, w.lm_head]
    dense = [w.lm_head]
    for layer in w.layers:
        tensors += layer.tensors()
        dense += [layer.qkv, layer.o, layer.gate_up, layer.down]
    size = torch.empty(0, dtype=dtype).element_size()
    tables = 1 if w.local_inv_freq is None else 2
    rope = 2 * tables * w.max_position_embeddings * w.head_dim * size
    kv_size = torch.empty(0, dtype=kv_dtype or dtype).element_size()
    kv = 2 * len(w.layers) * w.num_kv_heads * w.head_dim * kv_size
    copies = sum(t.numel() * size for t in dense) if packed else 0
    return MemoryProfile(_tensor_bytes(tensors) + rope + copies, kv)


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


def _sync_runner(runner: LLMModelRunner) -> None:
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
        _sync_runner(runner)
        t0 = time.perf_counter()
        runner.swap(pairs, [])
        _sync_runner(runner)
        t1 = time.perf_counter()
        runner.swap([], pairs)
        _sync_runner(runner)
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
    plans = [step_plan(runner, [n], []) for n in sizes]
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


