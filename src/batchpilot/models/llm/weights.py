"""HF ``LlamaForCausalLM`` in, the runner's fused weights out.

``load_hf_llama`` loads a local checkpoint (``local_files_only``: never the hub) or builds the seeded
random default. ``LlamaWeights.from_hf`` fuses q/k/v into one matrix and gate/up into another (two
matmuls per layer instead of five) and takes RoPE's ``inv_freq`` and scaling from the HF module itself,
so any RoPE variant HF computes statically (default, llama3, linear, yarn) is reproduced exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from batchpilot.models.seeded import LLMModelConfig


def load_hf_llama(model_path: str | Path | None, config: LLMModelConfig | None = None,
                  dtype: torch.dtype = torch.float32) -> Any:
    """A ``LlamaForCausalLM`` in eval mode: from a local folder, or random from ``config`` and its seed."""
    from transformers import LlamaForCausalLM

    if model_path is not None:
        model = LlamaForCausalLM.from_pretrained(str(model_path), local_files_only=True, dtype=dtype)
    else:
        cfg = config or LLMModelConfig()
        torch.manual_seed(cfg.seed)
        model = LlamaForCausalLM(cfg.to_hf()).to(dtype)
    return model.eval()


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    qkv: torch.Tensor  # [(H + 2*KV) * hd, D]
    o: torch.Tensor
    post_norm: torch.Tensor
    gate_up: torch.Tensor  # [2 * I, D]
    down: torch.Tensor


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
        if getattr(cfg, "model_type", "llama") not in ("llama", "mistral", "qwen2"):
            raise ValueError(f"llm weights: model_type {cfg.model_type!r} is not a Llama-family decoder")
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        layers = []
        with torch.no_grad():
            for layer in model.model.layers:
                a, m = layer.self_attn, layer.mlp
                if any(getattr(p, "bias", None) is not None for p in (a.q_proj, a.o_proj, m.gate_proj)):
                    raise ValueError("llm weights: attention/MLP biases are not supported")
                # fused tensors are new; the HF module's projections become views of them at once, so
                # loading holds one layer's projections twice at most, never the whole model
                qkv = torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]).detach().contiguous()
                gate_up = torch.cat([m.gate_proj.weight, m.up_proj.weight]).detach().contiguous()
                nq, nk = a.q_proj.weight.shape[0], a.k_proj.weight.shape[0]
                a.q_proj.weight.data, a.k_proj.weight.data = qkv[:nq], qkv[nq : nq + nk]
                a.v_proj.weight.data = qkv[nq + nk :]
                ni = m.gate_proj.weight.shape[0]
                m.gate_proj.weight.data, m.up_proj.weight.data = gate_up[:ni], gate_up[ni:]
                layers.append(LayerWeights(  # the rest is shared with the HF module, not copied
                    input_norm=layer.input_layernorm.weight.detach(),
                    qkv=qkv,
                    o=a.o_proj.weight.detach(),
                    post_norm=layer.post_attention_layernorm.weight.detach(),
                    gate_up=gate_up,
                    down=m.down_proj.weight.detach(),
                ))
            rotary = model.model.rotary_emb
            eos = cfg.eos_token_id
            eos_ids = () if eos is None else (tuple(eos) if isinstance(eos, list | tuple) else (int(eos),))
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
                max_position_embeddings=cfg.max_position_embeddings,
                vocab_size=cfg.vocab_size,
                eos_token_ids=eos_ids,
            )
