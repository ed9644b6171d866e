"""The default generative model: a small Llama built from a config with seeded random weights.

No download: ``LlamaForCausalLM(LlamaConfig(...))`` after ``torch.manual_seed(seed)``. 6 layers x 512
hidden, 8 query heads sharing 4 KV heads (GQA), SwiGLU 1376, vocab 4096 (the built-in tokenizer's
size) runs on 2 CPU cores. ``initializer_range`` 0.02 is the HF default; tests that compare greedy
tokens with HF use 0.06 because a random model at 0.02 has near-tied logits (a top-2 gap down to
~3e-4).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class LLMModelConfig:
    vocab_size: int = 4096
    hidden_size: int = 512
    intermediate_size: int = 1376
    num_hidden_layers: int = 6
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    initializer_range: float = 0.02
    seed: int = 0

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError("llm model: hidden_size must be a multiple of num_attention_heads")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("llm model: num_attention_heads must be a multiple of num_key_value_heads")
        if self.vocab_size < 300:
            raise ValueError(f"llm model: vocab_size must be >= 300 for the built-in tokenizer, got "
                             f"{self.vocab_size}")

    def to_hf(self) -> Any:
        from transformers import LlamaConfig

        from batchpilot.models.llm.tokenizer import BOS_ID, EOS_ID, PAD_ID

        return LlamaConfig(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            max_position_embeddings=self.max_position_embeddings,
            rope_theta=self.rope_theta,
            rms_norm_eps=self.rms_norm_eps,
            initializer_range=self.initializer_range,
            bos_token_id=BOS_ID,
            eos_token_id=EOS_ID,
            pad_token_id=PAD_ID,
            tie_word_embeddings=False,
        )
