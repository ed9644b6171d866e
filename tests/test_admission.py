"""Admission: each rejection reason, its message and retry hint, and the token bucket."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchpilot.core.admission import AdmissionController, RejectReason, TokenBucket
from batchpilot.core.config import AdmissionConfig, PlannerConfig
from batchpilot.core.costmodel import CostModel
from batchpilot.core.request import Request
from core_factories import make_request, simple_cost_model

COST = simple_cost_model(const=0.010, per_token=1e-4, residuals=(0.0, 0.5))  # p99 ~ 1.5 x mean


def controller(planner: PlannerConfig | None = None, **kw: object) -> AdmissionController:
    return AdmissionController(AdmissionConfig(**kw), planner or PlannerConfig(padding="dynamic"), COST,  # type: ignore[arg-type]
                               max_batch_size=8)


def test_too_long_names_the_limit() -> None:
    c = controller(max_length=256)
    rej = c.check(make_request(300), 0.0, 0, 0)
    assert rej is not None and rej.reason is RejectReason.TOO_LONG and "256" in rej.message
    assert rej.retry_after_s is None
    assert c.check(make_request(256), 0.0, 0, 0) is None
    # the planner's max_len is a limit too (the model cannot run longer inputs)
    short_model = controller(PlannerConfig(max_len=128), max_length=512)
    assert short_model.check(make_request(200), 0, 0, 0) is not None


def test_a_request_that_can_never_fit_a_batch_is_too_long() -> None:
    c = controller(PlannerConfig(max_batch_tokens=100, padding="dynamic", pad_to_multiple_of=64))
    rej = c.check(make_request(80), 0.0, 0, 0)  # pads to 128 > 100
    assert rej is not None and rej.reason is RejectReason.TOO_LONG and "max_batch_tokens" in rej.message
    mem = controller(PlannerConfig(max_batch_memory_bytes=50_000))
    assert mem.check(make_request(100), 0.0, 0, 0) is not None  # 100 tokens x 1000 bytes
    assert mem.check(make_request(40), 0.0, 0, 0) is None


def test_infeasible_deadline_uses_the_high_quantile() -> None:
    c = controller()
    # 100 tokens alone: mean 20 ms, p99 ~30 ms
    assert c.check(make_request(100, deadline=0.050), 0.0, 0, 0) is None
    rej = c.check(make_request(100, deadline=0.025), 0.0, 0, 0)  # the mean would fit, the p99 does not
    assert rej is not None and rej.reason is RejectReason.INFEASIBLE_DEADLINE and "ms" in rej.message
    assert controller(reject_infeasible=False).check(make_request(100, deadline=0.025), 0.0, 0, 0) is None


def test_queue_full_by_requests_and_by_tokens_with_a_retry_hint() -> None:
    c = controller(max_queued_requests=3, max_queued_tokens=1000)
    rej = c.check(make_request(10), 0.0, 3, 30)
    assert rej is not None and rej.reason is RejectReason.QUEUE_FULL
    assert rej.retry_after_s is not None and rej.retry_after_s > 0
    rej = c.check(make_request(100), 0.0, 2, 950)
    assert rej is not None and rej.reason is RejectReason.QUEUE_FULL and "max_queued_tokens" in rej.message
    assert c.check(make_request(50), 0.0, 2, 950) is None


def test_rate_limit_token_bucket() -> None:
    c = controller(rate=10.0, burst=2)
    assert c.check(make_request(), 0.0, 0, 0) is None
    assert c.check(make_request(), 0.0, 0, 0) is None
    rej = c.check(make_request(), 0.0, 0, 0)
    assert rej is not None and rej.reason is RejectReason.RATE_LIMITED
    assert rej.retry_after_s == pytest.approx(0.1)
    assert c.check(make_request(), 0.1, 0, 0) is None
    # a rejected request does not spend a token
    assert c.check(make_request(10_000), 0.2, 0, 0) is not None
    assert c.check(make_request(), 0.2, 0, 0) is None


def test_token_bucket_refills_to_burst_only() -> None:
    b = TokenBucket(rate=100.0, burst=3)
    assert [b.try_take(0.0) for _ in range(3)] == [0.0, 0.0, 0.0]
    assert b.try_take(0.0) > 0
    assert [b.try_take(100.0) for _ in range(3)] == [0.0, 0.0, 0.0]  # long idle: still only 3
    assert b.try_take(100.0) == pytest.approx(0.01)


def test_work_bound_counts_each_input_at_its_share_of_a_full_batch() -> None:
    c = controller(max_backlog_s=0.1)  # dynamic padding, batches of <= 8
    assert c.work_s[100] == pytest.approx(COST.batch_latency(8, 800, 8 * 100 * 100) / 8)
    assert c.work_s[64] < c.work_s[100] < c.work_s[512]
    full = 0.1 - c.work_s[100]
    assert c.check(make_request(100), 0.0, 5, 500, full) is None  # exactly at the bound: admitted
    rej = c.check(make_request(100), 0.0, 5, 500, full + 0.004)
    assert rej is not None and rej.reason is RejectReason.QUEUE_FULL and "max_backlog_s" in rej.message
    assert rej.retry_after_s == pytest.approx(0.004)
    assert c.check(make_request(512), 0.0, 0, 0, 0.0) is None  # an empty queue always admits
    budget = controller(PlannerConfig(padding="dynamic", max_batch_tokens=256), max_backlog_s=0.1)
    assert budget.work_s[128] == pytest.approx(COST.batch_latency(2, 256, 2 * 128 * 128) / 2)  # 2 fit
    two_slots = AdmissionController(AdmissionConfig(), PlannerConfig(padding="dynamic"), COST, 8, num_slots=2)
    assert two_slots.work_s[100] == pytest.approx(c.work_s[100] / 2)


def test_backlog_bound_counts_batches_in_flight_and_queued_work() -> None:
    """MiniLM on one CPU core (the built-in cost model), 1 s SLA: the bound admits inputs while the
    predicted backlog (in flight + queued) stays within 0.6 s, whatever their lengths; a dispatched
    batch counts until it is reported done, also when it never ran."""
    from batchpilot.core.config import SchedulerConfig
    from batchpilot.core.overload import with_sla_queue_bounds
    from batchpilot.core.scheduler import BatchScheduler

    cm = CostModel.default_cpu_minilm()
    cfg = with_sla_queue_bounds(SchedulerConfig())
    assert cfg.admission.max_backlog_s == pytest.approx(0.6)
    sched = BatchScheduler(cfg, cm)
    work = sched.admission.work_s

    def fill(length: int, first_id: int) -> int:
        n = 0
        while sched.submit(Request(first_id + n, 0.0, length), 0.0) is None and n < 10_000:
            n += 1
        return n

    n64 = fill(64, 0)
    assert n64 == int(0.6 / work[64]) or n64 == int(0.6 / work[64]) + 1  # +1: the first, on an empty queue
    assert sched.predicted_backlog_s <= 0.6 + work[64]
    out = sched.schedule(0.0, 1)
    assert len(out.batches) == 1 and sched.num_in_flight == 1
    moved = out.batches[0]
    # the dispatched batch is backlog now: it left the queue but not the work ahead of new inputs
    assert sched.predicted_backlog_s == pytest.approx(sched.queue.num_work_s + moved.predicted_s)
    assert fill(64, 100_000) <= 1
    sched.on_batch_done(moved, 0.2, 0.0, ran=False)  # everyone in it left: not a completed batch
    assert sched.num_in_flight == 0 and sched.stats.completed_batches == 0
    assert sched.predicted_backlog_s == pytest.approx(sched.queue.num_work_s)
    room = 0.6 - sched.predicted_backlog_s
    assert fill(512, 200_000) == int(room / work[512] + 1e-9)  # long inputs: fewer fit the same seconds


def test_backlog_follows_how_long_batches_really_take() -> None:
    """Batches reported at twice their predicted time make the backlog count double (a moving average,
    clamped), so an overloaded CPU sharing its cores with the HTTP layer does not over-admit."""
    from batchpilot.core.config import SchedulerConfig
    from batchpilot.core.overload import with_sla_queue_bounds
    from batchpilot.core.scheduler import WORK_SCALE_MAX, BatchScheduler

    cm = CostModel.default_cpu_minilm()
    sched = BatchScheduler(with_sla_queue_bounds(SchedulerConfig()), cm)
    rid = 0
    for _ in range(60):
        for _ in range(16):
            assert sched.submit(Request(rid, 0.0, 64), 0.0) is None
            rid += 1
        (batch,) = sched.schedule(1.0, 1).batches
        sched.on_batch_done(batch, 1.0, 2.0 * batch.predicted_s)
    assert sched.work_scale == pytest.approx(2.0, rel=0.01) and sched.num_waiting == 0
    for _ in range(4):
        assert sched.submit(Request(rid, 0.0, 64), 0.0) is None
        rid += 1
    assert sched.predicted_backlog_s == pytest.approx(2.0 * 4 * sched.admission.work_s[64], rel=0.01)
    (batch,) = sched.schedule(1.0, 1).batches
    sched.on_batch_done(batch, 1.0, 100.0 * batch.predicted_s)  # one pathological batch: clamped
    assert sched.work_scale <= 2.0 + 0.1 * (WORK_SCALE_MAX - 2.0) + 1e-9


def test_every_reason_has_a_stable_value() -> None:
    expected = {"queue_full", "rate_limited", "infeasible_deadline", "too_long", "deadline_expired"}
    assert {r.value for r in RejectReason} >= expected


@settings(max_examples=300, deadline=None)
@given(st.data(), st.integers(1, 512), st.sampled_from([0.25, 1.0, 4.0]), st.sampled_from([0.005, 0.02, 0.2]),
       st.sampled_from([1, 4, 16, 64]))
def test_core_sla_bounds_refuse_exactly_what_the_server_refuses(data: st.DataObject, length: int,
                                                                 sla_s: float, const_s: float,
                                                                 max_batch: int) -> None:
    """The server checks the SLA queue bound per HTTP request (server/limits.py); the simulator gets it
    as ``admission.max_backlog_s`` (core/overload.py). For a one-input request both must give the
    same answer, in particular right at the bound."""
    from batchpilot.core.config import PolicyConfig, SchedulerConfig
    from batchpilot.core.overload import with_sla_queue_bounds
    from batchpilot.server.limits import queue_bounds

    cm = CostModel(latency_coef=(const_s, 0.0, 4e-4, 0.0))
    cfg = SchedulerConfig(policy=PolicyConfig(max_batch_size=max_batch, sla_s=sla_s))
    server = queue_bounds(cfg, cm)
    assert server is not None
    bounded = with_sla_queue_bounds(cfg)
    core = AdmissionController(bounded.admission, bounded.planner, cm, max_batch)
    assert list(server.work_s) == core.work_s and bounded.admission.max_backlog_s == server.max_backlog_s
    edge = server.max_backlog_s - core.work_s[length]
    num_waiting = data.draw(st.integers(0, 40), "num_waiting")
    waiting = data.draw(st.one_of(st.floats(0, 2 * server.max_backlog_s),
                                  st.sampled_from([edge - 1e-9, edge, edge + 1e-9])), "waiting_work_s")
    scale = data.draw(st.sampled_from([1.0, 0.5, 1.7]), "work_scale")
    if scale != 1.0:
        edge = server.max_backlog_s - core.work_s[length] * scale
        waiting = data.draw(st.sampled_from([edge - 1e-9, edge + 1e-9, waiting]), "waiting_scaled")
    rej = core.check(Request(0, 0.0, length), 0.0, num_waiting, 0, waiting, scale)
    refused = server.refusal(num_waiting, waiting, [length], scale)
    assert (rej is not None and rej.reason is RejectReason.QUEUE_FULL) == (refused is not None)
    if refused is not None and rej is not None:
        assert refused[1] >= 1.0 and rej.retry_after_s == pytest.approx(
            waiting + core.work_s[length] * scale - server.max_backlog_s)
    assert with_sla_queue_bounds(bounded) == bounded  # explicit limits win: applying twice is a no-op
