"""A declared latency SLA against the predicted completion: a request is done when its whole batch is,
so admission counts the batch-mates that join after it; under overload the admitted requests finish
within the SLA, and at light load nothing is refused."""

from __future__ import annotations

import numpy as np
import pytest

from batchpilot.core.admission import batch_mates_s
from batchpilot.core.config import AdmissionConfig, PlannerConfig, PolicyConfig, SchedulerConfig
from batchpilot.core.costmodel import CostModel
from batchpilot.sim.synthetic import synthetic_workload
from batchpilot.sim.target import DONE, REJECTED, simulate_encoder

C0, C1, CAP = 0.02, 0.004, 16  # a full batch: 84 ms, 190 inputs/s on one slot
COST = CostModel(latency_coef=(C0, C1, 0.0, 0.0), memory_coef=(0.0, 0.0, 0.0, 0.0))


def test_batch_mates_fill_the_rest_of_the_last_batch_as_far_as_arrivals_come() -> None:
    # places 0..15 form the first batch: a request at place 5 has 10 places after it
    assert batch_mates_s(5, 1, 16, 0.01, 0.002, 1, np.inf) == pytest.approx(10 * 0.01)
    assert batch_mates_s(15, 1, 16, 0.01, 0.002, 1, np.inf) == 0.0  # it closes its batch
    assert batch_mates_s(16, 1, 16, 0.01, 0.002, 1, np.inf) == pytest.approx(15 * 0.01)
    assert batch_mates_s(5, 3, 16, 0.01, 0.006, 1, np.inf) == pytest.approx(8 * 0.01)  # its last input
    assert batch_mates_s(5, 1, 16, 0.01, 0.002, 1, 2.5) == pytest.approx(2.5 * 0.01)  # few arrive in time
    # two slots: shares are per slot, but one slot runs the whole batch, its own input's part too
    assert batch_mates_s(5, 1, 16, 0.01, 0.002, 2, np.inf) == pytest.approx(10 * 0.02 + 0.002)


def sla_config(grouping: str, sla_s: float) -> SchedulerConfig:
    return SchedulerConfig(policy=PolicyConfig(name="window", max_batch_size=CAP, max_wait_s=0.002),
                           planner=PlannerConfig(grouping=grouping, padding="none"),  # type: ignore[arg-type]
                           admission=AdmissionConfig(latency_sla_s=sla_s))


@pytest.mark.parametrize("grouping", ["fifo", "sorted", "dp"])
def test_under_overload_the_admitted_requests_finish_within_the_sla(grouping: str) -> None:
    # 2x what one slot serves, mixed lengths, exact batch costs: the prediction is the outcome
    wl = synthetic_workload("poisson:rate=380", 20_000, "lognormal:median=64,sigma=0.8", seed=1)
    run = simulate_encoder(wl, sla_config(grouping, 0.5), COST)
    status = np.asarray(run.record.status)
    done = status == DONE
    latency = np.asarray(run.record.finish_s)[done] - wl.arrival_s[done]
    assert latency.max() <= 0.5 + 1e-9
    assert (status == REJECTED).sum() > 5_000  # really overloaded
    assert done.sum() / wl.arrival_s[-1] > 0.95 * CAP / (C0 + C1 * CAP)  # and still near capacity


def test_at_light_load_a_tight_sla_refuses_nothing() -> None:
    # 20% of capacity: a request that arrives while a batch runs waits for it, and for the few inputs
    # that arrive before its own batch starts, not for a full batch of mates (84 ms)
    wl = synthetic_workload("poisson:rate=40", 5_000, "constant:value=64", seed=2)
    run = simulate_encoder(wl, sla_config("sorted", 0.1), COST)
    status = np.asarray(run.record.status)
    latency = np.asarray(run.record.finish_s) - wl.arrival_s
    assert (status == REJECTED).sum() == 0
    assert latency.max() < 0.1
