"""Properties of the whole scheduling core over random arrival sequences (hypothesis).

Random configs (policy, grouping, padding, queue order, budgets, slots) and random arrivals (gaps,
lengths, priorities, deadlines, tenants) are driven through ``BatchScheduler`` by the fake event-driven
executor in ``core_factories.drive``. Checked:

* no request lost or duplicated: each admitted request is dispatched once or dropped once;
* budgets never exceeded: batch size, token budget, memory budget, padded length >= every length;
* FIFO within a priority level (fifo grouping, fcfs/priority queues);
* no starvation: whenever a slot is left free, nothing waiting has waited past the policy's bound,
  and once the oldest has waited its bound the next batch contains the head of the queue;
* rejections only with a valid reason and a message;
* determinism: the same inputs give the same batches.
"""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batchpilot.core.admission import RejectReason
from core_factories import drive, make_request, make_scheduler, simple_cost_model

SUBMIT_REASONS = {RejectReason.TOO_LONG, RejectReason.INFEASIBLE_DEADLINE, RejectReason.QUEUE_FULL,
                  RejectReason.RATE_LIMITED}
DROP_REASONS = {RejectReason.DEADLINE_EXPIRED, RejectReason.INFEASIBLE_DEADLINE}
EPS = 1e-9


@st.composite
def scenarios(draw: Any) -> dict[str, Any]:
    policy = draw(st.sampled_from(["static", "window", "backlog", "hybrid", "adaptive", "sla", "aimd"]))
    grouping = draw(st.sampled_from(["fifo", "bucket", "sorted", "dp"]))
    padding = draw(st.sampled_from(["max", "dynamic", "bucket", "none"]))
    cap = draw(st.integers(1, 8))
    max_len = draw(st.sampled_from([64, 128]))
    cfg: dict[str, Any] = {
        "policy": {
            "name": policy, "max_batch_size": cap, "max_wait_s": draw(st.sampled_from([0.0, 0.005, 0.02])),
            "backlog_requests": draw(st.integers(1, 6)), "patience_s": draw(st.sampled_from([0.0, 0.01])),
            "sla_s": draw(st.sampled_from([0.05, 0.2])), "aimd_target_s": 0.03,
            "on_infeasible": draw(st.sampled_from(["dispatch", "drop"])),
        },
        "planner": {
            "grouping": grouping, "padding": padding, "max_len": max_len,
            "max_batch_tokens": draw(st.sampled_from([0, 128, 300])),
            "max_batch_memory_bytes": draw(st.sampled_from([0.0, 100_000.0, 400_000.0])),
            "pad_to_multiple_of": draw(st.sampled_from([1, 8])), "lookahead": draw(st.integers(1, 3)),
        },
        "bucketing": {"method": draw(st.sampled_from(["fixed", "quantile", "kmeans", "dp"])),
                      "boundaries": (16, 32, 64), "num_buckets": 3, "refit_every_requests": 7,
                      "refit_every_s": 0.05},
        "admission": {"max_length": max_len, "max_queued_requests": draw(st.sampled_from([0, 12])),
                      "rate": draw(st.sampled_from([0.0, 300.0])), "burst": 5},
        "queue_order": draw(st.sampled_from(["fcfs", "priority", "edf", "fair"])),
    }
    n = draw(st.integers(1, 40))
    gaps = draw(st.lists(st.sampled_from([0.0, 0.0005, 0.002, 0.01, 0.05]), min_size=n, max_size=n))
    arrivals = []
    t = 0.0
    for i, gap in enumerate(gaps):
        t += gap
        length = draw(st.integers(1, max_len + 10))
        priority = draw(st.integers(0, 2))
        sla = draw(st.sampled_from([None, None, 0.02, 0.1, 1.0]))
        tenant = draw(st.sampled_from(["default", "x", "y"]))
        arrivals.append(make_request(length, t, id=i, priority=priority, sla=sla, tenant=tenant))
    return {"cfg": cfg, "arrivals": arrivals, "slots": draw(st.integers(1, 3))}


def _bound(sched: Any) -> float:
    return float(sched.policy.wait_bound_s)


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sc=scenarios())
def test_no_loss_no_duplicates_budgets_and_reasons(sc: dict[str, Any]) -> None:
    cost = simple_cost_model(const=0.004, per_token=2e-5, residuals=(-0.05, 0.0, 0.2))
    sched = make_scheduler(cost, **sc["cfg"])
    log = drive(sched, sc["arrivals"], slots=sc["slots"])
    plan = sched.config.planner
    cap = sched.config.policy.max_batch_size

    dispatched = [r.id for _, b in log.batches for r in b.requests]
    dropped = [d.request.id for d in log.dropped]
    assert len(dispatched) == len(set(dispatched)), "a request was dispatched twice"
    assert not set(dispatched) & set(dropped), "a request was dispatched and dropped"
    assert sorted(dispatched + dropped) == sorted(r.id for r in log.admitted), "a request was lost"
    assert sched.num_waiting == 0 and sched.num_waiting_tokens == 0
    assert {r.request.id for r in log.rejected}.isdisjoint(r.id for r in log.admitted)

    for _, b in log.batches:
        lengths = [r.length for r in b.requests]
        assert 1 <= b.size <= cap
        assert b.padded_len >= max(lengths)
        assert b.shape.useful_tokens == sum(lengths)
        assert b.wasted_tokens >= 0
        if plan.padding == "none":
            assert b.shape.tokens == sum(lengths)
        else:
            assert b.shape.tokens == b.size * b.padded_len
            assert b.padded_len % plan.pad_to_multiple_of == 0 or b.padded_len == plan.max_len
        if plan.max_batch_tokens:
            assert b.shape.tokens <= plan.max_batch_tokens
        if plan.max_batch_memory_bytes:
            assert sched.cost_model.memory(b.shape) <= plan.max_batch_memory_bytes + 1e-6

    for rej in log.rejected:
        assert rej.reason in SUBMIT_REASONS and rej.message
        if rej.reason in (RejectReason.RATE_LIMITED, RejectReason.QUEUE_FULL):
            assert rej.retry_after_s is not None and rej.retry_after_s > 0
    for d in log.dropped:
        assert d.reason in DROP_REASONS and d.message
        assert d.request.deadline is not None


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sc=scenarios())
def test_no_starvation_while_a_slot_is_free(sc: dict[str, Any]) -> None:
    """With a slot left free after a decision, nobody waiting has outstayed the policy's bound."""
    sc["cfg"]["admission"].update(rate=0.0, max_queued_requests=0)
    sched = make_scheduler(simple_cost_model(const=0.002, per_token=1e-5), **sc["cfg"])
    log = drive(sched, sc["arrivals"], slots=sc["slots"], check_leftovers=True)
    bound = _bound(sched)
    for now, _, waiting in log.leftover_checks:
        for r in waiting:
            assert now - r.arrival < bound + EPS, (sched.config.policy.name, now, r)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sc=scenarios())
def test_an_overdue_head_is_in_the_next_batch(sc: dict[str, Any]) -> None:
    """Look-ahead never starves: once the oldest request has waited its bound, the next batch
    formed (whenever a slot frees) contains the head of the queue."""
    sc["cfg"]["admission"].update(rate=0.0, max_queued_requests=0)
    sched = make_scheduler(simple_cost_model(const=0.002, per_token=1e-5), **sc["cfg"])
    log = drive(sched, sc["arrivals"], slots=1)
    bound = _bound(sched)
    for now, head, oldest_arrival, batch in log.head_checks:
        if now - oldest_arrival >= bound:
            assert head in batch.requests, (sched.config.policy.name, sched.config.planner.grouping)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sc=scenarios(), order=st.sampled_from(["fcfs", "priority"]))
def test_fifo_within_a_priority_level(sc: dict[str, Any], order: str) -> None:
    sc["cfg"]["planner"]["grouping"] = "fifo"
    sc["cfg"]["queue_order"] = order
    sched = make_scheduler(simple_cost_model(), **sc["cfg"])
    log = drive(sched, sc["arrivals"], slots=sc["slots"])
    seen: dict[int, tuple[float, int]] = {}
    for _, b in log.batches:
        for r in b.requests:
            key = (r.arrival, r.id)
            level = r.priority if order == "priority" else 0
            assert seen.get(level, (-1.0, -1)) < key, "served out of arrival order within a level"
            seen[level] = key


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sc=scenarios())
def test_same_inputs_same_batches(sc: dict[str, Any]) -> None:
    runs = []
    for _ in range(2):
        sched = make_scheduler(simple_cost_model(), **sc["cfg"])
        log = drive(sched, sc["arrivals"], slots=sc["slots"])
        runs.append([(t, b.id, [r.id for r in b.requests], b.padded_len) for t, b in log.batches])
    assert runs[0] == runs[1]
