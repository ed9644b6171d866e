"""Tiny seeded decoders of every family the LLM runner serves, built offline from their transformers config
classes: what the parity tests and ``benchmarks/decoder_families.py`` serve as a user's checkpoint.

    family_config(model_type)   a 2-layer, 256-wide config of ``model_type`` (``models.llm.weights.FAMILIES``)
    build(model_type)           a seeded model of it, in eval mode, its family's terms drawn

The random models use ``initializer_range=0.06`` and a seed whose greedy path has no near-tie (``SEEDS``:
along HF's greedy path the smallest top-2 logit gap is 3e-4 or more). The terms a family adds are drawn
away from their neutral values, so that a runner that ignored one would produce other tokens: Qwen2's
q/k/v biases, the q/k norms of Qwen3 and Gemma 3, Gemma's norms (around 0, as it stores them: the norm
scales by ``1 + w``; its post-attention and post-feedforward norms near 1 so the branches outweigh the
embedding). Every family that has a sliding window has one of ``WINDOW`` positions (layer 1 of Qwen2/3
through ``max_window_layers``; Gemma's layer 0 sliding, layer 1 global; ``gemma3`` is the multimodal Gemma
3 with a one-layer vision tower, served on its language model), and Gemma 2's attention soft-cap is small
enough to bite.
"""

from __future__ import annotations

from typing import Any

import torch

from batchpilot.models.llm.weights import decoder_of

WINDOW = 16
SHAPE = dict(vocab_size=4096, hidden_size=256, intermediate_size=688, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
             initializer_range=0.06, rms_norm_eps=1e-6)
GEMMA = ("gemma2", "gemma3", "gemma3_text")
# seeds whose greedy paths (8 prompts x 32 steps under HF) have a top-2 logit gap >= 3e-4 at every step
SEEDS = {"gemma3_text": 2, "gemma3": 8}


def family_config(model_type: str, tied: bool = False, final_softcap: float | None = None) -> Any:
    """A tiny config of ``model_type`` from its transformers config class (module docstring)."""
    import transformers

    extra: dict[str, Any] = {"tie_word_embeddings": tied}
    if model_type in ("mistral", "phi3"):
        extra["sliding_window"] = WINDOW
    if model_type in ("qwen2", "qwen3"):
        extra.update(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)
    if model_type == "phi3":  # its config names token ids of a 32k vocabulary
        extra.update(pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if model_type == "gemma3":  # multimodal: its text decoder is a gemma3_text; a one-layer vision tower
        vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                 num_attention_heads=2, image_size=28, patch_size=14)
        text = family_config("gemma3_text", tied, final_softcap).to_dict()
        return transformers.Gemma3Config(text_config=text, vision_config=vision.to_dict(),
                                         mm_tokens_per_image=4, boi_token_index=4093, eoi_token_index=4094,
                                         image_token_index=4095, tie_word_embeddings=tied)
    if model_type in ("qwen3", *GEMMA):
        extra["head_dim"] = 64
    if model_type in GEMMA:
        extra.update(sliding_window=WINDOW, query_pre_attn_scalar=48, final_logit_softcapping=final_softcap,
                     layer_types=["sliding_attention", "full_attention"])
    if model_type == "gemma2":
        extra["attn_logit_softcapping"] = 1.0
    config_cls = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
                  "qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config,
                  "phi3": transformers.Phi3Config, "gemma2": transformers.Gemma2Config,
                  "gemma3_text": transformers.Gemma3TextConfig}[model_type]
    return config_cls(**SHAPE, **extra)


def build(model_type: str, seed: int | None = None, tied: bool = False,
          final_softcap: float | None = None) -> Any:
    """A tiny seeded model of ``model_type``, in eval mode, its family's terms drawn (module docstring)."""
    import transformers

    seed = SEEDS.get(model_type, 1) if seed is None else seed
    torch.manual_seed(seed)
    config = family_config(model_type, tied, final_softcap)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    g = torch.Generator().manual_seed(seed + 1)

    def draw(t: torch.Tensor, mean: float, std: float) -> None:
        t.copy_(mean + std * torch.randn(t.shape, generator=g))

    gemma = model_type in GEMMA
    decoder, _ = decoder_of(model)
    with torch.no_grad():
        for layer in decoder.layers:
            a = layer.self_attn
            for proj in (getattr(a, "q_proj", None), getattr(a, "k_proj", None), getattr(a, "v_proj", None)):
                if proj is not None and proj.bias is not None:
                    draw(proj.bias, 0.0, 0.2)
            for norm in (getattr(a, "q_norm", None), getattr(a, "k_norm", None)):
                if norm is not None:
                    draw(norm.weight, 0.0 if gemma else 1.0, 0.3)
            if gemma:
                draw(layer.input_layernorm.weight, 0.0, 0.3)
                draw(layer.pre_feedforward_layernorm.weight, 0.0, 0.3)
                draw(layer.post_attention_layernorm.weight, 1.0, 0.5)
                draw(layer.post_feedforward_layernorm.weight, 1.0, 0.5)
        if gemma:
            draw(decoder.norm.weight, 0.0, 0.3)
    model.generation_config.eos_token_id = None
    return model
