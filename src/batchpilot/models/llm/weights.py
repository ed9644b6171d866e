"""An HF decoder checkpoint in, the runner's fused weights out.

``load_hf_llama`` loads a local checkpoint (``AutoModelForCausalLM``, ``local_files_only``: never the
hub) or builds the seeded random default (a Llama). ``LlamaWeights.from_hf`` fuses q/k/v into one matrix
and gate/up into another (two matmuls per layer instead of five) and takes RoPE's ``inv_freq`` and
scaling from the HF module itself, so any RoPE variant HF computes statically (default, llama3,
linear, yarn) is reproduced exactly.

One runner serves every family; what differs is data, ``FAMILIES``: a ``DecoderSpec`` per
``model_type`` (q/k/v biases as Qwen2 has them, an RMSNorm of each head's q and k before RoPE as
Qwen3 has, q/k/v and gate/up stored fused as Phi-3 has them). A checkpoint of any other
``model_type`` is refused at load with the list of the ones served.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

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


@dataclass(frozen=True)
class DecoderSpec:
    """What a decoder family adds to the Llama block, as data the runner reads."""

    qkv_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    qk_norm: bool = False  # each head's q and k pass an RMSNorm over head_dim before RoPE (Qwen3)
    fused: bool = False  # q/k/v and gate/up stored fused, in the runner's order (Phi-3)


FAMILIES: dict[str, DecoderSpec] = {
    "llama": DecoderSpec(),
    "mistral": DecoderSpec(),
    "qwen2": DecoderSpec(qkv_bias=True),
    "qwen3": DecoderSpec(qk_norm=True),
    "phi3": DecoderSpec(fused=True),
}


def family(cfg: Any) -> DecoderSpec:
    """The ``DecoderSpec`` of an HF config's ``model_type``; ``ValueError`` naming the ones served."""
    model_type = getattr(cfg, "model_type", "llama")
    if model_type not in FAMILIES:
        raise ValueError(f"llm model: model_type {model_type!r} is not served; served: "
                         f"{', '.join(sorted(FAMILIES))}")
    if float(getattr(cfg, "partial_rotary_factor", 1.0) or 1.0) != 1.0:
        raise ValueError(f"llm model: {model_type} with partial_rotary_factor {cfg.partial_rotary_factor} is "
                         "not served (the runner rotates every dimension of a head)")
    return FAMILIES[model_type]


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


def served_positions(cfg: Any) -> int:
    """The positions served: the model's, or fewer for a sliding-window attention (Mistral's, a Qwen's
    with ``use_sliding_window``), which the runner's full attention reproduces only within the window."""
    window = getattr(cfg, "sliding_window", None) if getattr(cfg, "use_sliding_window", True) else None
    return int(min(cfg.max_position_embeddings, window)) if window else int(cfg.max_position_embeddings)


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    qkv: torch.Tensor  # [(H + 2*KV) * hd, D]
    o: torch.Tensor
    post_norm: torch.Tensor
    gate_up: torch.Tensor  # [2 * I, D]
    down: torch.Tensor
    qkv_bias: torch.Tensor | None = None  # [(H + 2*KV) * hd] (``DecoderSpec.qkv_bias``)
    q_norm: torch.Tensor | None = None  # [hd] (``DecoderSpec.qk_norm``)
    k_norm: torch.Tensor | None = None

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor of the layer, for the memory accounts."""
        extra = [t for t in (self.qkv_bias, self.q_norm, self.k_norm) if t is not None]
        return [self.input_norm, self.qkv, self.o, self.post_norm, self.gate_up, self.down, *extra]


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

    @classmethod
    def from_hf(cls, model: Any) -> LlamaWeights:
        cfg = model.config
        spec = family(cfg)
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        layers = []
        with torch.no_grad():
            for layer in model.model.layers:
                a, m = layer.self_attn, layer.mlp
                qkv, gate_up, bias = fused_projections(a, m, spec, cfg.model_type)
                layers.append(LayerWeights(  # the rest is shared with the HF module, not copied
                    input_norm=layer.input_layernorm.weight.detach(),
                    qkv=qkv,
                    o=a.o_proj.weight.detach(),
                    post_norm=layer.post_attention_layernorm.weight.detach(),
                    gate_up=gate_up,
                    down=m.down_proj.weight.detach(),
                    qkv_bias=bias,
                    q_norm=a.q_norm.weight.detach() if spec.qk_norm else None,
                    k_norm=a.k_norm.weight.detach() if spec.qk_norm else None,
                ))
            rotary = model.model.rotary_emb
            gen = getattr(model, "generation_config", None)
            eos_ids = eos_of(cfg.eos_token_id, getattr(gen, "eos_token_id", None))
            return cls(
                embed=model.model.embed_tokens.weight.detach(),
                layers=layers,
                norm=model.model.norm.weight.detach(),
                lm_head=model.lm_head.weight.detach(),
                inv_freq=rotary.inv_freq.detach().float().clone(),
                attention_scaling=float(getattr(rotary, "attention_scaling", 1.0)),
                num_heads=cfg.num_attention_heads,
                num_kv_heads=cfg.num_key_value_heads,
                head_dim=head_dim,
                rms_norm_eps=cfg.rms_norm_eps,
                max_position_embeddings=served_positions(cfg),
                vocab_size=cfg.vocab_size,
                eos_token_ids=eos_ids,
            )
