"""An HF decoder checkpoint in, the runner's fused weights out.

``load_hf_llama`` loads a local checkpoint (``AutoModelForCausalLM``, ``local_files_only``: never the
hub) or builds the seeded random default (a Llama). ``LlamaWeights.from_hf`` fuses q/k/v into one matrix
and gate/up into another (two matmuls per layer instead of five) and takes RoPE's ``inv_freq`` and
scaling from the HF module itself, so any RoPE variant HF computes statically (default, llama3,
linear, yarn) is reproduced exactly, and so is a second RoPE for sliding-window layers (Gemma 3's).

One runner serves every family; what differs is data, ``FAMILIES``: a ``DecoderSpec`` per
``model_type`` (q/k/v biases as Qwen2 has them, an RMSNorm of each head's q and k before RoPE as
Qwen3 and Gemma 3 have, q/k/v and gate/up stored fused as Phi-3 has them, Gemma's norms, scaled
embeddings and soft-caps). What a config says per layer (its sliding window, its soft-cap, which RoPE)
is read into ``LayerWeights``. A checkpoint of any other ``model_type`` is refused at load with the list
of the ones served.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from batchpilot.models.seeded import LLMModelConfig


def load_hf_llama(model_path: str | Path | None, config: LLMModelConfig | None = None,
                  dtype: torch.dtype = torch.float32) -> Any:
    """A causal LM in eval mode: from a local folder (its ``model_type`` must be one of ``FAMILIES``), or a
    random Llama from ``config`` and its seed."""
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaForCausalLM

    if model_path is not None:
        family(AutoConfig.from_pretrained(str(model_path), local_files_only=True))  # refused before loading
        model = AutoModelForCausalLM.from_pretrained(str(model_path), local_files_only=True, dtype=dtype)
    else:
        cfg = config or LLMModelConfig()
        torch.manual_seed(cfg.seed)
        model = LlamaForCausalLM(cfg.to_hf()).to(dtype)
    return model.eval()


# (HF module of each decoder layer, the runner's role for it): Llama-like layers norm the input of the
# attention and of the MLP; Gemma's also norm what each branch returns before it joins the residual
LLAMA_NORMS = (("input_layernorm", "input_norm"), ("post_attention_layernorm", "mlp_norm"))
GEMMA_NORMS = (("input_layernorm", "input_norm"), ("post_attention_layernorm", "attn_out_norm"),
               ("pre_feedforward_layernorm", "mlp_norm"), ("post_feedforward_layernorm", "mlp_out_norm"))


@dataclass(frozen=True)
class DecoderSpec:
    """What a decoder family adds to the Llama block, as data the runner reads."""

    qkv_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    qk_norm: bool = False  # each head's q and k pass an RMSNorm over head_dim before RoPE (Qwen3, Gemma 3)
    fused: bool = False  # q/k/v and gate/up stored fused, in the runner's order (Phi-3)
    norms: tuple[tuple[str, str], ...] = LLAMA_NORMS  # which norms a layer has (above)
    norm_plus_one: bool = False  # RMSNorm scales by (1 + w), in float32 before the cast back (Gemma)
    embed_scaled: bool = False  # embeddings times sqrt(hidden_size), rounded to the model's dtype (Gemma)
    attn_softcap: bool = False  # attention scores soft-capped by ``attn_logit_softcapping`` (Gemma 2)
    final_softcap: bool = False  # logits soft-capped by ``final_logit_softcapping`` (Gemma's causal LMs)
    # where a sliding window applies: "layer_types" (each layer the config's ``layer_types`` marks
    # sliding_attention), "all" (every layer, when the config sets one), "never"
    sliding: str = "layer_types"


FAMILIES: dict[str, DecoderSpec] = {
    "llama": DecoderSpec(sliding="never"),
    "mistral": DecoderSpec(sliding="all"),
    "qwen2": DecoderSpec(qkv_bias=True),
    "qwen3": DecoderSpec(qk_norm=True),
    "phi3": DecoderSpec(fused=True, sliding="all"),
    "gemma2": DecoderSpec(norms=GEMMA_NORMS, norm_plus_one=True, embed_scaled=True, attn_softcap=True,
                          final_softcap=True),
    # HF's Gemma 3 attention never applies attn_logit_softcapping, though its config has the field
    "gemma3_text": DecoderSpec(qk_norm=True, norms=GEMMA_NORMS, norm_plus_one=True, embed_scaled=True,
                               final_softcap=True),
    # Gemma 3 of 4B and up is multimodal (Gemma3ForConditionalGeneration): its language model is served, on
    # text; HF's multimodal head applies no final soft-cap
    "gemma3": DecoderSpec(qk_norm=True, norms=GEMMA_NORMS, norm_plus_one=True, embed_scaled=True),
}

# the MLP activations served (HF's ``ACT2FN`` names; ``hidden_activation`` or ``hidden_act``)
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh"),
}


def family(top: Any) -> DecoderSpec:
    """The ``DecoderSpec`` of an HF config's ``model_type``; ``ValueError`` naming the ones served, or what
    of its text decoder the runner does not do."""
    model_type = getattr(top, "model_type", "llama")
    if model_type not in FAMILIES:
        raise ValueError(f"llm model: model_type {model_type!r} is not served; served: "
                         f"{', '.join(sorted(FAMILIES))}")
    cfg = top.get_text_config() if hasattr(top, "get_text_config") else top
    if float(getattr(cfg, "partial_rotary_factor", 1.0) or 1.0) != 1.0:
        raise ValueError(f"llm model: {model_type} with partial_rotary_factor {cfg.partial_rotary_factor} is "
                         "not served (the runner rotates every dimension of a head)")
    if getattr(cfg, "use_bidirectional_attention", False):
        raise ValueError(f"llm model: {model_type} with use_bidirectional_attention is not served (the "
                         "runner attends causally)")
    if activation(cfg) not in ACTIVATIONS:
        raise ValueError(f"llm model: {model_type} with activation {activation(cfg)!r} is not served; "
                         f"served: {', '.join(sorted(ACTIVATIONS))}")
    return FAMILIES[model_type]


def decoder_of(model: Any) -> tuple[Any, Any]:
    """A causal LM's text decoder (the module holding ``layers``) and its config: the model's own, or a
    multimodal model's language model (Gemma 3's ``Gemma3ForConditionalGeneration``, served on text)."""
    language_model = getattr(model.model, "language_model", None)
    if language_model is None:
        return model.model, model.config
    return language_model, model.config.get_text_config()


def activation(cfg: Any) -> str:
    """The MLP activation's name: Gemma's configs call it ``hidden_activation``, the others ``hidden_act``."""
    return str(getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", "silu"))


def fused_projections(a: Any, m: Any, spec: DecoderSpec,
                      model_type: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One layer's q/k/v and gate/up as the runner's fused matrices (a family that stores them fused,
    as the checkpoint has them), and the fused q/k/v bias where the family has one. Fused tensors are
    new; the HF module's projections become views of them at once, so loading holds one layer's
    projections twice at most, never the whole model."""
    if spec.fused:
        if any(getattr(p, "bias", None) is not None for p in (a.qkv_proj, a.o_proj, m.gate_up_proj)):
            raise ValueError(f"llm weights: {model_type} with projection biases is not supported")
        return a.qkv_proj.weight.detach(), m.gate_up_proj.weight.detach(), None
    biased = [p for p in (a.q_proj, a.k_proj, a.v_proj) if getattr(p, "bias", None) is not None]
    if len(biased) not in (0, 3) or (biased and not spec.qkv_bias) or any(
            getattr(p, "bias", None) is not None for p in (a.o_proj, m.gate_proj, m.up_proj, m.down_proj)):
        raise ValueError(f"llm weights: {model_type} with biases outside q/k/v of its family is not "
                         "supported")
    bias = torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias]).detach().contiguous() if biased else None
    qkv = torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]).detach().contiguous()
    gate_up = torch.cat([m.gate_proj.weight, m.up_proj.weight]).detach().contiguous()
    nq, nk = a.q_proj.weight.shape[0], a.k_proj.weight.shape[0]
    a.q_proj.weight.data, a.k_proj.weight.data = qkv[:nq], qkv[nq : nq + nk]
    a.v_proj.weight.data = qkv[nq + nk :]
    ni = m.gate_proj.weight.shape[0]
    m.gate_proj.weight.data, m.up_proj.weight.data = gate_up[:ni], gate_up[ni:]
    return qkv, gate_up, bias


def eos_of(*entries: Any) -> tuple[int, ...]:
    """Every EOS id the model's config and its ``generation_config.json`` name (each an id, a list of
    ids, or None), in order, once each: Llama 3 and Qwen list several in the latter only."""
    out: list[int] = []
    for e in entries:
        for i in (e if isinstance(e, list | tuple) else () if e is None else (e,)):
            if int(i) not in out:
                out.append(int(i))
    return tuple(out)


def layer_windows(cfg: Any, spec: DecoderSpec) -> list[int | None]:
    """Each layer's sliding window as HF's attention applies it (None: full attention). A query at
    position ``p`` of a layer with window ``W`` attends to positions ``p - W + 1 .. p``."""
    n = int(cfg.num_hidden_layers)
    window = getattr(cfg, "sliding_window", None)
    if spec.sliding == "never" or window is None or not getattr(cfg, "use_sliding_window", True):
        return [None] * n
    types = getattr(cfg, "layer_types", None) if spec.sliding == "layer_types" else None
    if types is None:
        return [int(window)] * n
    return [int(window) if t == "sliding_attention" else None for t in types]


def rope_of(rotary: Any, layer_type: str) -> tuple[torch.Tensor, float]:
    """RoPE's ``inv_freq`` and scaling for a layer type: a rotary module with one table per type (Gemma 3:
    ``sliding_attention_inv_freq`` with ``rope_local_base_freq``) has them by name, the others one."""
    inv_freq = getattr(rotary, f"{layer_type}_inv_freq", None)
    if inv_freq is None:
        return rotary.inv_freq.detach().float().clone(), float(getattr(rotary, "attention_scaling", 1.0))
    return inv_freq.detach().float().clone(), float(getattr(rotary, f"{layer_type}_attention_scaling", 1.0))


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    qkv: torch.Tensor  # [(H + 2*KV) * hd, D]
    o: torch.Tensor
    mlp_norm: torch.Tensor  # in front of the MLP (Llama's post_attention_layernorm)
    gate_up: torch.Tensor  # [2 * I, D]
    down: torch.Tensor
    qkv_bias: torch.Tensor | None = None  # [(H + 2*KV) * hd] (``DecoderSpec.qkv_bias``)
    q_norm: torch.Tensor | None = None  # [hd] (``DecoderSpec.qk_norm``)
    k_norm: torch.Tensor | None = None
    attn_out_norm: torch.Tensor | None = None  # on the attention's output (``GEMMA_NORMS``)
    mlp_out_norm: torch.Tensor | None = None  # on the MLP's output
    window: int | None = None  # sliding window in positions (``layer_windows``); None: full attention
    softcap: float | None = None  # attention scores become tanh(s / c) * c before the softmax
    local_rope: bool = False  # RoPE from ``LlamaWeights.local_inv_freq`` (a sliding layer of Gemma 3)

    TENSORS = ("input_norm", "qkv", "o", "mlp_norm", "gate_up", "down", "qkv_bias", "q_norm", "k_norm",
               "attn_out_norm", "mlp_out_norm")

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor of the layer, for the memory accounts."""
        return [t for t in (getattr(self, name) for name in self.TENSORS) if t is not None]


@dataclass
class LlamaWeights:
    embed: torch.Tensor
    layers: list[LayerWeights]
    norm: torch.Tensor
    lm_head: torch.Tensor
    inv_freq: torch.Tensor
    attention_scaling: float
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    spec: DecoderSpec = DecoderSpec()
    activation: str = "silu"  # a key of ``ACTIVATIONS``
    attn_scale: float | None = None  # None: head_dim ** -0.5; Gemma: query_pre_attn_scalar ** -0.5
    final_softcap: float | None = None  # logits become tanh(l / c) * c (Gemma's final_logit_softcapping)
    local_inv_freq: torch.Tensor | None = None  # the sliding layers' RoPE where it differs (Gemma 3)
    local_attention_scaling: float = 1.0

    def dense_matrices(self) -> list[torch.Tensor]:
        """Every dense matrix a step multiplies by: each layer's q/k/v, o, gate/up and down, then the head."""
        layers = [m for layer in self.layers for m in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        return [*layers, self.lm_head]

    @classmethod
    def from_hf(cls, model: Any) -> LlamaWeights:
        spec = family(model.config)
        decoder, cfg = decoder_of(model)
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        windows = layer_windows(cfg, spec)
        rotary = decoder.rotary_emb
        local = hasattr(rotary, "sliding_attention_inv_freq")
        types = getattr(cfg, "layer_types", None) or ["full_attention"] * len(windows)
        softcap = getattr(cfg, "attn_logit_softcapping", None) if spec.attn_softcap else None
        layers = []
        with torch.no_grad():
            for layer, window, layer_type in zip(decoder.layers, windows, types, strict=True):
                a, m = layer.self_attn, layer.mlp
                qkv, gate_up, bias = fused_projections(a, m, spec, cfg.model_type)
                norms = {role: getattr(layer, name).weight.detach() for name, role in spec.norms}
                layers.append(LayerWeights(  # the rest is shared with the HF module, not copied
                    qkv=qkv,
                    o=a.o_proj.weight.detach(),
                    gate_up=gate_up,
                    down=m.down_proj.weight.detach(),
                    qkv_bias=bias,
                    q_norm=a.q_norm.weight.detach() if spec.qk_norm else None,
                    k_norm=a.k_norm.weight.detach() if spec.qk_norm else None,
                    window=window,
                    softcap=float(softcap) if softcap else None,
                    local_rope=local and layer_type == "sliding_attention",
                    **norms,
                ))
            gen = getattr(model, "generation_config", None)
            eos_ids = eos_of(getattr(model.config, "eos_token_id", None), cfg.eos_token_id,
                             getattr(gen, "eos_token_id", None))
            inv_freq, scaling = rope_of(rotary, "full_attention")
            local_inv_freq, local_scaling = rope_of(rotary, "sliding_attention") if local else (None, 1.0)
            pre_attn = getattr(cfg, "query_pre_attn_scalar", None)
            final_softcap = getattr(cfg, "final_logit_softcapping", None) if spec.final_softcap else None
            return cls(
                embed=decoder.embed_tokens.weight.detach(),
                layers=layers,
                norm=decoder.norm.weight.detach(),
                lm_head=model.lm_head.weight.detach(),
                inv_freq=inv_freq,
                attention_scaling=scaling,
                num_heads=cfg.num_attention_heads,
                num_kv_heads=cfg.num_key_value_heads,
                head_dim=head_dim,
                rms_norm_eps=cfg.rms_norm_eps,
                max_position_embeddings=int(cfg.max_position_embeddings),
                vocab_size=cfg.vocab_size,
                eos_token_ids=eos_ids,
                spec=spec,
                activation=activation(cfg),
                attn_scale=float(pre_attn) ** -0.5 if pre_attn else None,
                final_softcap=float(final_softcap) if final_softcap else None,
                local_inv_freq=local_inv_freq,
                local_attention_scaling=local_scaling,
            )
