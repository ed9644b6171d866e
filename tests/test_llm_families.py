"""One runner for every decoder family it serves (``models.llm.weights.FAMILIES``): greedy tokens equal to
HF ``generate()`` for a tiny seeded model of each family, alone and batched with chunked prefill, loaded
from a saved folder as a user's checkpoint is; any other ``model_type`` refused with the list served.

The random models use ``initializer_range=0.06`` (as ``tests/test_llm_model.py``: no near-ties in the top
logits), and the terms a family adds (Qwen2's q/k/v biases, Qwen3's q/k norms) are drawn away from their
initial zeros and ones, so that a runner that ignored them would produce other tokens.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from batchpilot.core.llm.config import LLMSchedulerConfig
from batchpilot.core.llm.scheduler import LLMScheduler
from batchpilot.models.llm.runner import LLMModelRunner
from batchpilot.models.llm.weights import FAMILIES, LlamaWeights, load_hf_llama
from llm_greedy import engine_greedy, hf_greedy

MAX_TOKENS = 10
SHAPE = dict(vocab_size=4096, hidden_size=256, intermediate_size=688, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
             initializer_range=0.06, rms_norm_eps=1e-6)


def build(model_type: str, seed: int = 1) -> Any:
    """A tiny seeded model of ``model_type`` from its transformers config class, in eval mode."""
    import transformers

    config_cls = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
                  "qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config,
                  "phi3": transformers.Phi3Config}[model_type]
    extra: dict[str, Any] = {"tie_word_embeddings": False}
    if model_type in ("mistral", "phi3"):
        extra["sliding_window"] = None
    if model_type == "phi3":  # its config names token ids of a 32k vocabulary
        extra.update(pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if model_type == "qwen3":
        extra["head_dim"] = 64
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config_cls(**SHAPE, **extra)).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for layer in model.model.layers:
            a = layer.self_attn
            for proj in (getattr(a, "q_proj", None), getattr(a, "k_proj", None), getattr(a, "v_proj", None)):
                if proj is not None and proj.bias is not None:
                    proj.bias.copy_(0.2 * torch.randn(proj.bias.shape, generator=g))
            for norm in (getattr(a, "q_norm", None), getattr(a, "k_norm", None)):
                if norm is not None:
                    norm.weight.copy_(1.0 + 0.3 * torch.randn(norm.weight.shape, generator=g))
    model.generation_config.eos_token_id = None
    return model


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(7, 4096, (n,), generator=g).tolist() for n in (5, 17, 33, 8, 41, 3)]


def reference(hf: Any, ps: list[list[int]]) -> list[list[int]]:
    return hf_greedy(hf, ps, MAX_TOKENS)


def greedy(weights: LlamaWeights, ps: list[list[int]], **cfg: Any) -> list[list[int]]:
    """Scheduler + runner to completion, every prompt at once."""
    config = LLMSchedulerConfig(block_size=8, max_model_len=512, **cfg)
    runner = LLMModelRunner(weights, config.num_kv_blocks, config.block_size, decode_run_tokens=64)
    return engine_greedy(LLMScheduler(config), runner, ps, MAX_TOKENS)


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_each_family_matches_hf_alone_and_in_a_chunked_batch(model_type: str, tmp_path: Path) -> None:
    hf = build(model_type)
    ps = prompts()
    want = reference(hf, ps)
    hf.save_pretrained(tmp_path)  # served from the folder, as a user's checkpoint
    loaded = load_hf_llama(tmp_path)
    assert loaded.config.model_type == model_type
    weights = LlamaWeights.from_hf(loaded)
    assert greedy(weights, ps[:1]) == want[:1]  # alone
    weights = LlamaWeights.from_hf(load_hf_llama(tmp_path))
    assert greedy(weights, ps, max_num_batched_tokens=32, enable_prefix_caching=True) == want


def test_the_family_terms_change_the_tokens() -> None:
    """The runner reads Qwen2's biases and Qwen3's norms: without them the tokens differ."""
    ps = prompts()[:2]
    for model_type, attrs in (("qwen2", ("qkv_bias",)), ("qwen3", ("q_norm", "k_norm"))):
        weights = LlamaWeights.from_hf(build(model_type))
        full = greedy(weights, ps)
        weights = LlamaWeights.from_hf(build(model_type))
        for layer in weights.layers:
            for name in attrs:
                setattr(layer, name, None)
        assert greedy(weights, ps) != full, model_type


def test_another_model_type_is_refused_with_the_families_served(tmp_path: Path) -> None:
    import transformers

    transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=64, n_head=2,
                                                         vocab_size=512)).save_pretrained(tmp_path)
    served = "served: llama, mistral, phi3, qwen2, qwen3"
    with pytest.raises(ValueError, match=rf"model_type 'gpt2' is not served; {served}"):
        load_hf_llama(tmp_path)


def test_a_sliding_window_is_served_up_to_its_window() -> None:
    """The runner attends every earlier token: a model with a sliding window is served only as far as the
    window reaches, which the engine then takes as the model's length limit."""
    import transformers

    from batchpilot.models.llm.weights import served_positions

    assert served_positions(transformers.MistralConfig(**SHAPE, sliding_window=64)) == 64
    assert served_positions(transformers.MistralConfig(**SHAPE, sliding_window=None)) == 512
    off = transformers.Qwen2Config(**SHAPE, sliding_window=64, use_sliding_window=False)
    assert served_positions(off) == 512
    assert served_positions(transformers.LlamaConfig(**SHAPE)) == 512


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3", "phi3"])
def test_the_fallback_shares_the_runners_tensors_and_still_generates_the_same(model_type: str) -> None:
    """``share_runner_weights`` points the HF model (the static fallback's) at the runner's fused tensors,
    the family's biases and norms included: HF then generates what it generated on its own."""
    from batchpilot.runtime.llm.build import share_runner_weights

    hf = build(model_type)
    ps = prompts()[:2]
    want = reference(hf, ps)
    weights = LlamaWeights.from_hf(hf)
    runner = LLMModelRunner(weights, 64, 8)
    share_runner_weights(hf, runner.w)
    layer, w = hf.model.layers[0], runner.w.layers[0]
    shared = getattr(layer.self_attn, "qkv_proj", None) or layer.self_attn.q_proj
    assert shared.weight.data_ptr() == w.qkv.data_ptr()
    assert reference(hf, ps) == want


def test_every_eos_of_the_config_and_its_generation_config_ends_a_sequence(tmp_path: Path) -> None:
    """Llama 3 and Qwen name several EOS ids in ``generation_config.json``: all of them are read."""
    from batchpilot.models.llm.weights import eos_of

    hf = build("llama")
    hf.config.eos_token_id = 2
    hf.generation_config.eos_token_id = [2, 7, 9]
    hf.save_pretrained(tmp_path)
    assert LlamaWeights.from_hf(load_hf_llama(tmp_path)).eos_token_ids == (2, 7, 9)
    assert eos_of(None, 5) == (5,) and eos_of([1, 2], (2, 3), None) == (1, 2, 3) and eos_of(None) == ()
