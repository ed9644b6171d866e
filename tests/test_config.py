"""SchedulerConfig: validation messages, YAML round trip, unknown keys rejected."""

from __future__ import annotations

import pytest
import yaml

from batchpilot.core.config import (
    AdmissionConfig,
    BucketingConfig,
    PlannerConfig,
    PolicyConfig,
    SchedulerConfig,
)


def test_yaml_round_trip() -> None:
    cfg = SchedulerConfig(policy=PolicyConfig(name="sla", max_batch_size=16, sla_s=0.5),
                          planner=PlannerConfig(grouping="dp", padding="none", max_batch_tokens=4096),
                          bucketing=BucketingConfig(method="kmeans", boundaries=(32, 64)),
                          admission=AdmissionConfig(rate=50.0, burst=10), queue_order="edf", num_slots=2)
    text = yaml.safe_dump(cfg.to_dict())
    assert SchedulerConfig.from_dict(yaml.safe_load(text)) == cfg
    assert SchedulerConfig.from_dict(None) == SchedulerConfig()


def test_unknown_keys_are_errors() -> None:
    with pytest.raises(ValueError, match="unknown key 'polcy'"):
        SchedulerConfig.from_dict({"polcy": {}})
    with pytest.raises(ValueError, match="max_wiat_s"):
        SchedulerConfig.from_dict({"policy": {"max_wiat_s": 0.1}})


@pytest.mark.parametrize(("build", "message"), [
    (lambda: PolicyConfig(name="fast"), "choose one of"),  # type: ignore[arg-type]
    (lambda: PolicyConfig(max_batch_size=0), "max_batch_size must be >= 1"),
    (lambda: PolicyConfig(min_wait_s=0.5, max_wait_s=0.1), "min_wait_s"),
    (lambda: PolicyConfig(ewma_alpha=0.0), "ewma_alpha"),
    (lambda: PolicyConfig(aimd_mult=1.5), "aimd_mult"),
    (lambda: PlannerConfig(grouping="random"), "choose one of"),  # type: ignore[arg-type]
    (lambda: PlannerConfig(pad_to_multiple_of=0), "pad_to_multiple_of"),
    (lambda: PlannerConfig(padding="max", max_len=512, max_batch_tokens=256), "max_batch_tokens"),
    (lambda: BucketingConfig(boundaries=(64, 32)), "strictly increasing"),
    (lambda: AdmissionConfig(rate=5.0, burst=0), "burst must be >= 1"),
    (lambda: SchedulerConfig(num_slots=0), "num_slots"),
    (lambda: SchedulerConfig(queue_order="lifo"), "choose one of"),  # type: ignore[arg-type]
])
def test_validation_says_what_to_change(build: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build()  # type: ignore[operator]
