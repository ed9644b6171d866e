"""The driver's turnaround between batches: measured by the profile's loaded phase on the deployment the
server runs (``profile.serving.turnaround``, ``turnaround_line``, ``profile.serving.scheduler_config``),
charged by the simulator to a batch that starts as the one before it ends (``sim.target``)."""

from __future__ import annotations

import numpy as np
import pytest

from batchpilot.core.config import PolicyConfig, SchedulerConfig
from batchpilot.core.costmodel import CostModel
from batchpilot.profile.serving import Loaded, frontend_fields, scheduler_config, turnaround, turnaround_line
from batchpilot.runtime.executor import NoopExecutor
from batchpilot.sim.service import FrontEnd
from batchpilot.sim.target import simulate_encoder
from batchpilot.sim.traces import Workload


def _batch(start: float, took: float, arrivals: list[float]) -> Loaded:
    return Loaded({"n": float(len(arrivals)), "tokens": 10.0}, took, start, arrivals)


def test_the_turnaround_is_the_mean_gap_before_batches_whose_requests_waited() -> None:
    batches, t, end = [], 0.0, 0.0
    for k in range(12):  # each batch 10 ms, its request arrived 1 ms before the one before it ended
        batches.append(_batch(t, 0.010, [end - 0.001]))
        end = t + 0.010
        t = end + (0.001 if k % 2 else 0.003)  # gaps alternate 3 ms and 1 ms
    # a batch after an idle slot (its request arrived after the last end) is not a turnaround
    batches.append(_batch(end + 1.0, 0.010, [end + 0.999]))
    gaps = [b.start - (a.start + a.slot_s) for a, b in zip(batches[:12], batches[1:12], strict=False)]
    assert turnaround(batches) == pytest.approx(float(np.mean(gaps)))
    assert turnaround(list(reversed(batches))) == pytest.approx(float(np.mean(gaps)))  # in start order
    assert turnaround(batches[:5]) == 0.0  # too few to say
    assert turnaround(batches, window_s=0.002) == 0.0  # they waited 1 ms: a 2 ms window could hold them
    pipelined = [_batch(0.01 * k, 0.012, [0.01 * k - 0.005]) for k in range(20)]  # starts before the end
    assert turnaround(pipelined) == 0.0


def test_frontend_fields_carry_the_turnaround() -> None:
    fields = frontend_fields((1.0, 0.0, 0.0), {"turnaround_s": 0.0007})  # a profile without the line
    assert FrontEnd(**fields).batch_gap_s == 0.0007 and fields["batch_gap_per_input_s"] == 0.0
    fields = frontend_fields((1.0, 0.0, 0.0), {"turnaround_s": 0.0007, "turnaround_line": [0.0004, 0.0001]})
    assert (fields["batch_gap_s"], fields["batch_gap_per_input_s"]) == (0.0004, 0.0001)
    assert frontend_fields((1.0, 0.0, 0.0), {})["batch_gap_s"] == 0.0


def test_the_turnaround_line_follows_the_size_of_the_batch_before() -> None:
    # batches of 1..6 inputs in turn, each 10 ms; the gap after a batch of n is 0.4 ms + 0.1 ms * n
    batches, t = [], 0.0
    for k in range(60):
        n = 1 + k % 6
        batches.append(_batch(t, 0.010, [t - 0.002] * n))  # its requests waited: the gap is a turnaround
        t += 0.010 + 0.0004 + 0.0001 * n
    const, per_input = turnaround_line(batches)
    assert const == pytest.approx(0.0004, abs=1e-9) and per_input == pytest.approx(0.0001, rel=1e-6)
    assert turnaround_line(batches[:5]) == (0.0, 0.0)  # too few to say
    flat = [_batch(0.02 * k, 0.010, [0.02 * k - 0.001] * (1 + k % 3)) for k in range(30)]  # 10 ms, any size
    assert turnaround_line(flat) == pytest.approx((turnaround(flat), 0.0))


@pytest.mark.parametrize("pipeline", ["off", "on"])
def test_the_simulator_adds_the_turnaround_per_input_of_the_batch_before(pipeline: str) -> None:
    # a burst of 7 at t=0 served in batches of at most 3 (3, 3, 1), then one request after idling; a
    # pipelined slot takes its next batch while the one before still runs (which it is answered after)
    workload = Workload.from_columns("t", [0.0] * 7 + [5.0], [16] * 8)
    cm = CostModel(latency_coef=(0.010, 0.0, 0.0, 0.0))
    cfg = SchedulerConfig(policy=PolicyConfig(name="window", max_batch_size=3, max_wait_s=0.0),
                          pipeline=pipeline)  # type: ignore[arg-type]
    fe = FrontEnd(batch_overhead_s=0.001, batch_gap_s=0.0005, batch_gap_per_input_s=0.0002)
    run = simulate_encoder(workload, cfg, cm, frontend=fe)
    order = np.argsort(run.record.b_start, kind="stable")
    took = np.asarray(run.record.b_duration)[order]
    assert list(np.asarray(run.record.b_size)[order]) == [3, 3, 1, 1]
    # the first and the lone batch after idling pay the overhead; the others 0.5 ms + 0.2 ms per input
    # of the batch before them (3 each time)
    assert took == pytest.approx([0.011, 0.010 + 0.0011, 0.010 + 0.0011, 0.011])


@pytest.mark.parametrize("gap", [0.005, 0.0])
def test_the_simulator_charges_the_turnaround_to_a_batch_started_behind_another(gap: float) -> None:
    # a burst of 6 at t=0 (one batch after another, one request each), then one request after idling
    arrivals = [0.0] * 6 + [5.0]
    workload = Workload.from_columns("t", arrivals, [16] * len(arrivals))
    cm = CostModel(latency_coef=(0.010, 0.0, 0.0, 0.0))
    cfg = SchedulerConfig(policy=PolicyConfig(name="window", max_batch_size=1, max_wait_s=0.0))
    run = simulate_encoder(workload, cfg, cm, frontend=FrontEnd(batch_overhead_s=0.001, batch_gap_s=gap))
    order = np.argsort(run.record.b_start, kind="stable")
    took = np.asarray(run.record.b_duration)[order]
    behind = gap or 0.001  # without a measured turnaround, the lone overhead
    assert took == pytest.approx([0.011] + [0.010 + behind] * 5 + [0.011])


def test_the_profile_serves_the_deployment_serve_resolves() -> None:
    ex = NoopExecutor()
    cheap = CostModel(latency_coef=(0.01, 0.0, 0.0, 0.0), meta={"prepare_share": 0.001})
    costly = CostModel(latency_coef=(0.01, 0.0, 0.0, 0.0), meta={"prepare_share": 0.2})
    assert scheduler_config(ex, "none", cheap).pipeline == "off"  # collation too cheap to pipeline
    on = scheduler_config(ex, "none", costly)
    assert on.pipeline == "on" and on.pipeline_lead_s > 0
    assert on.policy.max_wait_s == 0.0 and on.planner.padding == "none"
    assert on.admission.timeout_s > 0  # the server's request timeout, as serve resolves it
