"""The tuner: capacity search, ranking with baselines, and a YAML the server loads unchanged."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from batchpilot.core.config import PolicyConfig, SchedulerConfig
from batchpilot.core.costmodel import CostModel
from batchpilot.sim.synthetic import synthetic_workload
from batchpilot.sim.traces import conv_embed
from batchpilot.sim.tune import Candidate, TuneConfig, Tuner, baselines, explain, grid, write_yaml


def md1_tuner(sla: float) -> tuple[Tuner, Candidate]:
    # batch size 1, 10 ms per request, constant lengths: capacity is a utilisation just below 1
    wl = synthetic_workload("poisson:rate=10", 1500, "constant:value=16", seed=0)
    cm = CostModel(latency_coef=(0.01, 0.0, 0.0, 0.0), memory_coef=(0.0, 0.0, 0.0, 0.0))
    cfg = SchedulerConfig(policy=PolicyConfig(name="window", max_batch_size=1, max_wait_s=0.0))
    return Tuner(wl, cm, TuneConfig(sla_p99_s=sla)), Candidate("md1", cfg)


def test_capacity_is_bracketed_within_tolerance_and_monotone_in_the_sla() -> None:
    caps = []
    for sla in (0.05, 0.2):
        tuner, cand = md1_tuner(sla)
        tuner.capacity(cand, tuner.workload, rel_tol=0.02, start=1.0)
        assert cand.report is not None and cand.report.p99_all <= sla
        failed = [k for k, ok in cand.probes if not ok]
        assert failed and min(failed) / cand.capacity <= 1.02 + 1e-9
        assert 0.5 < cand.rps * 0.01 < 1.0  # utilisation at capacity
        caps.append(cand.capacity)
    assert caps[0] < caps[1]  # a looser SLA carries more load


def test_early_exit_probe_agrees_with_the_full_run() -> None:
    tuner, cand = md1_tuner(0.05)
    for k in (5.0, 9.5, 12.0):
        quick = tuner.probe(cand.config, tuner.workload, k, stop_early=True)
        full = tuner.probe(cand.config, tuner.workload, k, stop_early=False)
        assert full is not None
        assert (quick is not None and quick.p99_all <= 0.05) == (full.p99_all <= 0.05)


def test_search_ranks_baselines_and_writes_a_loadable_yaml(tmp_path: Path) -> None:
    wl = conv_embed().slice(0, 1200)
    tc = TuneConfig(sla_p99_s=1.0, candidates=6, rungs=2, rel_tol=(0.15, 0.06), min_rows=300, seed=1)
    result = Tuner(wl, CostModel.default_cpu_minilm(), tc).run()
    kinds = [c.kind for c in result.candidates]
    assert kinds.count("baseline") == 3 and kinds.count("default") == 1
    assert [c.rps for c in result.candidates] == sorted((c.rps for c in result.candidates), reverse=True)
    assert result.best.rps >= max(c.rps for c in result.baselines)
    static = next(c for c in result.baselines if c.config.policy.name == "static")
    assert result.best.rps > static.rps  # padding everything to 512 cannot win on conv-embed
    assert "winner" in explain(result) and "padding efficiency" in explain(result)
    path = write_yaml(result, tmp_path / "best.yaml")
    assert set(yaml.safe_load(path.read_text())) == {"encoder", "server"}
    from batchpilot.settings import load_spec  # what `serve --config` and `simulate --config` read

    assert load_spec(path).encoder == result.best.config


def test_grid_respects_allowed_paddings_and_baseline_semantics() -> None:
    tc = TuneConfig(paddings=("dynamic",))
    assert {c.config.planner.padding for c in grid(SchedulerConfig(), tc)} == {"dynamic"}
    bucketed = [c for c in grid(SchedulerConfig(), TuneConfig()) if c.config.planner.grouping == "bucket"]
    assert {c.config.bucketing.method for c in bucketed} == {"fixed", "quantile", "dp"}
    static, ray, wide = baselines(SchedulerConfig())
    assert static.config.planner.padding == "max" and static.config.policy.name == "static"
    assert (ray.config.policy.name, ray.config.policy.max_batch_size, ray.config.policy.max_wait_s) == \
        ("window", 10, 0.01)
    assert ray.config.planner.grouping == "fifo" and ray.config.planner.padding == "dynamic"
    with pytest.raises(ValueError, match="rel_tol"):
        TuneConfig(rungs=4)


def test_variants_are_searched_one_profile_each_and_the_winner_names_its_backend_and_dtype(
        tmp_path: Path) -> None:
    import dataclasses

    from batchpilot.core.deployment import DeploymentSpec
    from batchpilot.settings import load_spec
    from batchpilot.sim.tune import tune_variants, write_variant_yaml

    base = CostModel.default_cpu_minilm()
    fast = dataclasses.replace(base, latency_coef=tuple(c / 3 for c in base.latency_coef),
                               meta={"backend": "torch", "dtype": "bfloat16"})
    slow = dataclasses.replace(base, meta={"backend": "torch", "dtype": "float32"})
    paths = []
    for name, cm in (("fp32", slow), ("bf16", fast)):
        (tmp_path / f"{name}.json").write_text(json.dumps({"cost_model": cm.to_dict()}))
        paths.append(str(tmp_path / f"{name}.json"))
    wl = conv_embed().slice(0, 600)
    tc = TuneConfig(sla_p99_s=1.0, candidates=4, rungs=1, rel_tol=(0.1,), min_rows=300, seed=2)
    results = tune_variants(wl, paths, tc, DeploymentSpec())
    assert [v.label for v in results] == ["torch/bfloat16", "torch/float32"]  # 3x cheaper carries more
    assert results[0].result.best.rps > results[1].result.best.rps
    out = write_variant_yaml(results[0], tmp_path / "best.yaml", DeploymentSpec())
    spec = load_spec(out)
    assert (spec.model.backend, spec.model.dtype) == ("torch", "bfloat16")
    assert spec.encoder == results[0].result.best.config
    assert f"--profile {paths[1]}" in out.read_text()
