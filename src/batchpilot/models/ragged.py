"""Padding-free (ragged) execution of BERT-family encoders: no pad token is ever computed.

All token-wise work (embeddings, the fused QKV projection, output projection, feed-forward, layer
norms) runs on one packed ``[total_tokens, H]`` tensor, so the matrix multiplies see one tall matrix
whatever the length mix. Only attention needs sequence boundaries::

    ids  [a a a a b b c c c c c c]      packed, offsets = [0, 4, 6, 12]
    qkv  [T, 3, heads, head_dim]    ->  attention over a | b | c separately  ->  ctx [T, H]

Attention strategies (``attention=``):

* ``loop``      one SDPA call per sequence on strided views of the packed QKV (no copies, no padding).
* ``group``     sequences of equal length gathered into one dense SDPA call each.
* ``nested``    jagged nested tensors (``torch.nested``, layout=jagged) through SDPA; on CUDA this
                dispatches to the flash / memory-efficient varlen kernels.
* ``flash``     ``flash_attn.flash_attn_varlen_func`` (CUDA, fp16/bf16, only if flash-attn is installed).
* ``auto``      CUDA: ``flash`` for half precision when available, else ``nested``; CPU: ``loop``,
                the fastest we measured here (``batchpilot bench padding --attention-only``, docs/padding.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from batchpilot.models.lean import LeanEncoder

ATTENTIONS = ("auto", "loop", "group", "nested", "flash")


def _flash_varlen() -> Any:
    try:
        from flash_attn import flash_attn_varlen_func  # type: ignore[import-not-found]
    except ImportError:
        return None
    return flash_attn_varlen_func


class RaggedEncoder(LeanEncoder):
    """Padding-free encoder over HF weights; also offers the lean padded forward it inherits."""

    def __init__(
        self, model: Any, pooling: str = "mean", normalize: bool = False, attention: str = "auto"
    ) -> None:
        super().__init__(model, pooling=pooling, normalize=normalize)
        if attention not in ATTENTIONS:
            raise ValueError(f"ragged encoder: attention must be one of {ATTENTIONS}, got {attention!r}")
        self.attention = self._resolve(attention)

    @classmethod
    def from_hf(
        cls, model: Any, pooling: str = "mean", normalize: bool = False, attention: str = "auto"
    ) -> RaggedEncoder:
        return cls(model, pooling=pooling, normalize=normalize, attention=attention)

    def _resolve(self, attention: str) -> str:
        if attention == "flash" and (self.device.type != "cuda" or _flash_varlen() is None):
            raise ValueError("ragged encoder: attention='flash' needs CUDA and the flash-attn package")
        if attention != "auto":
            return attention
        if self.device.type == "cuda":
            half = self.dtype in (torch.float16, torch.bfloat16)
            return "flash" if half and _flash_varlen() is not None else "nested"
        return "loop"

    # -- packing --------------------------------------------------------------------------------
    def pack(self, batch: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """Token ids ``[T]``, positions ``[T]`` and the lengths of a list of token-id lists."""
        lengths = [len(s) for s in batch]
        if not lengths or min(lengths) == 0:
            raise ValueError("ragged encoder: every input needs at least one token (got an empty list)")
        if max(lengths) > self.max_length:
            raise ValueError(
                f"ragged encoder: an input has {max(lengths)} tokens, over the model's limit of "
                f"{self.max_length}; truncate it when tokenising"
            )
        ids = torch.tensor([t for s in batch for t in s], dtype=torch.long)
        # position of each token inside its own sequence: global index minus its sequence's start
        starts = torch.tensor([0, *lengths[:-1]]).cumsum(0)
        lens = torch.tensor(lengths)
        positions = torch.arange(ids.numel()) - torch.repeat_interleave(starts, lens) + self.position_offset
        return ids.to(self.device), positions.to(self.device), lengths

    # -- attention over packed QKV ----------------------------------------------------------------
    def _attend(self, qkv: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        """``qkv`` is ``[T, 3, heads, head_dim]``; returns the attention context ``[T, H]``."""
        t = qkv.shape[0]
        if self.attention == "loop":
            ctx = torch.empty(t, self.num_heads, self.head_dim, dtype=qkv.dtype, device=qkv.device)
            s = 0
            for n in lengths:
                q, k, v = qkv[s : s + n].permute(1, 2, 0, 3)  # each [heads, n, head_dim], views
                ctx[s : s + n] = F.scaled_dot_product_attention(q, k, v).transpose(0, 1)
                s += n
            return ctx.view(t, self.hidden)
        if self.attention == "group":
            return self._attend_grouped(qkv, lengths)
        offsets = torch.tensor([0, *lengths], device=qkv.device).cumsum(0)
        if self.attention == "flash":
            fn = _flash_varlen()
            m = max(lengths)
            out = fn(qkv[:, 0], qkv[:, 1], qkv[:, 2], offsets.int(), offsets.int(), m, m)
            return out.reshape(t, self.hidden)
        # nested: [B, j, heads, hd] jagged -> [B, heads, j, hd] for SDPA, back to packed values
        nt = torch.nested.nested_tensor_from_jagged
        q, k, v = (nt(qkv[:, i].contiguous(), offsets).transpose(1, 2) for i in range(3))
        out = F.scaled_dot_product_attention(q, k, v).transpose(1, 2)
        return out.values().reshape(t, self.hidden)

    def _attend_grouped(self, qkv: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        ctx = torch.empty(qkv.shape[0], self.num_heads, self.head_dim, dtype=qkv.dtype, device=qkv.device)
        starts = [0]
        for n in lengths[:-1]:
            starts.append(starts[-1] + n)
        by_len: dict[int, list[int]] = {}
        for start, n in zip(starts, lengths, strict=True):
            by_len.setdefault(n, []).append(start)
        for n, group in by_len.items():
            if len(group) == 1:
                q, k, v = qkv[group[0] : group[0] + n].permute(1, 2, 0, 3)
                ctx[group[0] : group[0] + n] = F.scaled_dot_product_attention(q, k, v).transpose(0, 1)
                continue
            idx = (torch.tensor(group)[:, None] + torch.arange(n)).reshape(-1).to(qkv.device)
            g = qkv[idx].view(len(group), n, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
            out = F.scaled_dot_product_attention(g[0], g[1], g[2])  # [G, heads, n, hd]
            ctx[idx] = out.transpose(1, 2).reshape(-1, self.num_heads, self.head_dim)
        return ctx.view(qkv.shape[0], self.hidden)

    # -- forward --------------------------------------------------------------------------------
    def hidden_ragged(self, batch: Sequence[Sequence[int]]) -> tuple[torch.Tensor, list[int]]:
        """Packed last hidden states ``[T, H]`` (sequence after sequence) and the lengths."""
        ids, positions, lengths = self.pack(batch)
        x = self.embed(ids, positions)
        for lw in self.layers:
            qkv = F.linear(x, lw.qkv_w, lw.qkv_b).view(-1, 3, self.num_heads, self.head_dim)
            x = self.post_attention(lw, x, self._attend(qkv, lengths))
        return x, lengths

    def forward(self, batch: Sequence[Sequence[int]]) -> torch.Tensor:
        """Pooled embeddings ``[n, H]`` of ``batch`` (token-id lists, any lengths), no padding computed."""
        with torch.inference_mode():
            x, lengths = self.hidden_ragged(batch)
            if self.pooling == "cls":
                starts = torch.tensor([0, *lengths[:-1]], device=x.device).cumsum(0)
                return self.finish(x[starts])
            seg = torch.repeat_interleave(torch.arange(len(lengths), device=x.device), torch.tensor(lengths))
            sums = x.new_zeros(len(lengths), self.hidden).index_add_(0, seg, x)
            return self.finish(sums / torch.tensor(lengths, dtype=x.dtype, device=x.device)[:, None])

    __call__ = forward
