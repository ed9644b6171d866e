"""Swap preemption on the real engine and runner: block copies are exact, and greedy output under a KV
pool too small for the batch (forced preemption) is token-identical to an unpreempted run, whether the
victims are recomputed or swapped.

The seeded 2-layer cut of the tiny Llama uses ``initializer_range=0.06`` (tests/test_llm_model.py: at
HF's 0.02 near-tied logits could flip on float noise from a different batch composition).
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

from batchpilot.core.llm.sequence import SamplingParams
from batchpilot.models.llm.runner import (
    LLMModelRunner,
    engine_preemption_costs,
    measure_swap,
    probe_preemption_costs,
)
from batchpilot.models.llm.weights import LlamaWeights, load_hf_llama
from batchpilot.models.seeded import LLMModelConfig
from batchpilot.runtime.llm.build import build_llm_engine
from batchpilot.runtime.llm.engine import LLMEngine

TINY = {"num_hidden_layers": 2, "hidden_size": 256, "intermediate_size": 688, "num_attention_heads": 4,
        "num_key_value_heads": 2, "initializer_range": 0.06, "seed": 1}
LENGTHS = [5, 17, 33, 8, 41, 3, 26, 12]
PARAMS = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(7, 4096, (n,), generator=g).tolist() for n in LENGTHS]


def generate(prompts: list[list[int]], **cfg: Any) -> tuple[list[list[int]], LLMEngine]:
    engine = build_llm_engine(None, **TINY, block_size=8, max_num_batched_tokens=64, max_model_len=64,
                              tokenizer_threads=1, **cfg)

    async def run() -> list[list[int]]:
        out = []
        for req in engine.submit(prompts, PARAMS):  # all at once: one batch that cannot stay resident
            tokens: list[int] = []
            async for item in req:
                tokens += item.token_ids
            out.append(tokens)
        return out

    try:
        return asyncio.run(run()), engine
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def reference(prompts: list[list[int]]) -> list[list[int]]:
    out, engine = generate(prompts, num_kv_blocks=256)
    assert engine.stats().num_preemptions == 0
    return out


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_forced_preemption_is_greedy_identical_under_recompute_and_swap(
        prompts: list[list[int]], reference: list[list[int]], mode: str) -> None:
    # 10 blocks of 8: the longest request (41 + 10 tokens) fits alone, the batch does not
    out, engine = generate(prompts, num_kv_blocks=10, num_swap_blocks=64, preemption=mode)
    s = engine.stats()
    assert out == reference
    assert s.num_preemptions > 0 and s.num_preemptions == s.num_swapped_out + s.num_recompute_preemptions
    if mode == "swap":
        assert s.num_swapped_out > 0 and s.num_swapped_in == s.num_swapped_out
        assert s.num_blocks_swapped_out > 0 and s.num_blocks_swapped_in == s.num_blocks_swapped_out
        assert s.swap_seconds > 0 and s.num_free_swap_blocks == s.num_swap_blocks == 64
    else:
        assert s.num_swapped_out == 0 and s.num_recomputed_tokens > 0
    assert s.num_free_blocks == 10 and s.num_swapped == 0


def test_auto_measures_its_costs_at_start_up_and_stays_greedy_identical(
        prompts: list[list[int]], reference: list[list[int]]) -> None:
    out, engine = generate(prompts, num_kv_blocks=10, num_swap_blocks=64, preemption="auto")
    costs = engine.scheduler.preemption_costs
    assert costs is not None and engine.runner.preemption_costs is costs
    assert costs.swap_out_s_per_block > 0 and costs.swap_in_s_per_block > 0 and costs.recompute_s(16) > 0
    assert out == reference
    s = engine.stats()
    assert s.num_preemptions == s.num_swapped_out + s.num_recompute_preemptions > 0


@pytest.fixture(scope="module")
def runner() -> LLMModelRunner:
    weights = LlamaWeights.from_hf(load_hf_llama(None, LLMModelConfig(**TINY)))  # type: ignore[arg-type]
    return LLMModelRunner(weights, num_kv_blocks=12, block_size=4, num_swap_blocks=6)


def test_runner_swap_copies_whole_blocks_out_and_back(runner: LLMModelRunner) -> None:
    g = torch.Generator().manual_seed(0)
    runner.k_cache.copy_(torch.randn(runner.k_cache.shape, generator=g))
    runner.v_cache.copy_(torch.randn(runner.v_cache.shape, generator=g))
    blocks = lambda cache, ids: cache.view(cache.shape[0], -1, 4, *cache.shape[2:])[:, ids].clone()  # noqa: E731
    k_before, v_before = blocks(runner.k_cache, [3, 7, 1]), blocks(runner.v_cache, [3, 7, 1])
    untouched = blocks(runner.k_cache, [0, 2])
    runner.swap([(3, 5), (7, 0), (1, 2)], [])
    assert torch.equal(runner.k_swap[:, [5, 0, 2]], k_before)
    assert torch.equal(runner.v_swap[:, [5, 0, 2]], v_before)
    runner.k_cache.view(2, -1, 4, *runner.k_cache.shape[2:])[:, [3, 7, 1]] = 0.0  # freed, reused
    runner.swap([], [(5, 9), (0, 4), (2, 11)])
    assert torch.equal(blocks(runner.k_cache, [9, 4, 11]), k_before)
    assert torch.equal(blocks(runner.v_cache, [9, 4, 11]), v_before)
    assert torch.equal(blocks(runner.k_cache, [0, 2]), untouched)
    assert runner.swap_space_bytes == 2 * runner.k_swap.numel() * 4


def test_swap_probe_and_costs_from_a_profile(runner: LLMModelRunner) -> None:
    out_s, in_s = measure_swap(runner, num_blocks=4, repeats=3)
    assert out_s > 0 and in_s > 0
    from batchpilot.sim.llm import default_llm_cost_model

    cm = default_llm_cost_model()
    costs = probe_preemption_costs(runner, cm)  # recompute priced from the profile, copies measured
    assert costs.prefill_s_per_token == pytest.approx(cm.latency_coef[1] + cm.latency_coef[3])


def test_engine_costs_need_the_runner_to_hold_the_swap_blocks(runner: LLMModelRunner) -> None:
    from batchpilot.core.llm.config import LLMSchedulerConfig as Config

    with pytest.raises(ValueError, match="swap blocks"):
        engine_preemption_costs(runner, Config(num_swap_blocks=7))
    assert engine_preemption_costs(runner, Config(preemption="recompute", num_swap_blocks=6)) is None
    assert engine_preemption_costs(runner, Config(num_swap_blocks=0)) is None  # auto without swap space


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_runner_swap_on_cuda_goes_through_pinned_host_blocks() -> None:
    weights = LlamaWeights.from_hf(load_hf_llama(None, LLMModelConfig(**TINY)))  # type: ignore[arg-type]
    r = LLMModelRunner(weights, num_kv_blocks=8, block_size=4, device="cuda", num_swap_blocks=4)
    assert r.k_swap.is_pinned() and r.v_swap.is_pinned()
    r.k_cache.normal_()
    before = r.k_cache.view(2, -1, 4, *r.k_cache.shape[2:])[:, [5, 6]].clone()
    r.swap([(5, 3), (6, 0)], [])
    r.k_cache.zero_()
    r.swap([], [(3, 1), (0, 2)])
    assert torch.equal(r.k_cache.view(2, -1, 4, *r.k_cache.shape[2:])[:, [1, 2]], before)
