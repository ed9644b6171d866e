"""Metrics on hand-checkable runs, and the invariants every simulated run must keep (hypothesis)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchpilot.core.config import AdmissionConfig, PlannerConfig, PolicyConfig, SchedulerConfig
from batchpilot.core.costmodel import CostModel
from batchpilot.sim.metrics import peak_concurrent, queue_length_series, summarize
from batchpilot.sim.synthetic import synthetic_workload
from batchpilot.sim.target import DONE, DROPPED, REJECTED, simulate_encoder
from batchpilot.sim.traces import Workload


def const_cost(c0: float, per_token: float = 0.0, mem_per_token: float = 0.0) -> CostModel:
    return CostModel(latency_coef=(c0, 0.0, per_token, 0.0), memory_coef=(0.0, 0.0, mem_per_token, 0.0))


def test_hand_checked_run() -> None:
    # batch size 1, no window, 0.1 s per call: arrivals 0, 0.05, 0.3 -> waits 0, 0.05, 0
    wl = Workload.from_columns("h", [0.0, 0.05, 0.3], [10, 30, 20])
    cfg = SchedulerConfig(policy=PolicyConfig(name="window", max_batch_size=1, max_wait_s=0.0),
                          planner=PlannerConfig(grouping="fifo", padding="dynamic"))
    run = simulate_encoder(wl, cfg, const_cost(0.1, mem_per_token=1000.0))
    rep = summarize(run, sla_s=0.12)
    np.testing.assert_allclose(run.record.finish_s, [0.1, 0.2, 0.4])
    assert rep.latency["mean"] == pytest.approx((0.1 + 0.15 + 0.1) / 3)
    assert rep.queue["mean"] == pytest.approx(0.05 / 3)
    assert rep.sla_attainment == pytest.approx(2 / 3)
    assert rep.throughput_rps == pytest.approx(3 / 0.4)
    assert rep.throughput_tokens_s == pytest.approx(60 / 0.4)
    assert rep.padding_efficiency == 1.0 and rep.mean_batch_size == 1.0 == rep.request_batch_size
    assert rep.tail_queue_share == pytest.approx(0.05 / 0.15)  # the slowest request waited 50 of 150 ms
    assert rep.utilisation == pytest.approx(0.3 / 0.4)
    assert rep.peak_memory_bytes == 30_000.0
    assert rep.batch_size_hist == {1: 3}
    t, q = queue_length_series(run)
    assert q.max() == 1 and q[-1] == 0


def test_failures_count_as_infinitely_late_and_warmup_is_excluded() -> None:
    wl = Workload.from_columns("f", [0.0, 1.0, 2.0, 3.0], [10, 600, 10, 10])
    cfg = SchedulerConfig(policy=PolicyConfig(name="window", max_batch_size=1, max_wait_s=0.0),
                          admission=AdmissionConfig(max_length=512))
    run = simulate_encoder(wl, cfg, const_cost(0.01))
    assert run.record.status == [DONE, REJECTED, DONE, DONE]
    rep = summarize(run, sla_s=1.0)
    assert rep.num_rejected == 1 and rep.failures_by_reason == {"too_long": 1}
    assert math.isinf(rep.p99_all) and rep.latency["p99"] == pytest.approx(0.01)
    assert rep.sla_attainment == 0.75
    late = summarize(run, sla_s=1.0, warmup_s=1.5)
    assert late.num_measured == 2 and late.p99_all == pytest.approx(0.01)


def test_deadline_drops_and_refusals_are_recorded() -> None:
    wl = Workload.from_columns("d", [0.0] * 6, [10] * 6)
    cfg = SchedulerConfig(policy=PolicyConfig(name="window", max_batch_size=1, max_wait_s=0.0))
    # the scheduler believes 0.1 s per batch, so it admits all six within their 1 s deadlines; batches
    # really take 0.4 s, so the later ones expire in the queue
    run = simulate_encoder(wl, cfg, const_cost(0.1), service_model=const_cost(0.4), request_sla_s=1.0)
    status = run.record.status
    assert status.count(DONE) >= 2 and status.count(DROPPED) >= 1
    assert set(status) <= {DONE, DROPPED}
    assert summarize(run).failures_by_reason.get("deadline_expired", 0) == status.count(DROPPED)
    # believing the true 0.4 s, admission refuses what its predicted completion says would miss
    run = simulate_encoder(wl, cfg, const_cost(0.4), request_sla_s=1.0)
    assert run.record.status.count(DONE) == 2 and run.record.status.count(REJECTED) == 4


def test_peak_concurrent_releases_before_acquiring_at_a_tie() -> None:
    start, end = np.array([0.0, 1.0, 1.5]), np.array([1.0, 2.0, 2.5])
    assert peak_concurrent(start, end, np.array([5.0, 7.0, 1.0])) == 8.0


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    rate=st.floats(5.0, 200.0),
    slots=st.integers(1, 3),
    policy=st.sampled_from(["window", "backlog", "hybrid", "adaptive", "sla", "aimd", "static"]),
    layout=st.sampled_from([("fifo", "dynamic"), ("sorted", "dynamic"), ("bucket", "bucket"),
                            ("dp", "dynamic"), ("sorted", "none"), ("fifo", "max")]),
    cap=st.integers(1, 16),
    budget=st.sampled_from([0, 2048]),
)
def test_no_request_is_lost_or_duplicated_and_budgets_hold(
    seed: int, rate: float, slots: int, policy: str, layout: tuple[str, str], cap: int, budget: int
) -> None:
    wl = synthetic_workload(f"renewal:rate={rate},cv=2", 300, "lognormal:median=64,sigma=1", seed=seed)
    cfg = SchedulerConfig(
        policy=PolicyConfig(name=policy, max_batch_size=cap, max_wait_s=0.02),  # type: ignore[arg-type]
        planner=PlannerConfig(grouping=layout[0], padding=layout[1], max_batch_tokens=budget),  # type: ignore[arg-type]
        num_slots=slots)
    run = simulate_encoder(wl, cfg, CostModel.default_cpu_minilm())
    rec = run.record
    assert not run.stats.stalled
    assert set(rec.status) <= {DONE, REJECTED}
    assert sum(rec.b_size) == rec.status.count(DONE)  # each completed request ran in exactly one batch
    assert max(rec.b_size) <= cap
    if budget:
        assert all(t <= budget or n == 1 for t, n in zip(rec.b_tokens, rec.b_size, strict=True))
    arrival = wl.arrival_s
    done = np.asarray(rec.status) == DONE
    assert (np.asarray(rec.dispatch_s)[done] >= arrival[done]).all()
    assert (np.asarray(rec.finish_s)[done] > np.asarray(rec.dispatch_s)[done]).all()
    # never more batches running than slots
    starts, ends = np.asarray(rec.b_start), np.asarray(rec.b_start) + np.asarray(rec.b_duration)
    assert peak_concurrent(starts, ends, np.ones_like(starts)) <= slots
    rep = summarize(run)
    assert rep.mean_batch_size <= rep.request_batch_size + 1e-9 <= cap + 1e-9
    assert 0.0 < rep.padding_efficiency <= 1.0
