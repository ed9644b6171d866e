"""Padding-free (ragged) execution of BERT-family encoders: no pad token is ever computed.

All token-wise work (embeddings, the fused QKV projection, output projection, feed-forward, layer
norms) runs on one packed ``[total_tokens, H]`` tensor, so the matrix multiplies see one tall matrix
whatever the length mix. Only attention needs sequence boundaries::

    ids  [a a a a b b c c c c c c]      packed, offsets = [0, 4, 6, 12]
    qkv  [T, 3, heads, head_dim]    ->  attention over a | b | c separately  ->  ctx [T, H]

Attention strategies (``attention=``):

* ``loop``      one SDPA call per sequence on strided views of the packed QKV (no copies, no padding).
* ``group``     sequences sorted by length and cut into groups whose padded attention work stays
                within ``1 + group_slack`` of the exact work; one dense masked SDPA call per group
                (``group_slack=0``: equal attention widths only; on CPU a width is the length rounded
                up to 16, models/lean.py ``attention_width``). Only attention sees padding; the
                token-wise work stays packed.
* ``nested``    jagged nested tensors (``torch.nested``, layout=jagged) through SDPA; on CUDA this
                dispatches to the flash / memory-efficient varlen kernels.
* ``flash``     ``flash_attn.flash_attn_varlen_func`` (CUDA, fp16/bf16, only if flash-attn is installed).
* ``auto``      CUDA: ``flash`` for half precision when available, else ``nested``; CPU: ``group``
                with ``group_slack=0``, the fastest we measured here (docs/padding.md): ~0.9x of
                ``loop``, ~0.1x of ``nested`` (which has no fused
                CPU kernel and falls back to per-sequence math attention), ~0.15x of padding the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from batchpilot.models.lean import LeanEncoder, attention_width, padded_rows

ATTENTIONS = ("auto", "loop", "group", "nested", "flash")
# one attention group of the group strategy: (gather index, key mask, where): see _group_plan
GroupPlan = tuple[torch.Tensor | None, torch.Tensor | None, Any]


def _flash_varlen() -> Any:
    try:
        from flash_attn import flash_attn_varlen_func  # type: ignore[import-not-found]
    except ImportError:
        return None
    return flash_attn_varlen_func


class RaggedEncoder(LeanEncoder):
    """Padding-free encoder over HF weights; also offers the lean padded forward it inherits."""

    def __init__(
        self,
        model: Any,
        pooling: str = "mean",
        normalize: bool = False,
        attention: str = "auto",
        group_slack: float = 0.0,
    ) -> None:
        super().__init__(model, pooling=pooling, normalize=normalize)
        if attention not in ATTENTIONS:
            raise ValueError(f"ragged encoder: attention must be one of {ATTENTIONS}, got {attention!r}")
        if group_slack < 0:
            raise ValueError(
                f"ragged encoder: group_slack must be >= 0 (0 = equal lengths only), got {group_slack}"
            )
        self.attention = self._resolve(attention)
        self.group_slack = float(group_slack)

    @classmethod
    def from_hf(
        cls,
        model: Any,
        pooling: str = "mean",
        normalize: bool = False,
        attention: str = "auto",
        group_slack: float = 0.0,
    ) -> RaggedEncoder:
        return cls(model, pooling=pooling, normalize=normalize, attention=attention, group_slack=group_slack)

    def _resolve(self, attention: str) -> str:
        if attention == "flash" and (self.device.type != "cuda" or _flash_varlen() is None):
            raise ValueError("ragged encoder: attention='flash' needs CUDA and the flash-attn package")
        if self.position_bias is not None:  # MPNet: the bias goes in as an SDPA mask, per sequence or group
            if attention in ("nested", "flash"):
                raise ValueError(f"ragged encoder: attention={attention!r} cannot add a relative position "
                                 "bias (MPNet); use 'loop' or 'group'")
            return "group" if attention == "auto" else attention
        if attention != "auto":
            return attention
        if self.device.type == "cuda":
            half = self.dtype in (torch.float16, torch.bfloat16)
            return "flash" if half and _flash_varlen() is not None else "nested"
        return "group"

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
    # SDPA takes its fused CPU kernel (flash_attention_for_cpu) only for 4-D inputs; a 3-D
    # [heads, n, hd] call silently falls back to the unfused math path (bmm + softmax), ~3x slower.
    def _sdpa(self, qkv: torch.Tensor, width: int | None = None,
              mask: torch.Tensor | None = None) -> torch.Tensor:
        """``qkv`` ``[n, 3, heads, hd]`` of one sequence -> context ``[n, heads, hd]``; attended at
        ``width`` >= n (zero rows appended) under ``mask`` (``attention_mask``: the appended keys masked,
        and any relative position bias)."""
        n = qkv.shape[0]
        if width is not None and width > n:
            qkv = F.pad(qkv, (0, 0, 0, 0, 0, 0, 0, width - n))
        q, k, v = qkv.permute(1, 2, 0, 3).unsqueeze(1)  # each [1, heads, width, hd], strided views
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)[0].transpose(0, 1)[:n]

    def _attend(self, qkv: torch.Tensor, lengths: list[int], plan: Any) -> torch.Tensor:
        """``qkv`` is ``[T, 3, heads, head_dim]``; returns the attention context ``[T, H]``."""
        t = qkv.shape[0]
        if self.attention == "loop":
            ctx = torch.empty(t, self.num_heads, self.head_dim, dtype=qkv.dtype, device=qkv.device)
            s = 0
            for n in lengths:
                ctx[s : s + n] = self._sdpa(qkv[s : s + n], None, self.attention_mask(None, n))
                s += n
            return ctx.view(t, self.hidden)
        if self.attention == "group":
            return self._attend_grouped(qkv, plan)
        offsets = plan
        if self.attention == "flash":
            m = max(lengths)
            out = _flash_varlen()(qkv[:, 0], qkv[:, 1], qkv[:, 2], offsets, offsets, m, m)
            return out.reshape(t, self.hidden)
        # nested: [B, j, heads, hd] jagged -> [B, heads, j, hd] for SDPA, back to packed values
        nt = torch.nested.nested_tensor_from_jagged
        q, k, v = (nt(qkv[:, i].contiguous(), offsets).transpose(1, 2) for i in range(3))
        out = F.scaled_dot_product_attention(q, k, v).transpose(1, 2)
        return out.values().reshape(t, self.hidden)

    def _plan(self, lengths: list[int]) -> Any:
        """What every layer's attention needs, computed once per forward."""
        if self.attention == "group":
            return self._group_plan(lengths)
        if self.attention in ("nested", "flash"):
            offsets = torch.tensor([0, *lengths], device=self.device).cumsum(0)
            return offsets.int() if self.attention == "flash" else offsets
        return None

    def _group_plan(self, lengths: list[int]) -> list[GroupPlan]:
        """Sequences sorted by length, each given an attention width (its length rounded up to
        ``attention_multiple()``, models/lean.py), cut into groups whose padded attention work
        ``g * max(width)^2`` stays within ``1 + group_slack`` of their ``sum(width^2)``; each group is
        one dense SDPA call (``group_slack=0``: equal widths only). Per group ``(idx, mask, where)``:
        the SDPA mask (``attention_mask``: the key mask ``[g, 1, 1, width]``, None when every slot is a
        real token, or the relative position bias with it); for a lone sequence ``idx`` None and
        ``where`` its (start, length, width) in the packed rows; else the gather index ``idx``
        ``[g, width]`` and ``where`` the real tokens' flat positions and their slots in the group's
        output, to scatter the context back (None when every slot is real)."""
        starts = [0]
        for n in lengths[:-1]:
            starts.append(starts[-1] + n)
        m = self.attention_multiple()
        order = sorted(range(len(lengths)), key=lengths.__getitem__)
        groups: list[list[int]] = []
        sq = 0
        for i in order:
            w = attention_width(lengths[i], m)
            if groups and (len(groups[-1]) + 1) * w * w > (1.0 + self.group_slack) * (sq + w * w):
                groups.append([])
                sq = 0
            if not groups:
                groups.append([])
            groups[-1].append(i)
            sq += w * w
        plan: list[GroupPlan] = []
        for grp in groups:
            lens = torch.tensor([lengths[i] for i in grp])
            width = attention_width(int(lens.max()), m)
            pos = torch.arange(width)
            real = pos[None, :] < lens[:, None]  # [g, width]
            all_real = bool(real.all())
            mask = self.attention_mask(None if all_real else real.to(self.device), width)
            if len(grp) == 1:  # a lone sequence: its rows of the packed QKV, zero-padded to the width
                plan.append((None, mask, (starts[grp[0]], lengths[grp[0]], width)))
                continue
            # padded slots read the sequence's last token: harmless, masked as keys, dropped as queries
            first = torch.tensor([starts[i] for i in grp])[:, None]
            idx = first + torch.minimum(pos[None, :], lens[:, None] - 1)
            if all_real:
                plan.append((idx.to(self.device), mask, None))
                continue
            # where the real tokens' context goes (flat token index) and where it comes from (flat
            # slot of the group's output), computed once for every layer
            src = real.reshape(-1).nonzero().squeeze(1)
            scatter = (idx.reshape(-1)[src].to(self.device), src.to(self.device))
            plan.append((idx.to(self.device), mask, scatter))
        return plan

    def _attend_grouped(self, qkv: torch.Tensor, plan: Any) -> torch.Tensor:
        t = qkv.shape[0]
        ctx = torch.empty(t, self.num_heads, self.head_dim, dtype=qkv.dtype, device=qkv.device)
        for idx, mask, where in plan:
            if idx is None:
                s, n, width = where
                ctx[s : s + n] = self._sdpa(qkv[s : s + n], width, mask)
                continue
            g = qkv[idx].permute(2, 0, 3, 1, 4)  # [3, g, heads, width, hd]
            out = F.scaled_dot_product_attention(g[0], g[1], g[2], attn_mask=mask).transpose(1, 2)
            out = out.reshape(-1, self.num_heads, self.head_dim)
            if where is None:
                ctx[idx.reshape(-1)] = out
            else:
                dst, src = where
                ctx.index_copy_(0, dst, out.index_select(0, src))
        return ctx.view(t, self.hidden)

    # -- forward --------------------------------------------------------------------------------
    def hidden_ragged(self, batch: Sequence[Sequence[int]]) -> tuple[torch.Tensor, list[int]]:
        """Packed last hidden states ``[T, H]`` (sequence after sequence) and the lengths.

        On CPU in bfloat16/float16 the token-wise work runs on ``padded_rows(T)`` rows (see there);
        the rows past ``T`` are never attended to nor returned.
        """
        ids, positions, lengths = self.pack(batch)
        t = ids.numel()
        rows = padded_rows(t) if self._pads_rows() else t
        if rows > t:
            ids = F.pad(ids, (0, rows - t))
            positions = F.pad(positions, (0, rows - t), value=self.position_offset)
        x = self.embed(ids, positions)
        plan = self._plan(lengths)
        for lw in self.layers:
            qkv = F.linear(x, lw.qkv_w, lw.qkv_b).view(-1, 3, self.num_heads, self.head_dim)
            ctx = self._attend(qkv[:t], lengths, plan)
            if rows > t:
                ctx = F.pad(ctx, (0, 0, 0, rows - t))
            x = self.post_attention(lw, x, ctx)
        return x[:t], lengths


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
