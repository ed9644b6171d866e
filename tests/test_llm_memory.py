"""The LLM memory plan on the real engine and CLIs: the builder sizes the pool from a budget, refuses
what cannot hold the engine, and ``simulate`` plans the same pool from the same profile."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from batchpilot.cli import main
from batchpilot.core.deployment import DeploymentSpec
from batchpilot.core.llm.config import KVPlanError, LLMSchedulerConfig, MemoryProfile
from batchpilot.runtime.llm.build import build_llm_engine, built_overhead
from batchpilot.sim.llm import default_llm_cost_model, planned_llm_config

SMALL = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 512, "threads": 1,
         "start": False}
KV_PER_TOKEN = 2 * 2 * 2 * 16 * 4  # K and V x layers x kv heads x head_dim x float32


def test_kv_cache_memory_sizes_the_pool_the_runner_allocates() -> None:
    block = KV_PER_TOKEN * 16
    engine = build_llm_engine(kv_cache_memory=40 * block + 7, max_model_len=256, **SMALL)
    try:
        plan = engine.memory_plan
        assert plan.num_kv_blocks == engine.config.num_kv_blocks == engine.runner.num_kv_blocks == 40
        assert engine.runner.kv_cache_bytes == plan.kv_bytes == 40 * block
        assert engine.memory_profile.source == "measured"  # a budget: the activation peak was measured
        assert plan.activation_bytes > 0 and plan.weights_bytes > 0
        assert built_overhead(engine) >= 0.0
    finally:
        engine.prompts.close()


def test_a_pool_too_small_for_a_given_max_model_len_stops_the_build_saying_what_to_change() -> None:
    with pytest.raises(KVPlanError, match="cannot hold one sequence of max_model_len = 400"):
        build_llm_engine(num_kv_blocks=8, max_model_len=400, **SMALL)


def test_without_a_length_a_small_pool_lowers_the_models_to_what_it_holds() -> None:
    engine = build_llm_engine(num_kv_blocks=8, **SMALL)
    try:
        assert engine.config.max_model_len == 8 * 16
    finally:
        engine.prompts.close()


def test_memory_utilization_plans_a_pool_that_fits_the_share_of_free_memory() -> None:
    engine = build_llm_engine(memory_utilization=0.001, max_model_len=256, max_num_seqs=4, **SMALL)
    try:
        plan = engine.memory_plan
        assert plan.source == "memory_utilization" and plan.free_bytes is not None
        assert plan.planned_bytes <= 0.001 * plan.free_bytes
        assert plan.num_kv_tokens >= 256
    finally:
        engine.prompts.close()


def test_simulate_plans_the_pool_from_the_profile_as_serve_does(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    memory = MemoryProfile(weights_bytes=80 << 20, kv_bytes_per_token=12288, activation_fixed_bytes=1e6,
                           activation_bytes_per_token=4e4, activation_bytes_per_read_token=2048,
                           source="measured", overhead_bytes=100 << 20)
    profile = tmp_path / "llm.json"
    profile.write_text(json.dumps({"cost_model": default_llm_cost_model().to_dict(),
                                   "memory": memory.to_dict(), "free_bytes": 2e9, "device": "cpu"}))
    budget = DeploymentSpec(llm=LLMSchedulerConfig(memory_utilization=0.5))
    dep = planned_llm_config(budget, profile)
    plan = dep.plan
    assert plan is not None and dep.config.num_kv_blocks == plan.num_kv_blocks
    assert plan.planned_bytes <= 1e9
    with pytest.raises(ValueError, match="needs a profile with a 'memory' section"):
        planned_llm_config(budget, None)
    rc = main(["simulate", "--workload", "conv-llm", "--requests", "40", "--profile", str(profile),
               "--memory-utilization", "0.5"])
    out = capsys.readouterr().out
    assert rc == 0 and f"KV pool {plan.num_kv_blocks} blocks" in out
    small = ["simulate", "--workload", "conv-llm", "--requests", "40", "--profile", str(profile),
             "--kv-cache-memory", "8MiB"]
    assert main([*small, "--max-model-len", "2048"]) == 2  # asked for: the pool cannot hold it
    assert "cannot hold one sequence" in capsys.readouterr().out
    assert main(small) == 0  # not asked for: lowered to the pool's capacity, as serve does
    assert "KV pool 42 blocks x 16 tokens = 672 tokens" in capsys.readouterr().out


def test_a_length_the_user_gave_reaches_the_builder_even_at_its_default_value(tmp_path: Path) -> None:
    import argparse

    from batchpilot.core.deployment import LLMModelLimits, resolve_llm_deployment
    from batchpilot.settings import add_deployment_args, add_llm_args, spec_from_args

    def length(spec: DeploymentSpec) -> int:  # what the builder runs on a model of 4096 positions
        return resolve_llm_deployment(spec, LLMModelLimits(max_model_len=4096)).config.max_model_len

    p = argparse.ArgumentParser()
    add_deployment_args(p)
    add_llm_args(p)
    assert length(spec_from_args(p.parse_args([]))) == 4096  # not given: the model's own
    assert length(spec_from_args(p.parse_args(["--max-model-len", "2048"]))) == 2048  # given, at its default
    cfg = tmp_path / "llm.yaml"
    cfg.write_text("llm:\n  kv_cache_memory: 64MiB\n  swap_space: 2\n")
    spec = spec_from_args(p.parse_args(["--config", str(cfg)]))
    assert spec.llm.kv_cache_memory == 64 << 20 and spec.llm.swap_space == 2 << 30  # a bare number is GiB
    spec = spec_from_args(p.parse_args(["--config", str(cfg), "--num-kv-blocks", "100"]))
    assert spec.llm.kv_cache_memory is None and spec.llm.num_kv_blocks == 100  # the flag sizes the pool


def test_an_arm_can_turn_swap_off_and_plans_its_own_activation() -> None:
    from batchpilot.runtime.llm.build import build_llm_arm

    engine = build_llm_engine(num_kv_blocks=64, swap_space=8 << 20, max_model_len=256, **SMALL)
    try:
        assert engine.config.num_swap_blocks > 0
        arm = build_llm_arm(engine, start=False, swap_space=0, memory_utilization=0.001)
        assert arm.config.num_swap_blocks == 0
        assert arm.memory_plan.activation_bytes > 0 and arm.memory_plan.weights_bytes == 0
        arm.prompts.close()
    finally:
        engine.prompts.close()


def test_serve_stops_at_a_plan_that_cannot_work_saying_what_to_change(
        capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["serve", "--noop", "--no-warmup", "--llm", "--threads", "1", "--kv-cache-memory", "1MiB",
               "--max-model-len", "2048"])
    err = capsys.readouterr().err
    assert rc == 2 and "cannot hold one sequence of max_model_len = 2048" in err and "Traceback" not in err
