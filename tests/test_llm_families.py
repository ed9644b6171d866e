"""One runner for every decoder family it serves (``models.llm.weights.FAMILIES``): greedy tokens equal to
HF ``generate()`` for a tiny seeded model of each family, loaded from a saved folder as a user's
checkpoint is, for ``STEPS`` steps on ``PROMPTS`` prompts, each alone and all of them inside a crowd of
``CROWD`` concurrent streams with chunked prefill and prefix caching on; any other ``model_type`` refused
with the list served.

The random models use ``initializer_range=0.06`` (as ``tests/test_llm_model.py``) and a seed whose
greedy path has no near-tie (``SEEDS``: along HF's greedy path the smallest top-2 logit gap is 3e-4, at
Llama's, or more). The terms a family adds are drawn away from their neutral values, so that a runner
that ignored one would produce other tokens (``test_the_family_terms_change_the_tokens``): Qwen2's q/k/v
biases, the q/k norms of Qwen3 and Gemma 3, Gemma's norms (around 0, as it stores them: the norm scales
by ``1 + w``, and its post-attention and post-feedforward norms near 1 so the branches outweigh the
embedding). Every family that has a sliding window has one of ``WINDOW`` positions, shorter than a prompt
plus its output (layer 1 of Qwen2/3 through ``max_window_layers``; Gemma's layer 0 sliding, layer 1
global; ``gemma3`` is the multimodal Gemma 3, served on its language model), and Gemma 2's attention
soft-cap is small enough to bite on these scores. The Gemma models of the greedy test have untied
output embeddings: tied ones at this size repeat the last token whatever the context, which would test
little; ``test_gemma_logits_with_tied_embeddings_and_a_final_softcap`` checks
the tied ones (and the final soft-cap, which never changes an argmax) on the logits.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from batchpilot.core.llm.config import LLMSchedulerConfig
from batchpilot.core.llm.scheduler import LLMScheduler
from batchpilot.models.llm.runner import LLMModelRunner
from batchpilot.models.llm.seeded_families import GEMMA, SHAPE, WINDOW, build
from batchpilot.models.llm.weights import FAMILIES, LlamaWeights, decoder_of, layer_windows, load_hf_llama
from llm_greedy import engine_greedy, hf_greedy

STEPS, PROMPTS, CROWD = 32, 8, 16


def prompts(n: int = PROMPTS, seed: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = (5, 17, 33, 8, 41, 3, 24, 12, 29, 6, 19, 37, 10, 26, 15, 44)
    return [torch.randint(7, 4096, (m,), generator=g).tolist() for m in lengths[:n]]


def crowd(ps: list[list[int]]) -> list[list[int]]:
    """``CROWD - len(ps)`` other streams, each one's first 16 tokens (two blocks) those of a prompt, so
    the prompts that come after them find their leading blocks in the prefix cache."""
    others = prompts(CROWD - len(ps), seed=4)
    return [p[:16] + o for p, o in zip(ps, others, strict=False)]


def greedy(weights: LlamaWeights, ps: list[list[int]], **cfg: Any) -> tuple[list[list[int]], LLMScheduler]:
    """Scheduler + runner to completion, every prompt at once; the tokens and the scheduler."""
    config = LLMSchedulerConfig(block_size=8, max_model_len=512, **cfg)
    runner = LLMModelRunner(weights, config.num_kv_blocks, config.block_size, decode_run_tokens=64)
    sched = LLMScheduler(config)
    return engine_greedy(sched, runner, ps, STEPS), sched


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_each_family_matches_hf_alone_and_in_a_crowd(model_type: str, tmp_path: Path) -> None:
    hf = build(model_type)
    ps = prompts()
    want = hf_greedy(hf, ps, STEPS)
    hf.save_pretrained(tmp_path)  # served from the folder, as a user's checkpoint
    loaded = load_hf_llama(tmp_path)
    assert loaded.config.model_type == model_type
    weights = LlamaWeights.from_hf(loaded)
    assert [greedy(weights, [p])[0][0] for p in ps] == want  # each prompt alone
    others = crowd(ps)
    got, sched = greedy(weights, others + ps, max_num_batched_tokens=32, enable_prefix_caching=True)
    assert got[len(others):] == want  # after the crowd: in its steps, on its cached blocks
    assert sched.block_manager.stats().num_cache_hit_tokens > 0


@pytest.mark.parametrize("model_type", GEMMA)
def test_gemma_logits_with_tied_embeddings_and_a_final_softcap(model_type: str, tmp_path: Path) -> None:
    """Gemma ties its output to its input embeddings and its causal LMs soft-cap the final logits (HF's
    multimodal Gemma 3 does not): a prompt's logits, prefilled in two chunks past the window, equal HF's
    forward to float noise; capped, they stay below the cap and differ from the uncapped ones."""
    from batchpilot.core.llm.scheduler import ScheduledChunk

    hf = build(model_type, tied=True, final_softcap=2.0)
    hf.save_pretrained(tmp_path)
    hf = load_hf_llama(tmp_path)
    p = prompts()[4]  # 41 tokens, past the window
    with torch.inference_mode():
        want = hf(torch.tensor([p])).logits[0, -1].float()
    weights = LlamaWeights.from_hf(hf)
    assert weights.lm_head.data_ptr() == weights.embed.data_ptr()
    runner = LLMModelRunner(weights, 64, 8)
    table = list(range(6))
    first = runner.forward([ScheduledChunk(0, 0, p[:24], table, False, False)])
    got = runner.forward([ScheduledChunk(0, 24, p[24:], table, True, False)])[0]
    assert first.shape[0] == 0
    torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)
    if model_type == "gemma3":
        assert weights.final_softcap is None
        return
    assert weights.final_softcap == 2.0 and got.abs().max() < 2.0
    runner.w.final_softcap = None
    uncapped = runner.forward([ScheduledChunk(0, 24, p[24:], table, True, False)])[0]
    assert (uncapped - got).abs().max() > 0.5


def test_the_family_terms_change_the_tokens() -> None:
    """The runner reads what each family adds: without it the tokens differ."""
    ps = prompts()[:3]
    terms: dict[str, dict[str, Any]] = {
        "qwen2": {"qkv_bias": None}, "qwen3": {"q_norm": None, "k_norm": None},
        "mistral": {"window": None}, "gemma2": {"softcap": None},
        "gemma3_text": {"local_rope": False},
    }
    terms_of_gemma = {"window": None, "attn_out_norm": None, "mlp_out_norm": None}
    cases = [(m, t) for m, t in terms.items()] + [("gemma2", {k: v}) for k, v in terms_of_gemma.items()]
    full = {m: greedy(LlamaWeights.from_hf(build(m)), ps)[0] for m in terms}
    for model_type, attrs in cases:
        weights = LlamaWeights.from_hf(build(model_type))
        for layer in weights.layers:
            for name, value in attrs.items():
                setattr(layer, name, value)
        assert greedy(weights, ps)[0] != full[model_type], (model_type, attrs)


def test_another_model_type_is_refused_with_the_families_served(tmp_path: Path) -> None:
    import transformers

    transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=64, n_head=2,
                                                         vocab_size=512)).save_pretrained(tmp_path)
    served = "served: gemma2, gemma3, gemma3_text, llama, mistral, phi3, qwen2, qwen3"
    with pytest.raises(ValueError, match=rf"model_type 'gpt2' is not served; {served}$"):
        load_hf_llama(tmp_path)


def test_each_layers_window_is_the_one_hf_attends_with() -> None:
    """Mistral and Phi-3 slide every layer when the config sets a window; Qwen2/3 the layers their
    ``layer_types`` mark (none without ``use_sliding_window``); Gemma by ``layer_types`` (Gemma 2
    alternates, Gemma 3 has 5 local to 1 global); Llama never. The whole context is served."""
    import transformers

    def windows(cfg: Any) -> list[int | None]:
        return layer_windows(cfg, FAMILIES[cfg.model_type])

    four = {**SHAPE, "num_hidden_layers": 4}
    assert windows(transformers.MistralConfig(**four, sliding_window=64)) == [64] * 4
    assert windows(transformers.MistralConfig(**four, sliding_window=None)) == [None] * 4
    off = transformers.Qwen2Config(**four, sliding_window=64, use_sliding_window=False)
    assert windows(off) == [None] * 4
    on = transformers.Qwen2Config(**four, sliding_window=64, use_sliding_window=True, max_window_layers=2)
    assert windows(on) == [None, None, 64, 64]
    assert windows(transformers.LlamaConfig(**four)) == [None] * 4
    assert windows(transformers.Gemma2Config(**four, sliding_window=64)) == [64, None, 64, None]
    six = {**SHAPE, "num_hidden_layers": 7}
    assert windows(transformers.Gemma3TextConfig(**six, sliding_window=64)) == [64] * 5 + [None, 64]
    weights = LlamaWeights.from_hf(build("mistral"))
    assert weights.max_position_embeddings == SHAPE["max_position_embeddings"]


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3", "phi3", *GEMMA])
def test_the_fallback_shares_the_runners_tensors_and_still_generates_the_same(model_type: str) -> None:
    """``share_runner_weights`` points the HF model (the static fallback's) at the runner's fused tensors,
    the family's biases and norms included: HF then generates what it generated on its own."""
    from batchpilot.runtime.llm.build import share_runner_weights

    hf = build(model_type)
    ps = prompts()[:2]
    want = hf_greedy(hf, ps, 10)
    weights = LlamaWeights.from_hf(hf)
    runner = LLMModelRunner(weights, 64, 8)
    share_runner_weights(hf, runner.w)
    layer, w = decoder_of(hf)[0].layers[0], runner.w.layers[0]
    shared = getattr(layer.self_attn, "qkv_proj", None) or layer.self_attn.q_proj
    assert shared.weight.data_ptr() == w.qkv.data_ptr()
    assert hf_greedy(hf, ps, 10) == want


def test_every_eos_of_the_config_and_its_generation_config_ends_a_sequence(tmp_path: Path) -> None:
    """Llama 3 and Qwen name several EOS ids in ``generation_config.json``: all of them are read."""
    from batchpilot.models.llm.weights import eos_of

    hf = build("llama")
    hf.config.eos_token_id = 2
    hf.generation_config.eos_token_id = [2, 7, 9]
    hf.save_pretrained(tmp_path)
    assert LlamaWeights.from_hf(load_hf_llama(tmp_path)).eos_token_ids == (2, 7, 9)
    assert eos_of(None, 5) == (5,) and eos_of([1, 2], (2, 3), None) == (1, 2, 3) and eos_of(None) == ()


def test_a_multimodal_gemma3_checkpoint_builds_an_engine_on_its_text_and_refuses_a_static_fallback(
        tmp_path: Path) -> None:
    """The engine serves Gemma 3's language model; HF's static fallback path does not take the multimodal
    model, so it is refused by name with the flag that serves without it."""
    from batchpilot.models.llm.tokenizer import build_tokenizer
    from batchpilot.runtime.llm.build import build_fallback, build_llm_engine

    build("gemma3").save_pretrained(tmp_path)
    build_tokenizer(4096).save_pretrained(tmp_path)
    engine = build_llm_engine(str(tmp_path), num_kv_blocks=64, max_model_len=256, plan_rows=False,
                              start=False)
    assert engine.runner.w.local_inv_freq is not None and engine.runner.w.layers[0].window == WINDOW
    refused = r"multimodal checkpoint \(gemma3\) has no static fallback; serve it with --llm-fallback off"
    with pytest.raises(ValueError, match=refused):
        build_fallback(engine)
