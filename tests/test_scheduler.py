"""BatchScheduler: the four calls composed, on a fake clock."""

from __future__ import annotations

from batchpilot.core.admission import RejectReason
from batchpilot.core.policy import Wait
from batchpilot.core.scheduler import BatchScheduler
from core_factories import FakeClock, drive, make_request, make_scheduler, simple_cost_model


def test_an_idle_scheduler_serves_a_lone_request_at_once() -> None:
    s = make_scheduler()  # the default policy: its window opens only when waiting pays
    clock = FakeClock()
    for _ in range(3):  # sparse traffic: one request every 200 ms, each alone
        assert s.submit(make_request(10, clock()), clock()) is None
        out = s.schedule(clock(), 1)
        assert [b.size for b in out.batches] == [1] and out.batches[0].formed_at == clock()
        s.on_batch_done(out.batches[0], clock.advance(0.02), 0.02)
        clock.advance(0.18)


def test_window_then_dispatch_with_wake_at() -> None:
    s = make_scheduler(policy={"name": "window", "max_wait_s": 0.010, "max_batch_size": 4,
                               "wait_only_if_it_pays": False})
    clock = FakeClock()
    assert s.submit(make_request(10, 0.0), clock()) is None
    out = s.schedule(clock(), 1)
    assert out.batches == [] and out.wake_at == 0.010
    assert s.num_waiting == 1 and s.num_waiting_tokens == 10
    clock.advance(0.010)
    out = s.schedule(clock(), 1)
    assert [b.size for b in out.batches] == [1] and out.wake_at is None
    assert out.batches[0].formed_at == 0.010 and out.batches[0].predicted_s > 0


def test_full_batch_goes_at_once_and_leftovers_wait() -> None:
    s = make_scheduler(policy={"name": "window", "max_wait_s": 1.0, "max_batch_size": 3},
                       planner={"grouping": "fifo"})
    for i in range(4):
        s.submit(make_request(10, 0.0, id=i), 0.0)
    out = s.schedule(0.0, 2)
    assert [r.id for r in out.batches[0].requests] == [0, 1, 2]
    assert len(out.batches) == 1 and out.wake_at == 1.0 and s.num_waiting == 1
    s.submit(make_request(10, 0.5, id=9), 0.5)
    assert s.schedule(0.5, 0).wake_at is None  # no slot free: the driver calls again at batch end


def test_work_conserving_the_queue_grows_while_busy() -> None:
    s = make_scheduler(policy={"name": "window", "max_wait_s": 0.0, "max_batch_size": 8},
                       planner={"grouping": "fifo"})
    s.submit(make_request(10, 0.0), 0.0)
    first = s.schedule(0.0, 1).batches[0]
    for i in range(6):  # the only slot is busy: these wait, nothing is dispatched
        s.submit(make_request(10, 0.001 * i), 0.001 * i)
        assert s.schedule(0.001 * i, 0).batches == []
    s.on_batch_done(first, 0.01, 0.01)
    out = s.schedule(0.01, 1)
    assert [b.size for b in out.batches] == [6]  # the next batch takes everything waiting


def test_several_free_slots_get_several_batches() -> None:
    s = make_scheduler(policy={"name": "window", "max_wait_s": 0.0, "max_batch_size": 2})
    for _ in range(5):
        s.submit(make_request(10, 0.0), 0.0)
    out = s.schedule(0.0, 2)
    assert [b.size for b in out.batches] == [2, 2] and s.num_waiting == 1


def test_cancel() -> None:
    s = make_scheduler()
    r = make_request(10, 0.0)
    s.submit(r, 0.0)
    assert s.cancel(r.id, 0.001) and not s.cancel(r.id, 0.002)
    assert s.num_waiting == 0 and s.stats.cancelled == 1
    assert s.schedule(1.0, 1).batches == []


def test_expired_requests_are_dropped_at_their_deadline() -> None:
    s = make_scheduler(policy={"name": "window", "max_wait_s": 1.0, "max_batch_size": 8},
                       admission={"reject_infeasible": False})
    r = make_request(10, 0.0, deadline=0.05)
    other = make_request(10, 0.0)
    s.submit(r, 0.0)
    s.submit(other, 0.0)
    out = s.schedule(0.0, 0)  # no slot free: the deadline is still a wake-up
    assert out.wake_at == 0.05
    out = s.schedule(0.05, 0)
    assert [d.request for d in out.dropped] == [r]
    assert out.dropped[0].reason is RejectReason.DEADLINE_EXPIRED
    assert s.num_waiting == 1 and s.stats.rejected["deadline_expired"] == 1


def test_on_infeasible_drop_removes_what_cannot_be_saved() -> None:
    cost = simple_cost_model(const=0.010, per_token=1e-4)  # 100 tokens alone: 20 ms
    s = make_scheduler(cost, policy={"name": "sla", "on_infeasible": "drop"})
    doomed = make_request(100, 0.0, deadline=0.030)
    fine = make_request(100, 0.0, deadline=1.0)
    s.submit(doomed, 0.0)
    s.submit(fine, 0.0)
    out = s.schedule(0.015, 0)  # 15 ms left, 20 ms needed
    assert [d.request for d in out.dropped] == [doomed]
    assert out.dropped[0].reason is RejectReason.INFEASIBLE_DEADLINE
    assert s.num_waiting == 1


def test_infeasible_is_dispatched_by_default() -> None:
    cost = simple_cost_model(const=0.010, per_token=1e-4)
    s = make_scheduler(cost, policy={"name": "sla"})
    s.submit(make_request(100, 0.0, deadline=0.030), 0.0)
    out = s.schedule(0.015, 1)
    assert out.dropped == [] and [b.size for b in out.batches] == [1]


def test_sla_full_batches_do_not_skip_an_overdue_head() -> None:
    s = make_scheduler(policy={"name": "sla", "sla_s": 0.5, "max_batch_size": 2},
                       planner={"grouping": "sorted"})
    head = make_request(400, 0.0)
    s.submit(head, 0.0)
    for _ in range(4):
        s.submit(make_request(10, 0.0), 0.0)
    assert s.schedule(0.001, 1).batches[0].requests.count(head) == 0  # early: short ones pack better
    assert head in s.schedule(1.0, 1).batches[0].requests  # past its SLA: the head goes next


def test_priority_queue_serves_the_urgent_class_first() -> None:
    s = make_scheduler(policy={"name": "window", "max_wait_s": 0.0, "max_batch_size": 2},
                       planner={"grouping": "fifo"}, queue_order="priority")
    low = [make_request(10, 0.0, priority=1) for _ in range(2)]
    high = make_request(10, 0.001, priority=-1)
    for r in [*low, high]:
        s.submit(r, 0.001)
    batch = s.schedule(0.001, 1).batches[0]
    assert batch.requests[0] is high


def test_admission_rejections_reach_the_caller_and_the_stats() -> None:
    s = make_scheduler(admission={"max_length": 64, "max_queued_requests": 1})
    assert s.submit(make_request(100), 0.0).reason is RejectReason.TOO_LONG  # type: ignore[union-attr]
    assert s.submit(make_request(10), 0.0) is None
    assert s.submit(make_request(10), 0.0).reason is RejectReason.QUEUE_FULL  # type: ignore[union-attr]
    assert s.stats.submitted == 3 and s.stats.admitted == 1
    assert dict(s.stats.rejected) == {"too_long": 1, "queue_full": 1}


def test_aimd_learns_from_on_batch_done() -> None:
    s = make_scheduler(policy={"name": "aimd", "max_batch_size": 8, "aimd_min_batch": 1, "aimd_target_s": 0.1,
                               "max_wait_s": 0.0})
    for _ in range(40):
        s.submit(make_request(10, 0.0), 0.0)
    sizes = []
    for step in range(6):
        batch = s.schedule(float(step), 1).batches[0]
        sizes.append(batch.size)
        s.on_batch_done(batch, float(step), 0.05 if step < 4 else 0.5)
    assert sizes == [1, 2, 3, 4, 5, 2]  # grows by one while on target, halves after the miss


def test_padding_waste_is_accounted() -> None:
    s = make_scheduler(policy={"name": "window", "max_wait_s": 0.0, "max_batch_size": 2},
                       planner={"grouping": "fifo", "padding": "dynamic"})
    s.submit(make_request(10, 0.0), 0.0)
    s.submit(make_request(30, 0.0), 0.0)
    batch = s.schedule(0.0, 1).batches[0]
    assert (batch.useful_tokens, batch.computed_tokens, batch.wasted_tokens) == (40, 60, 20)
    assert s.stats.padding_efficiency == 40 / 60


def test_bucket_boundaries_refit_through_submit() -> None:
    s = make_scheduler(planner={"grouping": "bucket", "padding": "bucket"},
                       bucketing={"method": "quantile", "num_buckets": 2, "refit_every_requests": 20})
    assert s.bucketer is not None and s.bucketer.boundaries == (64, 128, 256, 512)
    for i in range(20):
        s.submit(make_request(10 if i % 2 else 300, 0.0), 0.0)
    assert s.bucketer.boundaries == (10, 300, 512)
    batch = s.schedule(1.0, 1).batches[0]
    assert batch.padded_len in (10, 300)


def test_a_simulated_run_serves_everyone() -> None:
    s = BatchScheduler()  # the defaults: hybrid policy, sorted look-ahead, dynamic padding
    arrivals = [make_request(16 + (i * 37) % 400, i * 0.004, id=i) for i in range(300)]
    log = drive(s, arrivals, slots=1)
    assert sorted(r.id for _, b in log.batches for r in b.requests) == list(range(300))
    assert s.stats.padding_efficiency > 0.7  # sorted look-ahead keeps padding low on mixed lengths


def test_a_wait_that_is_already_due_dispatches_instead_of_stalling() -> None:
    s = make_scheduler(policy={"name": "window", "max_wait_s": 1.0})
    s.submit(make_request(10, 0.0), 0.0)
    s.policy.decide = lambda now, state: Wait(now)  # type: ignore[method-assign]  # a policy bug
    out = s.schedule(0.5, 1)
    assert [b.size for b in out.batches] == [1] and out.wake_at is None
