"""The LLM engine's precision: the guard against float32 on a teacher-forced probe, what ``auto``
chooses, a named precision that fails refused, and the builder serving what was chosen."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from batchpilot.models.llm import precision
from batchpilot.models.llm.precision import (
    LLMGuard,
    cast_weights,
    choose_llm_precision,
    compare,
    probe_prompts,
    teacher_forced_logits,
)
from batchpilot.models.llm.runner import LLMModelRunner
from batchpilot.models.llm.weights import LlamaWeights, load_hf_llama
from batchpilot.models.seeded import LLMModelConfig
from batchpilot.runtime.llm.build import build_llm_engine

CPU = torch.device("cpu")
# a 2-layer, 256-wide cut of the default architecture; initializer_range 0.06 keeps the logits' top two
# apart (tests/test_llm_model.py), so agreement here measures the arithmetic, not near ties
SMALL = LLMModelConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, initializer_range=0.06, seed=1)


@pytest.fixture(scope="module")
def weights() -> LlamaWeights:
    return LlamaWeights.from_hf(load_hf_llama(None, SMALL))


def loader(weights: LlamaWeights, calls: list[int] | None = None) -> Any:
    def load() -> LlamaWeights:
        if calls is not None:
            calls.append(1)
        return weights
    return load


def test_cast_weights_copies_and_leaves_the_float32_weights_alone(weights: LlamaWeights) -> None:
    bf16 = cast_weights(weights, torch.bfloat16)
    assert bf16.embed.dtype == bf16.layers[0].qkv.dtype == bf16.lm_head.dtype == torch.bfloat16
    assert weights.embed.dtype == weights.layers[0].qkv.dtype == torch.float32
    same = cast_weights(weights, torch.float32)  # nothing to cast: the same tensors, no copy
    assert same.layers[0].qkv is weights.layers[0].qkv and same is not weights


def test_the_probe_against_itself_agrees_everywhere(weights: LlamaWeights) -> None:
    prompts = probe_prompts(weights.vocab_size, (3, 20))
    a, own = teacher_forced_logits(LLMModelRunner(weights, 16, 16), prompts, 5)
    b, _ = teacher_forced_logits(LLMModelRunner(weights, 16, 16), prompts, 5, own)
    assert a.shape == (6, 2, weights.vocab_size) and [len(t) for t in own] == [5, 5]
    assert compare(a, b) == (1.0, 0.0)


def test_float32_asked_for_is_the_reference_without_a_probe(weights: LlamaWeights) -> None:
    calls: list[int] = []
    report = choose_llm_precision(loader(weights, calls), "float32", CPU)
    assert (report.chosen, report.kv_dtype, calls) == ("float32", "float32", [])
    assert "the reference" in report.describe()


def test_a_named_precision_is_checked_and_served_when_it_passes(weights: LlamaWeights) -> None:
    report = choose_llm_precision(loader(weights), "bfloat16", CPU)
    assert (report.chosen, report.kv_dtype, report.label) == ("bfloat16", "bfloat16", "bfloat16")
    m = report.measured["bfloat16"]
    assert m["passed"] == 1.0 and m["agreement"] >= LLMGuard().min_agreement
    assert 0.0 < m["logit_error"] <= LLMGuard().max_logit_error
    assert m["ms"] != m["ms"]  # named: checked, not timed
    assert "asked for; passed the guard" in report.describe()


def test_a_named_precision_that_fails_the_guard_is_an_error_saying_what_was_measured(
        weights: LlamaWeights) -> None:
    strict = LLMGuard(min_agreement=1.0, max_logit_error=1e-9)
    refused = r"llm dtype bfloat16: greedy agreement .* logit error .* serve float32"
    with pytest.raises(ValueError, match=refused):
        choose_llm_precision(loader(weights), "bfloat16", CPU, guard=strict)


def test_auto_serves_the_fastest_precision_that_passes(weights: LlamaWeights,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(precision, "candidates", lambda device: ["float32", "bfloat16"])
    for fast, slow in (("bfloat16", "float32"), ("float32", "bfloat16")):
        monkeypatch.setattr(precision, "_time_steps",
                            lambda runners, repeats, f=fast, s=slow: {f: 1.0, s: 2.0})
        report = choose_llm_precision(loader(weights), "auto", CPU)
        assert report.chosen == report.kv_dtype == fast
        assert report.measured[fast]["ms"] == 1.0 and "the fastest that passed" in report.reason
    # one that fails the guard is never timed nor served
    timed: list[list[str]] = []
    monkeypatch.setattr(precision, "_time_steps", lambda runners, repeats: timed.append(list(runners)) or
                        {d: 1.0 for d in runners})
    report = choose_llm_precision(loader(weights), "auto", CPU, guard=LLMGuard(1.0, 1e-9))
    assert timed == [["float32"]] and report.chosen == "float32"
    assert report.measured["bfloat16"]["passed"] == 0.0 and "failed the guard" in report.describe()


def test_auto_without_a_faster_precision_is_float32_without_loading(weights: LlamaWeights,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(precision, "candidates", lambda device: ["float32"])
    calls: list[int] = []
    report = choose_llm_precision(loader(weights, calls), "auto", CPU)
    assert (report.chosen, calls) == ("float32", []) and "no faster precision" in report.reason


def test_a_kv_cache_below_the_weights_precision_is_checked_as_a_pair(weights: LlamaWeights) -> None:
    report = choose_llm_precision(loader(weights), "float32", CPU, kv_dtype="bfloat16")
    assert (report.chosen, report.kv_dtype, report.label) == ("float32", "bfloat16", "float32/kv bfloat16")
    assert report.measured["float32/kv bfloat16"]["agreement"] >= 0.9


def test_unknown_precisions_are_refused(weights: LlamaWeights) -> None:
    with pytest.raises(ValueError, match="choose one of auto, float32, bfloat16, float16"):
        choose_llm_precision(loader(weights), "int8", CPU)
    with pytest.raises(ValueError, match="llm kv dtype"):
        choose_llm_precision(loader(weights), "float32", CPU, kv_dtype="int8")
    with pytest.raises(ValueError, match="min_agreement"):
        LLMGuard(min_agreement=0.0)


def test_the_engine_serves_the_precision_chosen_and_plans_its_smaller_cache() -> None:
    small = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
             "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 512, "threads": 1,
             "start": False, "num_kv_blocks": 32, "plan_rows": False, "initializer_range": 0.06}
    fp32 = build_llm_engine(**small)
    bf16 = build_llm_engine(dtype="bfloat16", **small)
    kv16 = build_llm_engine(kv_dtype="bfloat16", **small)
    try:
        assert fp32.runner.precision.chosen == "float32" and fp32.runner.k_cache.dtype == torch.float32
        assert bf16.runner.dtype == bf16.runner.k_cache.dtype == torch.bfloat16
        assert bf16.runner.w.layers[0].qkv.dtype == torch.bfloat16
        assert (kv16.runner.dtype, kv16.runner.k_cache.dtype) == (torch.float32, torch.bfloat16)
        per_token = fp32.memory_plan.kv_bytes // (32 * 16)
        assert per_token == 2 * 2 * 2 * 16 * 4  # K and V x layers x kv heads x head_dim x float32
        for engine in (bf16, kv16):  # the plan and the pool count the bf16 cache: half the bytes
            half = fp32.memory_plan.kv_bytes // 2
            assert engine.memory_plan.kv_bytes == engine.runner.kv_cache_bytes == half
        assert bf16.memory_plan.weights_bytes < fp32.memory_plan.weights_bytes
        # the fallback's HF model runs on the engine's own bf16 tensors
        assert next(bf16.hf_model.parameters()).dtype == torch.bfloat16
    finally:
        for engine in (fp32, bf16, kv16):
            engine.prompts.close()


def test_serve_takes_an_llm_precision_and_a_profile_names_its_own(tmp_path: Any) -> None:
    from batchpilot.cli import build_parser
    from batchpilot.runtime.llm.build import profiled_precision
    from batchpilot.server.cli import server_config, spec_from_args
    from batchpilot.server.config import ServerConfig

    args = build_parser().parse_args(["serve", "--llm", "--llm-dtype", "bfloat16",
                                      "--llm-kv-dtype", "float16"])
    settings = server_config(args, spec_from_args(args))
    assert (settings.llm_dtype, settings.llm_kv_dtype) == ("bfloat16", "float16")
    assert ServerConfig().llm_dtype == "auto" and ServerConfig().llm_kv_dtype is None
    with pytest.raises(ValueError, match="server.llm_dtype = 'int8'"):
        ServerConfig(llm_dtype="int8")
    profile = tmp_path / "llm.json"
    profile.write_text('{"meta": {"dtype": "bfloat16", "kv_dtype": "bfloat16"}}')
    assert profiled_precision(profile) == ("bfloat16", "bfloat16")
    assert profiled_precision(profile, "float32") == ("bfloat16", "float32")  # a KV precision asked for stays
    profile.write_text('{"meta": {}}')  # a profile from before the LLM precisions: float32
    assert profiled_precision(profile) == ("float32", None)
