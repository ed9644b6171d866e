"""sim.arms: each arm's rows through its own deployment, assigned as the server assigns them."""

from __future__ import annotations

import numpy as np
import pytest

from batchpilot.core.config import PolicyConfig, SchedulerConfig
from batchpilot.core.costmodel import CostModel
from batchpilot.core.deployment import DeploymentSpec
from batchpilot.core.rollout import ArmSpec, RolloutSpec, arm_for
from batchpilot.sim.arms import assign, client_keys, simulate_arms
from batchpilot.sim.traces import Workload

FIXED = CostModel(latency_coef=(0.02, 0.0, 0.0, 0.0), meta={"source": "noop"})


def poisson(n: int, rate: float, seed: int = 0) -> Workload:
    rng = np.random.default_rng(seed)
    return Workload.from_columns("poisson", np.cumsum(rng.exponential(1 / rate, n)), rng.integers(8, 128, n))


def spec(policy: str, wait_s: float) -> DeploymentSpec:
    return DeploymentSpec(encoder=SchedulerConfig(policy=PolicyConfig(name=policy, max_batch_size=32,
                                                                      max_wait_s=wait_s)))


def test_client_keys_are_seeded_and_the_assignment_is_the_servers() -> None:
    keys = client_keys(500, 50, seed=3)
    assert keys == client_keys(500, 50, seed=3) and len(set(keys)) <= 50
    rollout = RolloutSpec((ArmSpec("canary", 0.3),))
    arms = assign(keys, rollout)
    assert arms.tolist() == [arm_for(k, [0.7, 0.3], 0.0) for k in keys]
    with pytest.raises(ValueError, match="clients"):
        client_keys(10, 0)


def test_every_row_runs_on_exactly_one_arm_and_a_waiting_arm_is_slower() -> None:
    wl = poisson(2000, 100.0)
    rollout = RolloutSpec((ArmSpec("wait", 0.5, spec("window", 0.06)),))
    runs = simulate_arms(wl, client_keys(len(wl), 100), spec("hybrid", 0.0), rollout, FIXED)
    assert set(runs) == {"primary", "wait"}
    assert sum(len(r.workload) for r in runs.values()) == len(wl)
    p99 = {a: float(np.quantile(np.asarray(r.record.finish_s) - r.workload.arrival_s, 0.99))
           for a, r in runs.items()}
    assert p99["wait"] > p99["primary"]


def test_keys_must_match_the_rows() -> None:
    with pytest.raises(ValueError, match="client keys"):
        simulate_arms(poisson(10, 1.0), ["a"], DeploymentSpec(), RolloutSpec(), FIXED)
