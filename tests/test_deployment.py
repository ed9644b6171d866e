"""The one deployment: what `serve`, `simulate`, `tune` and `bench` resolve from the same inputs."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pytest
import yaml

from batchpilot.core.config import AdmissionConfig, PlannerConfig, PolicyConfig, SchedulerConfig
from batchpilot.core.costmodel import CostModel
from batchpilot.core.deployment import (
    FAIR_BATCH_EFFICIENCY,
    MIN_PIPELINE_LEAD_S,
    DeploymentSpec,
    ModelLimits,
    ModelOptions,
    ServingOptions,
    resolve_deployment,
)
from batchpilot.core.llm.config import LLMSchedulerConfig
from batchpilot.settings import (
    add_deployment_args,
    add_llm_args,
    add_precision_args,
    deployment_flags,
    dump_spec,
    fields_from_args,
    load_spec,
    spec_from_args,
)

CM = CostModel.default_cpu_minilm()


def test_defaults_queue_within_the_concurrency_limit_and_timeout_without_shedding() -> None:
    dep = resolve_deployment(DeploymentSpec(), CM, ModelLimits(512, True, 0.0))
    adm = dep.scheduler.admission
    assert adm.max_concurrent_requests == 512 and adm.timeout_s == 60.0
    assert adm.latency_sla_s == 0.0 and adm.max_backlog_s == 0.0  # no SLA declared: no latency shedding
    assert dep.scheduler.pipeline_lead_s == MIN_PIPELINE_LEAD_S  # the default model has no prepare_s
    assert "no shedding" in dep.describe()


def test_the_fair_quantum_is_derived_from_the_fixed_cost_per_batch() -> None:
    c0 = CM.encoder_latency_coef[0]
    fair = DeploymentSpec(encoder=SchedulerConfig(queue_order="fair"))
    dep = resolve_deployment(fair, CM)
    assert dep.scheduler.fair_quantum_s == pytest.approx(c0 / (1 - FAIR_BATCH_EFFICIENCY))
    assert any("fair quantum" in n for n in dep.notes)
    # derived under any order (a comparison of orders swaps only the order), said only under fair
    plain = resolve_deployment(DeploymentSpec(), CM)
    assert plain.scheduler.fair_quantum_s == dep.scheduler.fair_quantum_s
    assert not any("fair quantum" in n for n in plain.notes)
    set_ = DeploymentSpec(encoder=SchedulerConfig(queue_order="fair", fair_quantum_s=0.2))
    assert resolve_deployment(set_, CM).scheduler.fair_quantum_s == 0.2  # the user's value stays
    no_fixed = CostModel(latency_coef=(0.0, *CM.latency_coef[1:]), memory_coef=CM.memory_coef)
    assert resolve_deployment(fair, no_fixed).scheduler.fair_quantum_s == 0.0  # no bound


def test_the_model_and_the_profile_shape_the_deployment() -> None:
    spec = DeploymentSpec(server=ServingOptions(latency_sla_s=0.5, max_concurrency=0))
    cm = CostModel(latency_coef=CM.latency_coef, memory_coef=CM.memory_coef, meta={"prepare_s": 0.003})
    dep = resolve_deployment(spec, cm, ModelLimits(256, False, 8 * 2**30))
    s = dep.scheduler
    assert s.planner.max_len == 256 and s.admission.max_length == 256
    assert s.planner.padding == "dynamic"  # no padding-free path in this model
    assert s.planner.max_batch_memory_bytes == pytest.approx(0.25 * 8 * 2**30)
    assert s.admission.latency_sla_s == 0.5 and s.admission.max_concurrent_requests == 0
    assert s.pipeline_lead_s == pytest.approx(0.006)  # twice the measured collation time
    assert len(dep.notes) == 3  # max_len, padding, memory: each change is said
    # the simulator resolves with the limits the profile recorded: the same deployment
    meta = {"max_length": 256, "supports_padding_free": False, "device_memory_bytes": 8 * 2**30,
            "prepare_s": 0.003}
    cm2 = CostModel(latency_coef=CM.latency_coef, memory_coef=CM.memory_coef, meta=meta)
    assert resolve_deployment(spec, cm2, ModelLimits.from_meta(meta)).scheduler == s


def test_the_config_files_own_admission_values_win() -> None:
    adm = AdmissionConfig(max_concurrent_requests=7, timeout_s=5.0, latency_sla_s=2.0)
    enc = SchedulerConfig(admission=adm,
                          planner=PlannerConfig(max_batch_memory_bytes=1e6), pipeline_lead_s=0.01)
    s = resolve_deployment(DeploymentSpec(encoder=enc, server=ServingOptions(latency_sla_s=1.0)), CM,
                           ModelLimits(512, True, 2**30)).scheduler
    a = s.admission
    assert (a.max_concurrent_requests, a.timeout_s, a.latency_sla_s) == (7, 5.0, 2.0)
    assert s.planner.max_batch_memory_bytes == 1e6 and s.pipeline_lead_s == 0.01


def test_one_file_three_sections_and_clear_errors(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"encoder": {"policy": {"max_batch_size": 8}},
                                    "llm": {"max_num_seqs": 4, "eos_token_ids": [2]},
                                    "server": {"latency_sla_s": 1.5}}))
    spec = load_spec(path)
    assert spec.encoder.policy.max_batch_size == 8 and spec.llm.max_num_seqs == 4
    assert spec.llm.eos_token_ids == (2,) and spec.server.latency_sla_s == 1.5
    assert DeploymentSpec.from_dict(spec.to_dict()) == spec
    out = dump_spec(spec, tmp_path / "out.yaml", "# header\n")
    assert out.read_text().startswith("# header") and load_spec(out).encoder == spec.encoder
    for bad, match in (({"policy": {}}, "go under 'encoder:'"),
                       ({"server": {"max_concurency": 1}}, "max_concurency"),
                       ({"llm": {"max_num_seqs": 0}}, "max_num_seqs"), ([1, 2], "expected a mapping"),
                       ({"server": {"latency_sla_s": -1}}, "latency_sla_s")):
        path.write_text(yaml.safe_dump(bad))
        with pytest.raises(ValueError, match=match):
            load_spec(path)


def test_the_same_flags_give_the_same_spec_everywhere(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"encoder": {"policy": {"name": "window"}},
                                    "server": {"max_concurrency": 9}}))
    p = argparse.ArgumentParser()
    add_deployment_args(p)
    argv = ["--config", str(path), "--max-batch-size", "4", "--latency-sla", "0.8",
            "--request-timeout-s", "5", "--tokenizer-workers", "3"]
    args = p.parse_args(argv)
    spec = spec_from_args(args)
    assert spec.encoder.policy.name == "window" and spec.encoder.policy.max_batch_size == 4
    assert spec.server == ServingOptions(max_concurrency=9, request_timeout_s=5.0, latency_sla_s=0.8,
                                         tokenizer_workers=3)
    # what `bench fidelity` hands to `serve`: parsed again, the very same spec
    again = spec_from_args(p.parse_args(deployment_flags(args)))
    assert again == spec
    assert spec_from_args(p.parse_args([])) == DeploymentSpec()
    assert PolicyConfig().name == DeploymentSpec().encoder.policy.name
    with pytest.raises(ValueError, match="tokenizer_workers must be >= 0"):
        ServingOptions(tokenizer_workers=-1)


def test_the_tokenizer_threads_flag_reaches_the_server(tmp_path: Path) -> None:
    from batchpilot.cli import build_parser
    from batchpilot.server.cli import server_config

    args = build_parser().parse_args(["serve", "--noop", "--tokenizer-workers", "1"])
    assert server_config(args, spec_from_args(args)).serving.tokenizer_workers == 1
    args = build_parser().parse_args(["serve", "--noop"])
    assert server_config(args, spec_from_args(args)).serving.tokenizer_workers == 0  # unset: one per core


@pytest.mark.parametrize(("meta", "asked", "resolved"), [
    ({"prepare_share": 0.002}, "auto", "off"),  # collation 0.2% of a batch: pipelining cannot pay
    ({"prepare_share": 0.05}, "auto", "on"),
    ({}, "auto", "on"),  # a profile that does not say keeps it on
    ({"prepare_share": 0.002}, "on", "on"),  # the user's word wins either way
    ({"prepare_share": 0.05}, "off", "off"),
])
def test_pipelining_is_kept_where_collation_is_a_measurable_share(meta: dict[str, float], asked: str,
                                                                  resolved: str) -> None:
    from batchpilot.core.scheduler import BatchScheduler

    cm = CostModel(latency_coef=CM.latency_coef, memory_coef=CM.memory_coef, meta=meta)
    spec = DeploymentSpec(encoder=SchedulerConfig(pipeline=asked))  # type: ignore[arg-type]
    dep = resolve_deployment(spec, cm, ModelLimits(512, True, 2**30))
    assert dep.scheduler.pipeline == resolved
    assert any("pipelining off" in n for n in dep.notes) == (asked == "auto" and resolved == "off")
    sched = BatchScheduler(dep.scheduler, cm)
    from core_factories import make_request

    sched.submit(make_request(10, 0.0), 0.0)
    (batch,) = sched.schedule(0.0, 1).batches
    assert (sched.next_batch_at(batch, 0.0) == float("inf")) == (resolved == "off")


def test_every_field_with_flag_metadata_has_an_override_flag_that_reads_back() -> None:
    p = argparse.ArgumentParser()
    add_deployment_args(p)
    add_precision_args(p)
    add_llm_args(p)
    flags = [a for a in p._actions if a.dest not in ("help", "config")]
    assert all(a.default is None for a in flags)  # not given: the file's value stands
    sections = (PolicyConfig, PlannerConfig, SchedulerConfig, ServingOptions, ModelOptions,
                LLMSchedulerConfig)
    flagged = [(cls, f) for cls in sections for f in dataclasses.fields(cls) if "flag" in f.metadata]
    assert len(flagged) == len(flags)  # one flag per flagged field, none left out or hand-written
    for cls, f in flagged:
        meta = f.metadata["flag"]
        option = meta.get("name", "--" + f.name.replace("_", "-"))
        assert fields_from_args(p.parse_args([]), cls) == {}
        if f.default is None:  # a size or share with no default: any value reads back as given
            argv = [option, "0.5" if meta.get("type") is float else "1GiB"]
        elif isinstance(f.default, bool):  # given at its default still counts as given
            argv = [option if f.default else "--no-" + option[2:]]
        else:
            argv = [option, str(f.default * 1000 if meta.get("unit") == "ms" else f.default)]
        given = fields_from_args(p.parse_args(argv), cls)
        assert list(given) == [f.name] and (f.default is None or given[f.name] == f.default), (option, given)
