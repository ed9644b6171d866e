"""Runs one scheduler step on a Llama-family decoder over a paged KV cache.

Every token of the step (prefill chunks and decodes alike) goes through the dense layers as one
packed ``[T, D]`` matrix: no padding between chunks, two fused matmuls per block (qkv, gate_up) plus o
and down; ``row_plan`` (``row_plan.py``) may add up to three rows to ``T`` where the matmuls run
faster with them, rows never written to the cache, attended to or sampled.
Only attention differs by chunk kind, and it reads keys/values through block tables:

* decodes (1-token chunks): sorted by context length and split into runs of at most
  ``decode_run_tokens`` padded keys (``core.llm_plan.decode_groups``), one
  batched SDPA each (so short contexts are not padded to the longest). Keys are gathered block-wise
  into ``[B, KV, L_max, hd]`` with a length mask; the query heads of a GQA group are folded into the query
  axis (``[B, KV, G, hd]``) so the KV heads are never repeated.
* prefill chunks: one SDPA each. A chunk starting at position 0 attends over its own fresh keys with
  ``is_causal``; a later chunk (chunked prefill, prefix-cache hit) gathers its context from the cache
  and uses an offset causal mask.

Each layer writes the step's K/V into the cache (``index_copy_`` on slot numbers
``block_table[pos // bs] * bs + pos % bs``) before attention reads it. Logits are computed only for
chunks that sample (the last token of a finished prefill, every decode).

Swap space: ``num_swap_blocks`` host blocks of K and V (``[layers, blocks, block_size, kv_heads,
head_dim]``, pinned memory beside a CUDA cache, plain ``torch.empty`` on CPU so swap space never used
costs no resident memory). ``swap(out_pairs, in_pairs)`` makes a plan's block copies, whole blocks per
layer; the driver calls it before the step's ``forward``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from batchpilot.core.llm_scheduler import DECODE_RUN_TOKENS, ScheduledChunk, decode_groups
from batchpilot.core.preemption import PreemptionCosts
from batchpilot.models.llm.row_plan import RowPlan
from batchpilot.models.llm.weights import LlamaWeights


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


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # same op order as HF LlamaRMSNorm, for token-identical greedy output
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class LLMModelRunner:
    """Owns the weights and the KV cache (``[layers, slots, kv_heads, head_dim]`` for K and for V)."""

    def __init__(self, weights: LlamaWeights, num_kv_blocks: int, block_size: int,
                 device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                 decode_run_tokens: int = DECODE_RUN_TOKENS, num_swap_blocks: int = 0) -> None:
        self.decode_run_tokens = decode_run_tokens
        self.threads: int | None = None  # CPU intra-op threads of the threads that run it (None: every core)
        self.row_plan = RowPlan()  # the row counts the dense layers run (row_plan.py; none padded)
        self.rows_run = 0  # the token rows the last forward's dense layers ran, padding included
        self.max_gather_tokens = 0  # the most context tokens one gather holds (0: unbounded doubling)
        self._buffers = [torch.empty(0, dtype=dtype, device=device) for _ in range(2)]
        self.device = torch.device(device)
        self.dtype = dtype
        self.block_size = block_size
        self.num_kv_blocks = num_kv_blocks
        w = weights
        self.w = w
        for name in ("embed", "norm", "lm_head"):
            setattr(w, name, getattr(w, name).to(self.device, dtype))
        for layer in w.layers:
            for name in ("input_norm", "qkv", "o", "post_norm", "gate_up", "down"):
                setattr(layer, name, getattr(layer, name).to(self.device, dtype))
        self.num_heads, self.num_kv_heads, self.head_dim = w.num_heads, w.num_kv_heads, w.head_dim
        self.group = self.num_heads // self.num_kv_heads
        shape = (len(w.layers), num_kv_blocks * block_size, self.num_kv_heads, self.head_dim)
        self.k_cache = torch.zeros(shape, dtype=dtype, device=self.device)
        self.v_cache = torch.zeros(shape, dtype=dtype, device=self.device)
        self.num_swap_blocks = num_swap_blocks
        self.preemption_costs: PreemptionCosts | None = None  # measured on this runner by its first engine
        host = (len(w.layers), num_swap_blocks, block_size, self.num_kv_heads, self.head_dim)
        pin = self.device.type == "cuda"
        self.k_swap = torch.empty(host, dtype=dtype, pin_memory=pin)
        self.v_swap = torch.empty(host, dtype=dtype, pin_memory=pin)
        pos = torch.arange(w.max_position_embeddings, dtype=torch.float32)
        freqs = pos[:, None] * w.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = (emb.cos() * w.attention_scaling).to(self.device, dtype)
        self.sin = (emb.sin() * w.attention_scaling).to(self.device, dtype)
        self.scale = self.head_dim**-0.5

    def plan_rows(self) -> RowPlan:
        """Measure and keep the row counts the dense layers run fastest at (``RowPlan.measure`` on every
        layer's matrices; about 2 s for the tiny Llama on one CPU core)."""
        dense = [m for layer in self.w.layers for m in (layer.qkv, layer.o, layer.gate_up, layer.down)]
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
        self._buffers = [torch.empty(0, dtype=self.dtype, device=self.device) for _ in range(2)]

    def _slots(self, block_table: Sequence[int], start: int, stop: int) -> torch.Tensor:
        bs = self.block_size
        pos = torch.arange(start, stop)
        table = torch.tensor(block_table, dtype=torch.long)
        return table[pos // bs] * bs + pos % bs

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
        rule (``core.llm_scheduler.decode_groups``), which the cost model's KV features count too."""
        return decode_groups(ctx_sorted, self.decode_run_tokens)

    @torch.inference_mode()
    def forward(self, chunks: Sequence[ScheduledChunk]) -> torch.Tensor:
        """Run one step; return float32 logits ``[num_sampling_chunks, vocab]`` in chunk order."""
        if not chunks:
            return torch.empty(0, self.w.vocab_size)
        dev, bs = self.device, self.block_size
        # decodes sorted by context length, so each group pads its gathered keys to a similar length
        decodes = sorted((c for c in chunks if c.num_tokens == 1), key=lambda c: c.context_len)
        prefills = [c for c in chunks if c.num_tokens > 1]
        ordered = decodes + prefills  # rows: decodes first, then each prefill chunk contiguously
        ids: list[int] = []
        positions: list[int] = []
        slot_parts: list[torch.Tensor] = []
        for c in ordered:
            ids.extend(c.token_ids)
            positions.extend(range(c.start, c.context_len))
            slot_parts.append(self._slots(c.block_table, c.start, c.context_len))
        slots = torch.cat(slot_parts).to(dev)
        real = len(ids)  # the step's token rows; the dense layers run row_plan.rows(real) (row_plan.py)
        pad = self.row_plan.rows(real) - real
        self.rows_run = real + pad
        ids.extend([0] * pad)
        positions.extend([0] * pad)
        pos_t = torch.tensor(positions, device=dev)
        cos, sin = self.cos[pos_t][:, None, :], self.sin[pos_t][:, None, :]

        nd = len(decodes)
        decode_groups = []
        for g0, g1 in self._decode_groups([c.context_len for c in decodes]):
            group = decodes[g0:g1]
            ctx = torch.tensor([c.context_len for c in group])
            max_blocks = -(-int(ctx.max()) // bs)
            tables = torch.zeros(len(group), max_blocks, dtype=torch.long)
            for i, c in enumerate(group):
                nb = -(-c.context_len // bs)
                tables[i, :nb] = torch.tensor(c.block_table[:nb])
            mask = (torch.arange(max_blocks * bs)[None, :] < ctx[:, None]).to(dev)[:, None, None, :]
            decode_groups.append((g0, g1, tables.view(-1).to(dev), mask, max_blocks * bs))
        prefill_meta = []
        row = nd
        for c in prefills:
            nb = -(-c.context_len // bs)
            ctx_blocks = torch.tensor(c.block_table[:nb], device=dev) if c.start else None
            mask = None
            if c.start:
                q_pos = torch.arange(c.start, c.context_len)[:, None]
                mask = (torch.arange(c.context_len)[None, :] <= q_pos).to(dev)
            prefill_meta.append((row, row + c.num_tokens, ctx_blocks, mask))
            row += c.num_tokens

        w = self.w
        H, KV, hd, G = self.num_heads, self.num_kv_heads, self.head_dim, self.group
        x = w.embed[torch.tensor(ids, device=dev)]
        T = x.shape[0]
        for li, layer in enumerate(w.layers):
            h = _rms_norm(x, layer.input_norm, w.rms_norm_eps)
            qkv = h @ layer.qkv.T
            q = qkv[:, : H * hd].view(T, H, hd)
            k = qkv[:, H * hd : (H + KV) * hd].view(T, KV, hd)
            v = qkv[:, (H + KV) * hd :].view(T, KV, hd)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            kc, vc = self.k_cache[li], self.v_cache[li]
            kc.index_copy_(0, slots, k[:real])
            vc.index_copy_(0, slots, v[:real])
            # gather whole blocks (bs * KV * hd contiguous values each), not single slots
            kb, vb = kc.view(-1, bs, KV, hd), vc.view(-1, bs, KV, hd)
            out = torch.empty(T, H, hd, dtype=x.dtype, device=dev)
            if pad:
                out[real:] = 0  # padding rows: computed by the dense layers, read by nothing
            for g0, g1, blocks, dmask, length in decode_groups:
                n = g1 - g0
                kd = self._gather(kb, blocks, 0).view(n, length, KV, hd).transpose(1, 2)
                vd = self._gather(vb, blocks, 1).view(n, length, KV, hd).transpose(1, 2)
                qd = q[g0:g1].view(n, KV, G, hd)  # fold the GQA group into the query axis
                od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=dmask, scale=self.scale)
                out[g0:g1] = od.reshape(n, H, hd)
            for r0, r1, ctx_blocks, mask in prefill_meta:
                qc = q[r0:r1].transpose(0, 1)[None]
                if ctx_blocks is None:
                    kp, vp = k[r0:r1], v[r0:r1]
                else:
                    n_ctx = mask.shape[1]
                    kp = self._gather(kb, ctx_blocks, 0).view(-1, KV, hd)[:n_ctx]
                    vp = self._gather(vb, ctx_blocks, 1).view(-1, KV, hd)[:n_ctx]
                kp = kp.repeat_interleave(G, dim=1).transpose(0, 1)[None]
                vp = vp.repeat_interleave(G, dim=1).transpose(0, 1)[None]
                if mask is None:
                    oc = F.scaled_dot_product_attention(qc, kp, vp, is_causal=True, scale=self.scale)
                else:
                    oc = F.scaled_dot_product_attention(qc, kp, vp, attn_mask=mask, scale=self.scale)
                out[r0:r1] = oc[0].transpose(0, 1)
            x = x + out.view(T, H * hd) @ layer.o.T
            h = _rms_norm(x, layer.post_norm, w.rms_norm_eps)
            gate, up = (h @ layer.gate_up.T).chunk(2, dim=-1)
            x = x + (F.silu(gate) * up) @ layer.down.T

        last_row: dict[int, int] = {}
        for i, c in enumerate(decodes):
            last_row[c.seq_id] = i
        for c, (_, r1, _, _) in zip(prefills, prefill_meta, strict=True):
            last_row[c.seq_id] = r1 - 1
        rows = [last_row[c.seq_id] for c in chunks if c.sample]
        if not rows:
            return torch.empty(0, w.vocab_size)
        h = _rms_norm(x[torch.tensor(rows, device=dev)], w.norm, w.rms_norm_eps)
        return (h @ w.lm_head.T).float()
