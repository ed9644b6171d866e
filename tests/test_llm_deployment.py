"""The LLM deployment resolver: the one place the engine's deadline, admission bound, length, EOS and KV
pool are decided, for serve, simulate and bench alike."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from batchpilot.core.deployment import DeploymentSpec, LLMModelLimits, resolve_llm_deployment
from batchpilot.core.llm.config import KVPlanError, LLMSchedulerConfig, MemoryProfile, plan_kv
from batchpilot.settings import add_deployment_args, add_llm_args, spec_from_args

MEMORY = MemoryProfile(weights_bytes=80 << 20, kv_bytes_per_token=12288, activation_fixed_bytes=1e6,
                       activation_bytes_per_token=4e4, activation_bytes_per_read_token=2048,
                       source="measured", overhead_bytes=10 << 20)


def spec_of(*flags: str) -> DeploymentSpec:
    p = argparse.ArgumentParser()
    add_deployment_args(p)
    add_llm_args(p)
    return spec_from_args(p.parse_args(list(flags)))


def test_nothing_set_leaves_the_llm_section_as_it_is() -> None:
    dep = resolve_llm_deployment(spec_of())
    assert dep.config == LLMSchedulerConfig() and dep.plan is None and dep.notes == ()
    assert dep.config.request_timeout_s == 600.0 and dep.config.max_waiting_seqs == 256
    assert "admits at most 320 sequences" in dep.describe()


def test_the_servers_request_timeout_applies_to_the_llm_only_when_the_user_set_it() -> None:
    dep = resolve_llm_deployment(spec_of("--request-timeout-s", "30"))
    assert dep.config.request_timeout_s == 30.0
    assert any("llm request timeout 30 s (server.request_timeout_s" in n for n in dep.notes)
    at_default = DeploymentSpec.from_dict({"server": {"request_timeout_s": 60}})  # set, at its default
    assert resolve_llm_deployment(at_default).config.request_timeout_s == 60.0
    built = DeploymentSpec(server=dataclasses.replace(DeploymentSpec().server, request_timeout_s=5.0))
    assert resolve_llm_deployment(built).config.request_timeout_s == 600.0  # no provenance: not set
    both = spec_of("--request-timeout-s", "30", "--llm-request-timeout-s", "100")
    assert resolve_llm_deployment(both).config.request_timeout_s == 100.0  # the LLM's own wins


def test_the_servers_concurrency_bounds_the_llm_engine_unless_max_waiting_seqs_is_set() -> None:
    dep = resolve_llm_deployment(spec_of("--max-concurrency", "100"))
    assert (dep.config.max_num_seqs, dep.config.max_waiting_seqs) == (64, 36)
    assert any("llm admits at most 100 sequences" in n for n in dep.notes)
    small = resolve_llm_deployment(spec_of("--max-concurrency", "10"))
    assert small.config.max_waiting_seqs == 0  # it always admits the sequences it runs
    assert any("not fewer than the 64 it runs" in n for n in small.notes)
    own = resolve_llm_deployment(spec_of("--max-concurrency", "100", "--max-waiting-seqs", "5"))
    assert own.config.max_waiting_seqs == 5 and not own.notes
    unlimited = resolve_llm_deployment(spec_of("--max-concurrency", "0"))
    assert unlimited.config.max_waiting_seqs == 256 and any("no limit" in n for n in unlimited.notes)


def test_the_model_fills_the_length_and_eos_the_section_does_not_give() -> None:
    model = LLMModelLimits(max_model_len=4096, eos_token_ids=(2, 7))
    dep = resolve_llm_deployment(spec_of(), model)
    assert (dep.config.max_model_len, dep.config.eos_token_ids) == (4096, (2, 7))
    given = DeploymentSpec.from_dict({"llm": {"max_model_len": 2048, "eos_token_ids": [3]}})
    dep = resolve_llm_deployment(given, model)
    assert (dep.config.max_model_len, dep.config.eos_token_ids) == (2048, (3,))
    assert resolve_llm_deployment(spec_of(), LLMModelLimits()).config.max_model_len == 2048  # not known


def test_a_pool_too_small_lowers_only_a_length_the_user_did_not_give() -> None:
    model = LLMModelLimits(max_model_len=4096)
    dep = resolve_llm_deployment(spec_of("--kv-cache-memory", "8MiB"), model, MEMORY, 2e9)
    assert dep.plan is not None and dep.config.max_model_len == dep.plan.num_kv_tokens < 4096
    assert dep.config.num_kv_blocks == dep.plan.num_kv_blocks
    assert any(n.startswith(f"max_model_len lowered to {dep.plan.num_kv_tokens}") for n in dep.notes)
    with pytest.raises(KVPlanError, match="cannot hold one sequence of max_model_len = 4096"):
        resolve_llm_deployment(spec_of("--kv-cache-memory", "8MiB", "--max-model-len", "4096"), model,
                               MEMORY, 2e9)


def test_the_plan_is_plan_kv_on_the_section_the_rules_produced() -> None:
    spec = spec_of("--memory-utilization", "0.5", "--max-num-seqs", "8")
    dep = resolve_llm_deployment(spec, LLMModelLimits(max_model_len=1024), MEMORY, 2e9, swap_on_device=False)
    section = dataclasses.replace(spec.llm, max_model_len=1024)
    plan = plan_kv(section, MEMORY, 2e9, swap_on_device=False, cap_max_model_len=True)
    assert dep.plan == plan and dep.config == plan.resolve(section)


def test_a_memory_budget_without_a_memory_profile_says_how_to_get_one() -> None:
    with pytest.raises(ValueError, match="needs a profile with a 'memory' section"):
        resolve_llm_deployment(spec_of("--memory-utilization", "0.5"))
