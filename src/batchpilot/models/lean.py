"""A lean forward over the weights of a HF BERT-like encoder (BERT, RoBERTa, XLM-R, MiniLM, DistilBERT,
MPNet).

Why it exists: a HF ``BertModel`` call pays a per-call cost that has nothing to do with the tokens:
the 4-D mask construction, three separate Q/K/V projections, the unused pooler (dense + tanh), dropout
modules, output dataclasses and ~100 ``nn.Module.__call__`` dispatches with their hooks. This module
copies the weights once into plain tensors (Q/K/V fused into one ``[3H, H]`` matrix, the token-type-0
row folded into the position table) and runs the same arithmetic as straight-line ``torch.nn.functional``
calls under ``inference_mode``. ``docs/padding.md`` has the before/after numbers.

The families differ only in where their weights live and in one attention term, so a family is data
(``LAYOUTS``): the attribute paths of its layers' weights, whether it has token-type embeddings, and
MPNet's relative position bias (a ``[heads, L, L]`` table added to the attention scores, computed once
by HF's own ``compute_position_bias``). Every family here is post-LN with absolute learned positions;
anything else (rotary, alternating local attention, decoders) has no lean forward.

Outputs equal the HF forward to float rounding (tests/test_ragged.py checks 1e-4); the padded path here
is what the encoder executor calls for padding modes max/dynamic/bucket, and ``models/ragged.py`` reuses
the layer weights for padding-free execution.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

POOLINGS = ("mean", "cls")
_ACTIVATIONS = {
    "gelu": lambda x: F.gelu(x),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


@dataclass(frozen=True, slots=True)
class LayerWeights:
    """One transformer layer; ``qkv_w`` is ``[3H, H]`` = query, key, value stacked."""

    qkv_w: torch.Tensor
    qkv_b: torch.Tensor
    out_w: torch.Tensor
    out_b: torch.Tensor
    ln1_w: torch.Tensor
    ln1_b: torch.Tensor
    ffn_in_w: torch.Tensor
    ffn_in_b: torch.Tensor
    ffn_out_w: torch.Tensor
    ffn_out_b: torch.Tensor
    ln2_w: torch.Tensor
    ln2_b: torch.Tensor


@dataclass(frozen=True)
class Layout:
    """Where a BERT-like family keeps its weights: ``layers`` from the base model, the rest (dotted
    attribute paths) from one layer; ``activation`` is the config attribute naming the feed-forward
    activation."""

    layers: str
    q: str
    k: str
    v: str
    out: str
    ln1: str
    ffn_in: str
    ffn_out: str
    ln2: str
    activation: str = "hidden_act"
    token_types: bool = True  # embeddings.token_type_embeddings: row 0 folded into the positions
    relative_bias: bool = False  # MPNet: encoder.compute_position_bias added to every layer's scores


_BERT = Layout("encoder.layer", "attention.self.query", "attention.self.key", "attention.self.value",
               "attention.output.dense", "attention.output.LayerNorm", "intermediate.dense", "output.dense",
               "output.LayerNorm")
# model_type -> layout; any other model with .embeddings and .encoder is read as a BERT
LAYOUTS: dict[str, Layout] = {
    "distilbert": Layout("transformer.layer", "attention.q_lin", "attention.k_lin", "attention.v_lin",
                         "attention.out_lin", "sa_layer_norm", "ffn.lin1", "ffn.lin2", "output_layer_norm",
                         activation="activation", token_types=False),
    "mpnet": Layout("encoder.layer", "attention.attn.q", "attention.attn.k", "attention.attn.v",
                    "attention.attn.o", "attention.LayerNorm", "intermediate.dense", "output.dense",
                    "output.LayerNorm", token_types=False, relative_bias=True),
}


# families people serve as encoders that the lean forward does not run, and why (the executor logs it)
NO_LEAN_FORWARD: dict[str, str] = {
    "modernbert": "uses rotary positions and alternating local/global attention",
    "qwen2": "is a decoder (rotary positions, causal attention)",
    "qwen3": "is a decoder (rotary positions, causal attention)",
    "gemma3_text": "is a decoder (rotary positions, sliding-window layers)",
    "gemma2": "is a decoder (rotary positions, sliding-window layers)",
    "llama": "is a decoder (rotary positions, causal attention)",
    "mistral": "is a decoder (rotary positions, causal attention)",
}


def layout_of(model: Any) -> tuple[Any, Layout]:
    """The base encoder of ``model`` (a bare encoder or a task head wrapping one) and its layout; a
    ValueError saying why when it is not a family the lean forward runs."""
    base = getattr(model, "base_model", model)
    model_type = getattr(getattr(base, "config", None), "model_type", "")
    if model_type in NO_LEAN_FORWARD:
        raise ValueError(f"{model_type} {NO_LEAN_FORWARD[model_type]}, which the lean forward does not "
                         "implement")
    layout = LAYOUTS.get(model_type, _BERT)
    if not hasattr(base, "embeddings") or _get(base, layout.layers) is None:
        raise ValueError(
            f"lean encoder: {type(model).__name__} ({model_type or 'no model_type'}) is not a BERT-like "
            f"encoder (BERT, RoBERTa, XLM-R, DistilBERT, MPNet); it has no .embeddings and .{layout.layers}")
    return base, layout


def _get(obj: Any, path: str) -> Any:
    for part in path.split("."):
        obj = getattr(obj, part, None)
    return obj


def padded_rows(t: int) -> int:
    """``t`` rounded up to a step of 1/16 of its power of two (at least 8): 64 distinct values up to
    8,192 tokens; above 64 tokens at most 12.5% (on average ~4%) more rows, below it at most 7.

    Why: on CPU, bfloat16/float16 matrix multiplies go through oneDNN, which builds a kernel for
    every new row count and keeps a bounded cache of them. A batch's row count (its total tokens
    padding-free, batch x width padded) is new almost every batch, and a batch that meets new row
    counts measured 10-22% slower than one that does not (docs/padding.md). Rounding keeps the
    shapes few enough to stay cached. float32 goes through MKL, which has no such cost, and is
    never rounded.
    """
    if t <= 8:
        return 8
    step = max(8, (1 << (t - 1).bit_length()) // 16)
    return -(-t // step) * step


# On CPU, torch's fused attention kernel (flash_attention_for_cpu) runs a sequence length that is
# not a multiple of its tile far slower than the next multiple: in bfloat16 on an AMX Xeon, 8 x 127
# tokens took 2.3x the time of 8 x 128. Padding the attention width to a multiple of 16 with a key
# mask took the attention over lengths 5-509 to 0.81x of the exact widths in bfloat16 and 0.94x in
# float32, and makes its cost grow smoothly with the length, which
# the cost model's features can price.
CPU_ATTENTION_MULTIPLE = 16


def attention_width(n: int, multiple: int) -> int:
    """``n`` rounded up to a multiple of ``multiple`` (``multiple`` 1: ``n``)."""
    return -(-n // multiple) * multiple


class LeanEncoder:
    """Plain-tensor BERT-family encoder. Build with :meth:`from_hf`; call :meth:`forward_padded`."""

    def __init__(
        self, model: Any, pooling: str = "mean", normalize: bool = False, chunk_tokens: int = 1024
    ) -> None:
        if pooling not in POOLINGS:
            raise ValueError(f"lean encoder: pooling must be one of {POOLINGS}, got {pooling!r}")
        base, layout = layout_of(model)
        cfg = base.config
        pos_type = getattr(cfg, "position_embedding_type", "absolute") or "absolute"
        if pos_type != "absolute":
            raise ValueError(
                f"lean encoder: position_embedding_type {pos_type!r} is not supported, only 'absolute'"
            )
        act = getattr(cfg, layout.activation, "gelu")
        if act not in _ACTIVATIONS:
            raise ValueError(f"lean encoder: hidden_act {act!r} not supported; one of {sorted(_ACTIVATIONS)}")
        if chunk_tokens < 1:
            raise ValueError(f"lean encoder: chunk_tokens must be >= 1, got {chunk_tokens}")
        self.pooling = pooling
        self.normalize = normalize
        self.chunk_tokens = chunk_tokens
        self.act = _ACTIVATIONS[act]
        self.hidden = int(cfg.hidden_size)
        self.num_heads = int(cfg.num_attention_heads)
        self.head_dim = self.hidden // self.num_heads
        emb = base.embeddings
        self.eps = float(emb.LayerNorm.eps)
        # RoBERTa/XLM-R/MPNet count positions from padding_idx + 1 (fairseq); BERT and DistilBERT from 0.
        self.padding_idx: int | None = getattr(emb, "padding_idx", None)
        self.position_offset = 0 if self.padding_idx is None else self.padding_idx + 1
        self.max_length = int(cfg.max_position_embeddings) - self.position_offset
        with torch.no_grad():
            self.word_emb = emb.word_embeddings.weight.detach().clone()
            pos = emb.position_embeddings.weight
            # Token type is always 0 for single-segment inputs: fold that row into the position table.
            self.pos_emb = (pos + emb.token_type_embeddings.weight[0] if layout.token_types else pos).detach(
                ).clone()
            self.emb_ln = (emb.LayerNorm.weight.detach().clone(), emb.LayerNorm.bias.detach().clone())
            self.layers = [self._layer(layer, layout) for layer in _get(base, layout.layers)]
            # MPNet: the relative position bias [heads, w, w] of every width up to the model's limit
            # (rounded up as attention rounds it); relative, so any width's is the top-left corner
            self.position_bias: torch.Tensor | None = None
            if layout.relative_bias:
                width = attention_width(self.max_length, CPU_ATTENTION_MULTIPLE)
                probe = emb.word_embeddings.weight.new_zeros(1, width, 1)
                self.position_bias = base.encoder.compute_position_bias(probe)[0].detach().clone()
        self.device = self.word_emb.device
        self.dtype = self.word_emb.dtype

    @classmethod
    def from_hf(cls, model: Any, pooling: str = "mean", normalize: bool = False) -> LeanEncoder:
        return cls(model, pooling=pooling, normalize=normalize)

    @property
    def dim(self) -> int:
        return self.hidden

    @staticmethod
    def _layer(layer: Any, layout: Layout) -> LayerWeights:
        q, k, v = (_get(layer, p) for p in (layout.q, layout.k, layout.v))

        def c(path: str, part: str) -> torch.Tensor:
            return getattr(_get(layer, path), part).detach().clone().contiguous()

        return LayerWeights(
            qkv_w=torch.cat([q.weight, k.weight, v.weight]).detach().contiguous(),
            qkv_b=torch.cat([q.bias, k.bias, v.bias]).detach().contiguous(),
            out_w=c(layout.out, "weight"),
            out_b=c(layout.out, "bias"),
            ln1_w=c(layout.ln1, "weight"),
            ln1_b=c(layout.ln1, "bias"),
            ffn_in_w=c(layout.ffn_in, "weight"),
            ffn_in_b=c(layout.ffn_in, "bias"),
            ffn_out_w=c(layout.ffn_out, "weight"),
            ffn_out_b=c(layout.ffn_out, "bias"),
            ln2_w=c(layout.ln2, "weight"),
            ln2_b=c(layout.ln2, "bias"),
        )

    def attention_mask(self, keys: torch.Tensor | None, width: int) -> torch.Tensor | None:
        """The SDPA mask for sequences attended at ``width``: ``keys`` ``[B, width]`` (True = a real
        key; None = every key real) as a ``[B, 1, 1, width]`` boolean mask, or with a relative position
        bias (MPNet) the bias ``[1 | B, heads, width, width]`` with -inf on the masked keys."""
        if self.position_bias is None:
            return None if keys is None else keys[:, None, None, :]
        bias = self.position_bias[:, :width, :width].unsqueeze(0)
        if keys is None:
            return bias
        return torch.where(keys[:, None, None, :], bias, torch.tensor(float("-inf"), dtype=bias.dtype,
                                                                       device=bias.device))

    # -- shared pieces (token-wise: they work on [..., H] whatever the leading shape) ------------
    def embed(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.word_emb[ids] + self.pos_emb[positions]
        return F.layer_norm(x, (self.hidden,), self.emb_ln[0], self.emb_ln[1], self.eps)

    def post_attention(self, lw: LayerWeights, x: torch.Tensor, ctx: torch.Tensor) -> torch.Tensor:
        """Output projection + residual + LN, then the feed-forward block + residual + LN.

        Token-wise, so it runs on row chunks of ``chunk_tokens``: the ``[T, 4H]`` feed-forward
        intermediate of a 4k-token batch is ~25 MB and falls out of cache; measured on CPU, batches
        over ~2k tokens cost 20-30% more per token unless chunked (docs/padding.md).
        """
        shape = x.shape
        x2, c2 = x.reshape(-1, self.hidden), ctx.reshape(-1, self.hidden)
        t, step = x2.shape[0], self.chunk_tokens
        if t <= step:
            return self._post(lw, x2, c2).view(shape)
        out = torch.empty_like(x2)
        for s in range(0, t, step):
            out[s : s + step] = self._post(lw, x2[s : s + step], c2[s : s + step])
        return out.view(shape)

    def _post(self, lw: LayerWeights, x: torch.Tensor, ctx: torch.Tensor) -> torch.Tensor:
        h = (self.hidden,)
        x = F.layer_norm(F.linear(ctx, lw.out_w, lw.out_b).add_(x), h, lw.ln1_w, lw.ln1_b, self.eps)
        f = self.act(F.linear(x, lw.ffn_in_w, lw.ffn_in_b))
        return F.layer_norm(F.linear(f, lw.ffn_out_w, lw.ffn_out_b).add_(x), h, lw.ln2_w, lw.ln2_b, self.eps)

    def finish(self, pooled: torch.Tensor) -> torch.Tensor:
        return F.normalize(pooled, p=2.0, dim=-1) if self.normalize else pooled

    # -- padded forward -------------------------------------------------------------------------
    def hidden_padded(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Last hidden states ``[B, L, H]`` of a padded batch, as HF computes them.

        ``position_ids`` as HF takes them (give them for left padding; default: HF's own rule).
        """
        b, n = input_ids.shape
        input_ids = input_ids.to(self.device)
        all_real = attention_mask is None or bool(attention_mask.all())
        if position_ids is not None:
            positions = position_ids.to(self.device)
        elif self.padding_idx is None:
            positions = torch.arange(n, device=self.device).expand(b, n)
        else:  # fairseq positions, exactly HF's create_position_ids_from_input_ids
            m = input_ids.ne(self.padding_idx).long()
            positions = torch.cumsum(m, dim=1) * m + self.padding_idx
        # the token-wise work on [rows, H]: b x n rows, rounded in bf16/fp16 on CPU (padded_rows)
        t = b * n
        rows = padded_rows(t) if self._pads_rows() else t
        x = self.embed(input_ids, positions).reshape(t, self.hidden)
        if rows > t:
            x = F.pad(x, (0, 0, 0, rows - t))
        # Attention runs at width w: n rounded up to attention_multiple() (CPU), the extra keys masked.
        # A key-padding mask only; with no padding, None lets SDPA take its unmasked fast path.
        w = attention_width(n, self.attention_multiple())
        keys = torch.ones(b, n, dtype=torch.bool, device=self.device) if attention_mask is None else (
            attention_mask.to(self.device, torch.bool))
        mask = self.attention_mask(None if all_real and w == n else F.pad(keys, (0, w - n)), w)
        nh, hd = self.num_heads, self.head_dim
        for lw in self.layers:
            qkv = F.linear(x, lw.qkv_w, lw.qkv_b)[:t].view(b, n, 3, nh, hd)
            if w > n:
                qkv = F.pad(qkv, (0, 0, 0, 0, 0, 0, 0, w - n))
            qkv = qkv.permute(2, 0, 3, 1, 4)
            ctx = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], attn_mask=mask)
            ctx = ctx[:, :, :n].transpose(1, 2).reshape(t, self.hidden)
            if rows > t:
                ctx = F.pad(ctx, (0, 0, 0, rows - t))
            x = self.post_attention(lw, x, ctx)
        return x[:t].view(b, n, self.hidden)

    def _pads_rows(self) -> bool:
        return self.device.type == "cpu" and self.word_emb.dtype in (torch.bfloat16, torch.float16)

    def attention_multiple(self) -> int:
        """What attention widths round up to (keys masked): ``CPU_ATTENTION_MULTIPLE`` on CPU, else 1."""
        return CPU_ATTENTION_MULTIPLE if self.device.type == "cpu" else 1

    def forward_padded(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Pooled (and normalised when configured) embeddings ``[B, H]`` of a padded batch."""
        with torch.inference_mode():
            x = self.hidden_padded(input_ids, attention_mask)
            if self.pooling == "cls":
                return self.finish(x[:, 0])
            if attention_mask is None:
                return self.finish(x.mean(dim=1))
            m = attention_mask.to(self.device, x.dtype).unsqueeze(-1)
            return self.finish((x * m).sum(dim=1) / m.sum(dim=1).clamp_min(1e-9))
