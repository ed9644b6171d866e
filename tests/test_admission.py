"""Admission: each rejection reason, its message and retry hint, the token bucket, whole-request (group)
admission, the concurrency limit, the request timeout and a declared latency SLA."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchpilot.core.admission import AdmissionController, LoadState, RejectReason
from batchpilot.core.bucket import TokenBucket
from batchpilot.core.config import AdmissionConfig, PlannerConfig, PolicyConfig, SchedulerConfig
from batchpilot.core.costmodel import CostModel
from batchpilot.core.request import Request
from batchpilot.core.scheduler import WORK_SCALE_MAX, BatchScheduler
from core_factories import make_request, simple_cost_model

COST = simple_cost_model(const=0.010, per_token=1e-4, residuals=(0.0, 0.5))  # p99 ~ 1.5 x mean


def controller(planner: PlannerConfig | None = None, **kw: object) -> AdmissionController:
    return AdmissionController(AdmissionConfig(**kw), planner or PlannerConfig(padding="dynamic"), COST,  # type: ignore[arg-type]
                               max_batch_size=8)


def check(c: AdmissionController, req: Request, now: float = 0.0, waiting: int = 0, tokens: int = 0,
          backlog: float = 0.0, scale: float = 1.0, in_progress: int = 0) -> object:
    """One single-input request through the group check."""
    return c.check_group([req], now, LoadState(in_progress, waiting, tokens, backlog, scale))


def test_too_long_names_the_limit() -> None:
    c = controller(max_length=256)
    rej = check(c, make_request(300), 0.0, 0, 0)
    assert rej is not None and rej.reason is RejectReason.TOO_LONG and "256" in rej.message
    assert rej.retry_after_s is None
    assert check(c, make_request(256), 0.0, 0, 0) is None
    # the planner's max_len is a limit too (the model cannot run longer inputs)
    short_model = controller(PlannerConfig(max_len=128), max_length=512)
    assert check(short_model, make_request(200)) is not None


def test_a_request_that_can_never_fit_a_batch_is_too_long() -> None:
    c = controller(PlannerConfig(max_batch_tokens=100, padding="dynamic", pad_to_multiple_of=64))
    rej = check(c, make_request(80), 0.0, 0, 0)  # pads to 128 > 100
    assert rej is not None and rej.reason is RejectReason.TOO_LONG and "max_batch_tokens" in rej.message
    mem = controller(PlannerConfig(max_batch_memory_bytes=50_000))
    assert check(mem, make_request(100), 0.0, 0, 0) is not None  # 100 tokens x 1000 bytes
    assert check(mem, make_request(40), 0.0, 0, 0) is None


def test_infeasible_deadline_uses_the_high_quantile() -> None:
    c = controller()
    # 100 tokens alone: mean 20 ms, p99 ~30 ms
    assert check(c, make_request(100, deadline=0.050), 0.0, 0, 0) is None
    rej = check(c, make_request(100, deadline=0.025), 0.0, 0, 0)  # the mean would fit, the p99 does not
    assert rej is not None and rej.reason is RejectReason.INFEASIBLE_DEADLINE and "ms" in rej.message
    assert check(controller(reject_infeasible=False), make_request(100, deadline=0.025)) is None


def test_queue_full_by_requests_and_by_tokens_with_a_retry_hint() -> None:
    c = controller(max_queued_requests=3, max_queued_tokens=1000)
    rej = check(c, make_request(10), 0.0, 3, 30)
    assert rej is not None and rej.reason is RejectReason.QUEUE_FULL
    assert rej.retry_after_s is not None and rej.retry_after_s > 0
    rej = check(c, make_request(100), 0.0, 2, 950)
    assert rej is not None and rej.reason is RejectReason.QUEUE_FULL and "max_queued_tokens" in rej.message
    assert check(c, make_request(50), 0.0, 2, 950) is None


def test_rate_limit_token_bucket() -> None:
    c = controller(rate=10.0, burst=2)
    assert check(c, make_request(), 0.0, 0, 0) is None
    assert check(c, make_request(), 0.0, 0, 0) is None
    rej = check(c, make_request(), 0.0, 0, 0)
    assert rej is not None and rej.reason is RejectReason.RATE_LIMITED
    assert rej.retry_after_s == pytest.approx(0.1)
    assert check(c, make_request(), 0.1, 0, 0) is None
    # a rejected request does not spend a token
    assert check(c, make_request(10_000), 0.2, 0, 0) is not None
    assert check(c, make_request(), 0.2, 0, 0) is None


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
    assert check(c, make_request(100), 0.0, 5, 500, full) is None  # exactly at the bound: admitted
    rej = check(c, make_request(100), 0.0, 5, 500, full + 0.004)
    assert rej is not None and rej.reason is RejectReason.QUEUE_FULL and "max_backlog_s" in rej.message
    assert rej.retry_after_s == pytest.approx(0.004)
    assert check(c, make_request(512), 0.0, 0, 0, 0.0) is None  # an empty queue always admits
    budget = controller(PlannerConfig(padding="dynamic", max_batch_tokens=256), max_backlog_s=0.1)
    assert budget.work_s[128] == pytest.approx(COST.batch_latency(2, 256, 2 * 128 * 128) / 2)  # 2 fit
    two_slots = AdmissionController(AdmissionConfig(), PlannerConfig(padding="dynamic"), COST, 8, num_slots=2)
    assert two_slots.work_s[100] == pytest.approx(c.work_s[100] / 2)


def test_backlog_follows_how_long_batches_really_take() -> None:
    """Batches reported at twice their predicted time make the backlog count double (a moving average,
    clamped), so an overloaded CPU sharing its cores with the HTTP layer does not over-admit."""
    cm = CostModel.default_cpu_minilm()
    sched = BatchScheduler(sla_config(0.6), cm)
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
    assert sched.predicted_backlog_s(1.0) == pytest.approx(2.0 * 4 * sched.admission.work_s[64], rel=0.01)
    (batch,) = sched.schedule(1.0, 1).batches
    sched.on_batch_done(batch, 1.0, 100.0 * batch.predicted_s)  # one pathological batch: clamped
    assert sched.work_scale <= 2.0 + 0.1 * (WORK_SCALE_MAX - 2.0) + 1e-9


def test_every_reason_has_a_stable_value() -> None:
    expected = {"queue_full", "rate_limited", "infeasible_deadline", "too_long", "deadline_expired"}
    assert {r.value for r in RejectReason} >= expected


# -- whole requests, concurrency, timeout, a declared SLA ------------------------------------------
def sla_config(sla_s: float = 0.0, **admission: object) -> SchedulerConfig:
    return SchedulerConfig(policy=PolicyConfig(max_batch_size=16),
                           admission=AdmissionConfig(latency_sla_s=sla_s, **admission))  # type: ignore[arg-type]


def group(first_id: int, lengths: list[int], arrival: float = 0.0) -> list[Request]:
    return [Request(first_id + i, arrival, n) for i, n in enumerate(lengths)]


def test_a_request_is_admitted_or_refused_with_all_its_inputs() -> None:
    sched = BatchScheduler(sla_config(max_queued_requests=4), simple_cost_model())
    assert sched.submit_group(group(0, [8, 8, 8]), 0.0) is None
    assert sched.num_waiting == 3 and sched.num_requests == 1
    rej = sched.submit_group(group(10, [8, 8]), 0.0)  # 3 + 2 > 4: neither input gets in
    assert rej is not None and rej.reason is RejectReason.QUEUE_FULL and "adds 2" in rej.message
    assert sched.num_waiting == 3 and sched.num_requests == 1 and sched.stats.rejected["queue_full"] == 2
    # one too-long input refuses the whole request, before any queue state is read
    rej = sched.submit_group(group(20, [8, 10_000]), 0.0)
    assert rej is not None and rej.reason is RejectReason.TOO_LONG and sched.num_waiting == 3
    # a request larger than a bound is served alone rather than refused forever
    empty = BatchScheduler(sla_config(max_queued_requests=4), simple_cost_model())
    assert empty.submit_group(group(0, [8] * 10), 0.0) is None and empty.num_waiting == 10


def test_a_request_leaves_with_its_last_input_whether_done_dropped_or_cancelled() -> None:
    sched = BatchScheduler(SchedulerConfig(policy=PolicyConfig(name="static", max_batch_size=2,
                                                               max_wait_s=0.0)), simple_cost_model())
    assert sched.submit_group(group(0, [8, 8, 8]), 0.0) is None
    out = sched.schedule(0.0, 1)
    (batch,) = out.batches
    assert batch.size == 2 and sched.num_requests == 1
    sched.on_batch_done(batch, 0.1, 0.01)
    assert sched.num_requests == 1  # one input still waits
    assert sched.cancel(2, 0.1)
    assert sched.num_requests == 0


def test_the_concurrency_limit_counts_requests_in_progress() -> None:
    sched = BatchScheduler(sla_config(max_concurrent_requests=2), simple_cost_model())
    assert sched.submit_group(group(0, [8] * 5), 0.0) is None
    assert sched.submit(Request(10, 0.0, 8), 0.0) is None
    rej = sched.submit(Request(11, 0.0, 8), 0.0)
    assert rej is not None and rej.reason is RejectReason.QUEUE_FULL
    assert "max_concurrent_requests" in rej.message
    assert rej.retry_after_s is not None and rej.retry_after_s > 0
    (batch,) = sched.schedule(0.1, 1).batches  # the window has passed
    sched.on_batch_done(batch, 0.1, 0.01)  # the first 5 inputs and the single: both requests done
    assert sched.num_requests == 0
    assert sched.submit(Request(12, 0.2, 8), 0.2) is None


def test_the_request_timeout_drops_inputs_that_never_started() -> None:
    sched = BatchScheduler(sla_config(timeout_s=1.0), simple_cost_model())
    assert sched.submit_group(group(0, [8, 8]), 0.0) is None
    assert sched.submit(Request(5, 0.5, 8), 0.5) is None
    out = sched.schedule(0.5, 0)  # no free slot: nothing dispatched, the wake-up is the oldest's timeout
    assert out.wake_at == pytest.approx(1.0)
    out = sched.schedule(1.0, 0)
    assert [r.request.id for r in out.dropped] == [0, 1]
    assert all(r.reason is RejectReason.DEADLINE_EXPIRED and "timeout" in r.message for r in out.dropped)
    assert sched.num_waiting == 1 and sched.num_requests == 1 and out.wake_at == pytest.approx(1.5)


def test_without_a_declared_sla_nothing_is_refused_for_latency() -> None:
    sched = BatchScheduler(sla_config(0.0), CostModel.default_cpu_minilm())
    for i in range(2000):  # far more work than any SLA: it all queues
        assert sched.submit(Request(i, 0.0, 512), 0.0) is None


def test_a_declared_sla_refuses_only_what_its_predicted_completion_misses() -> None:
    cm = CostModel.default_cpu_minilm()
    sched = BatchScheduler(sla_config(1.0), cm)
    work = sched.admission.work_s
    n = 0
    while sched.submit(Request(n, 0.0, 128), 0.0) is None:
        n += 1
    # Offered at once, each request's batch of 16 fills up behind it: admitted while its whole batch
    # is predicted to finish within the SLA (the first always gets in)
    assert n == max(1, 16 * int(1.0 / (16 * work[128]) + 1e-9))
    rej = sched.submit(Request(n + 1, 0.0, 16), 0.0)
    ahead = sched.predicted_backlog_s(0.0)
    done_in = ahead + work[16] + (15 - n % 16) * work[128]  # its mates: the recent inputs' share
    if done_in > 1.0:
        assert rej is not None and "latency SLA" in rej.message and "batch-mates" in rej.message
        assert rej.retry_after_s == pytest.approx(done_in - 1.0)
    else:
        assert rej is None
    # time passes and a dispatched batch is half done: what is left of it counts, not all of it
    (batch,) = sched.schedule(0.0, 1).batches  # the queue is past the backlog trigger: no window
    assert sched.predicted_backlog_s(0.0) == pytest.approx(sched.queue.num_work_s + batch.predicted_s)
    half = batch.predicted_s / 2
    assert sched.predicted_backlog_s(half) == pytest.approx(sched.queue.num_work_s + half)
    sched.on_batch_done(batch, 0.2, 0.0, ran=False)  # reported: no longer ahead of anyone
    assert sched.num_in_flight == 0
    assert sched.predicted_backlog_s(0.2) == pytest.approx(sched.queue.num_work_s)


def test_an_own_deadline_is_checked_against_the_work_ahead() -> None:
    cm = CostModel.default_cpu_minilm()
    sched = BatchScheduler(sla_config(0.0), cm)
    for i in range(40):
        assert sched.submit(Request(i, 0.0, 128), 0.0) is None
    ahead = sched.predicted_backlog_s(0.0)
    late = sched.submit(Request(100, 0.0, 16, deadline=ahead / 2), 0.0)
    assert late is not None and late.reason is RejectReason.QUEUE_FULL and "deadline" in late.message
    assert sched.submit(Request(101, 0.0, 16, deadline=ahead + 1.0), 0.0) is None


def test_the_next_batch_is_taken_a_lead_before_the_running_one_is_predicted_to_end() -> None:
    cfg = SchedulerConfig(pipeline_lead_s=0.002)
    sched = BatchScheduler(cfg, simple_cost_model())
    for i in range(4):
        sched.submit(Request(i, 0.0, 32), 0.0)
    (batch,) = sched.schedule(1.0, 1).batches
    assert sched.next_batch_at(batch, 1.5) == pytest.approx(1.5 + batch.predicted_s - 0.002)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 6), st.integers(1, 300)), min_size=1, max_size=40),
       st.sampled_from([0, 3, 8]), st.sampled_from([0, 10, 40]), st.sampled_from([0.0, 0.3]),
       st.integers(0, 2**16))
def test_requests_are_whole_and_none_is_lost(reqs: list[tuple[int, int]], max_conc: int, max_queued: int,
                                             sla_s: float, seed: int) -> None:
    """Every input of a request is admitted or none is; every admitted input is dispatched, dropped or
    cancelled exactly once; the concurrency limit holds at every admission; in-progress returns to 0."""
    import random

    rng = random.Random(seed)
    cfg = sla_config(sla_s, max_concurrent_requests=max_conc, max_queued_requests=max_queued, timeout_s=0.5)
    sched = BatchScheduler(cfg, simple_cost_model())
    admitted: set[int] = set()
    seen: list[int] = []
    now, rid = 0.0, 0
    for n, length in reqs:
        now += rng.random() * 0.05
        members = [Request(rid + i, now, length) for i in range(n)]
        rid += n
        before = sched.num_requests
        rej = sched.submit_group(members, now)
        if rej is None:
            assert not max_conc or before < max_conc
            admitted.update(r.id for r in members)
        else:
            assert sched.num_requests == before
        if rng.random() < 0.1 and admitted - set(seen):
            victim = min(admitted - set(seen))
            if sched.cancel(victim, now):
                seen.append(victim)
        out = sched.schedule(now, 1)
        seen.extend(r.request.id for r in out.dropped)
        for b in out.batches:
            seen.extend(r.id for r in b.requests)
            sched.on_batch_done(b, now, 0.01)
    while sched.num_waiting:
        now += 0.1
        out = sched.schedule(now, 1)
        seen.extend(r.request.id for r in out.dropped)
        for b in out.batches:
            seen.extend(r.id for r in b.requests)
            sched.on_batch_done(b, now, 0.01)
    assert sorted(seen) == sorted(admitted)
    assert sched.num_requests == 0
