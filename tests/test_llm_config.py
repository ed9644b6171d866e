"""core/llm/config.py: the KV pool sized from a memory budget, and the checks that say what to change."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from batchpilot.core.llm.config import (
    MIB,
    KVPlanError,
    LLMSchedulerConfig,
    MemoryProfile,
    largest_gather,
    plan_kv,
)

MEM = MemoryProfile(weights_bytes=80 * MIB, kv_bytes_per_token=12288, activation_fixed_bytes=1e6,
                    activation_bytes_per_token=40e3, activation_bytes_per_read_token=2048, source="measured")


def test_num_kv_blocks_is_kept_without_a_budget_and_checked_against_free_memory() -> None:
    plan = plan_kv(LLMSchedulerConfig(num_kv_blocks=512), MEM, free_bytes=8e9)
    assert plan.num_kv_blocks == 512 and plan.source == "num_kv_blocks"
    assert plan.kv_bytes == 512 * 16 * 12288
    with pytest.raises(KVPlanError, match="only .* is free"):
        plan_kv(LLMSchedulerConfig(num_kv_blocks=512), MEM, free_bytes=100 * MIB)


def test_kv_cache_memory_gives_whole_blocks_of_that_many_bytes() -> None:
    block = 16 * 12288
    plan = plan_kv(LLMSchedulerConfig(kv_cache_memory=300 * block + block // 2), MEM, free_bytes=None)
    assert plan.num_kv_blocks == 300 and plan.source == "kv_cache_memory"


def test_memory_utilization_leaves_weights_and_the_activation_peak_out_of_the_share() -> None:
    c = LLMSchedulerConfig(memory_utilization=0.5, max_num_seqs=8, max_model_len=1024)
    free = 4e9
    plan = plan_kv(c, MEM, free_bytes=free)
    activation = MEM.activation_bytes(c.max_num_batched_tokens, largest_gather(c),
                                      c.max_num_batched_tokens * c.max_model_len)
    assert plan.activation_bytes == pytest.approx(activation)
    # a run of 7 decodes at 292 tokens (7 x 292 <= decode_run_tokens 2,048) in blocks of 16: 7 x 304;
    # not every sequence at max_model_len (8 x 1,024)
    assert largest_gather(c) == 7 * 304
    assert plan.planned_bytes <= 0.5 * free < plan.planned_bytes + plan.block_bytes
    with pytest.raises(KVPlanError, match="needs the device's free memory"):
        plan_kv(c, MEM, free_bytes=None)
    with pytest.raises(KVPlanError, match="no room for KV"):
        plan_kv(c, MEM, free_bytes=100 * MIB)


def test_a_pool_too_small_for_one_sequence_names_what_to_change_or_caps_a_default_length() -> None:
    c = LLMSchedulerConfig(num_kv_blocks=32, max_model_len=2048)
    with pytest.raises(KVPlanError, match="cannot hold one sequence of max_model_len = 2048") as err:
        plan_kv(c, MEM)
    assert "lower max_model_len" in str(err.value)
    plan = plan_kv(c, MEM, cap_max_model_len=True)
    assert plan.max_model_len == 32 * 16 and plan.resolve(c).max_model_len == 512


def test_swap_space_becomes_host_blocks_and_swap_needs_some() -> None:
    block = 16 * 12288
    plan = plan_kv(LLMSchedulerConfig(swap_space=10 * block, num_kv_blocks=256), MEM)
    assert plan.num_swap_blocks == 10 and plan.resolve(LLMSchedulerConfig()).num_swap_blocks == 10
    with pytest.raises(KVPlanError, match="preemption = swap needs host swap space"):
        plan_kv(LLMSchedulerConfig(preemption="swap", num_kv_blocks=256), MEM)
    # on CPU the swap space is the same memory as the pool: it comes out of the share too
    c = LLMSchedulerConfig(memory_utilization=0.5, swap_space=1000 * block)
    on, off = plan_kv(c, MEM, 8e9, swap_on_device=True), plan_kv(c, MEM, 8e9, swap_on_device=False)
    assert off.num_kv_blocks - on.num_kv_blocks == 1000


def test_both_budgets_at_once_is_an_error() -> None:
    with pytest.raises(ValueError, match="not both"):
        LLMSchedulerConfig(kv_cache_memory=1 << 30, memory_utilization=0.5)


@given(util=st.floats(0.05, 1.0), free=st.floats(1e9, 1e11), seqs=st.integers(1, 256),
       tokens=st.integers(16, 8192), length=st.sampled_from([512, 1024, 2048, 4096]),
       swap=st.integers(0, 1 << 30))
def test_a_plan_that_is_made_fits_the_share_and_holds_one_full_sequence(
        util: float, free: float, seqs: int, tokens: int, length: int, swap: int) -> None:
    c = LLMSchedulerConfig(memory_utilization=util, max_num_seqs=seqs, max_num_batched_tokens=tokens,
                           max_model_len=length, swap_space=swap)
    try:
        plan = plan_kv(c, MEM, free)
    except KVPlanError:
        return
    assert plan.planned_bytes + plan.swap_bytes <= util * free
    assert plan.num_kv_tokens >= length
    assert plan.activation_bytes >= MEM.activation_bytes(tokens, largest_gather(c)) - 1e-6
