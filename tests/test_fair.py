"""The fair queue order (core/fair.py): the virtual token counters, the lift, the order it gives, and its
properties through the whole scheduler on a fake clock (hypothesis)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batchpilot.core.config import SchedulerConfig
from batchpilot.core.fair import ACTIVE_S, FairQueue, make_queue
from batchpilot.core.queue import RequestQueue
from batchpilot.core.scheduler import BatchScheduler
from batchpilot.core.tenants import TenantSpec, TenantTable
from core_factories import drive, make_config, make_request, simple_cost_model
from test_core_properties import scenarios


def ids(reqs: list) -> list[int]:  # type: ignore[type-arg]
    return [r.id for r in reqs]


def test_the_tenant_with_the_least_counter_goes_first() -> None:
    q = FairQueue()
    a = [make_request(10, 0.0 + i * 0.01, tenant="a") for i in range(3)]
    b = [make_request(10, 0.5, tenant="b")]
    for r in a + b:
        q.push(r)
    # both lifted to 0: the earlier head first, then alternate by the counters (10 tokens each)
    assert ids(q.peek(4)) == [a[0].id, b[0].id, a[1].id, a[2].id]
    q.take([a[0], a[1]])  # a received 20 tokens
    assert q.counters == {"a": 20.0, "b": 0.0}
    assert ids(q.peek(2)) == [b[0].id, a[2].id]
    assert q.head() is b[0] and q.oldest() is a[2]


def test_weights_divide_the_charge() -> None:
    q = FairQueue(weight_of={"a": 1.0, "b": 4.0}.__getitem__)
    reqs = [make_request(8, 0.0, tenant=t) for t in "aaaabbbbbbbb"]
    for r in reqs:
        q.push(r)
    order = [r.tenant for r in q.peek(12)]
    # b's weight 4: each of its requests costs 2 on its counter, a's 8 (ties: the name)
    assert order[:10] == list("abbbbabbbb")
    q.take(q.peek(12))
    assert q.counters == {"a": 32.0, "b": 16.0}


def test_a_tenant_back_from_idle_is_lifted_to_the_least_backlogged_counter() -> None:
    q = FairQueue()
    heavy = [make_request(100, 0.0, tenant="heavy") for _ in range(5)]
    for r in heavy:
        q.push(r)
    q.take(heavy[:3])  # heavy has received 300 tokens; "light" was idle all along
    late = make_request(100, 1.0, tenant="light")
    q.push(late)
    assert q.counters["light"] == 300.0  # not 0: it cannot claim the service it did not ask for
    assert ids(q.peek(3)) == [heavy[3].id, late.id, heavy[4].id]  # they alternate from here
    q.take(q.peek(3))
    assert not q
    assert q.lift() == 500.0  # nobody backlogged: the counter the last one left with
    q.push(make_request(1, 2.0, tenant="new"))
    assert q.counters["new"] == 500.0


def test_a_returning_tenant_bursts_ahead_then_repays() -> None:
    q = FairQueue(burst_tokens=300)
    heavy = [make_request(100, 0.0, tenant="heavy") for _ in range(20)]
    for r in heavy:
        q.push(r)
    q.take(heavy[:10])  # heavy: 1000 (it had a burst of its own when it came: 300, long used up)
    light = [make_request(100, 1.0, tenant="light") for _ in range(5)]
    for r in light:
        q.push(r)
    assert q.counters["light"] == 1000.0  # lifted as VTC lifts...
    # ...and served ahead for its burst (300 tokens); then heavy catches up, then they take turns
    assert [r.tenant for r in q.peek(9)] == ["light"] * 3 + ["heavy"] * 4 + ["light", "heavy"]
    q.take(light)  # it took all five: 200 beyond its burst
    assert q.counters["light"] == 1500.0
    q.push(back := make_request(100, 2.0, tenant="light"))  # back at once: it owes, no new burst
    assert "light" not in q.vtc.burst_until and q.counters["light"] == 1500.0
    assert ids(q.peek(2)) == [heavy[10].id, heavy[11].id]
    q.remove(back.id)
    q.take(heavy[10:19])  # heavy catches up (1900): light's debt is repaid, its next return bursts again
    q.push(make_request(100, 3.0, tenant="light"))
    assert q.vtc.burst_until["light"] == 1900.0 + 300.0 and q.head().tenant == "light"


def test_contended_means_another_tenant_is_active() -> None:
    q = FairQueue()
    q.push(make_request(10, 0.0, tenant="flood"))
    assert not q.contended(0.1)  # alone
    q.push(make_request(10, 1.0, tenant="light"))
    q.take([r for r in q.peek(2) if r.tenant == "light"])
    assert q.contended(1.1)  # light has no work waiting but sent a request a moment ago
    assert not q.contended(1.0 + ACTIVE_S + 0.01)  # ... and then nothing for ACTIVE_S


def test_a_contended_batch_is_trimmed_to_the_quantum_and_a_burst_goes_without_fill() -> None:
    cost = simple_cost_model(const=0.004, per_token=1e-4)  # 100 tokens: 14 ms
    cfg = make_config(policy={"max_batch_size": 16}, planner={"padding": "none"}, queue_order="fair",
                      fair_quantum_s=0.05, fair_burst_tokens=1000)
    sched = BatchScheduler(cfg, cost)
    for _ in range(48):
        sched.submit(make_request(100, 0.0, tenant="flood"), 0.0)
    alone = sched.schedule(0.0, 1).batches[0]
    assert len(alone.requests) == 16  # a lone tenant's batch is never trimmed (and its burst is over)
    light = make_request(100, 0.01, tenant="light")
    sched.submit(light, 0.01)
    burst = sched.schedule(0.2, 1).batches[0]
    assert [r.id for r in burst.requests] == [light.id]  # in its burst: no flood fill to wait behind
    flood = sched.schedule(0.3, 1).batches[0]  # light sent a request a moment ago: contended
    assert {r.tenant for r in flood.requests} == {"flood"} and len(flood.requests) == 4  # 0.004 + 4 x 0.01
    assert flood.predicted_s <= 0.05
    big = make_request(500, 0.3, tenant="light")  # one input over the quantum still goes, alone
    assert sched.submit(big, 0.3) is None
    assert [r.id for r in sched.schedule(0.4, 1).batches[0].requests] == [big.id]


def test_aggregates_and_expiry_cover_every_tenant() -> None:
    q = FairQueue("edf")
    r1 = make_request(30, 0.0, tenant="a", deadline=5.0)
    r2 = make_request(50, 0.1, tenant="b", deadline=1.0)
    r3 = make_request(20, 0.2, tenant="a", deadline=0.5)
    for r in (r1, r2, r3):
        q.push(r)
    count, tokens, oldest, deadline, longest = q.aggregates()
    assert (count, tokens, oldest, deadline, longest) == (3, 100, 0.0, 0.5, 50)
    # tied counters: the earlier head (b's); within a, the earliest deadline
    assert ids(q.peek(3)) == [r2.id, r3.id, r1.id]
    assert q.expire(0.9) == [r3]
    assert ids(q.peek(3)) == [r1.id, r2.id] or ids(q.peek(3)) == [r2.id, r1.id]
    assert q.remove(r2.id) is r2 and q.backlogged == ["a"]
    assert q.counters["b"] == 0.0  # cancelled and expired work is never charged


def test_work_ahead_counts_only_what_fair_order_serves_first() -> None:
    work = [0.001] * 513  # one millisecond per input
    q = FairQueue(work_s=work)
    for _ in range(100):
        q.push(make_request(10, 0.0, tenant="flood"))
    # a newcomer is lifted to flood's counter: behind it, only as much flood work as its own tokens
    assert q.work_ahead_s("light", 10) == pytest.approx(0.001)
    assert q.work_ahead_s("flood", 10) == pytest.approx(0.1)  # the flood waits behind its own queue
    assert q.num_work_s == pytest.approx(0.1)


def test_make_queue_picks_the_order() -> None:
    assert isinstance(make_queue("fair", "priority"), FairQueue)
    assert type(make_queue("edf")) is RequestQueue
    with pytest.raises(ValueError, match="choose one of"):
        RequestQueue("fair")  # type: ignore[arg-type]


# -- properties through the scheduler ---------------------------------------------------------------

TENANTS = ("a", "b", "c")


def _with_tenants(sc: dict[str, Any], draw_tenants: list[str]) -> dict[str, Any]:
    for r, t in zip(sc["arrivals"], draw_tenants, strict=False):
        r.tenant = t
    return sc


def _batches(cfg: dict[str, Any], arrivals: list[Any], slots: int, table: TenantTable | None = None
             ) -> list[tuple[float, list[int], int]]:
    sched = BatchScheduler(make_config(**cfg), simple_cost_model(const=0.004, per_token=2e-5), table)
    log = drive(sched, arrivals, slots=slots)
    return [(t, [r.id for r in b.requests], b.padded_len) for t, b in log.batches]


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sc=scenarios(), inner=st.sampled_from(["fcfs", "priority", "edf"]))
def test_a_lone_tenant_is_served_exactly_as_its_own_order(sc: dict[str, Any], inner: str) -> None:
    """Work-conserving and never slower alone: with one tenant, ``fair`` forms the same batches at the
    same times as the plain queue of its ``tenant_order``."""
    for r in sc["arrivals"]:
        r.tenant = "default"
    plain = {**sc["cfg"], "queue_order": inner}
    fair = {**sc["cfg"], "queue_order": "fair", "tenant_order": inner, "fair_quantum_s": 0.005}
    assert _batches(fair, sc["arrivals"], sc["slots"]) == _batches(plain, sc["arrivals"], sc["slots"])


@st.composite
def tenant_scenarios(draw: Any) -> dict[str, Any]:
    sc = draw(scenarios())
    sc["cfg"]["queue_order"] = "fair"
    sc["cfg"]["tenant_order"] = draw(st.sampled_from(["fcfs", "priority", "edf"]))
    tenants = draw(st.lists(st.sampled_from(TENANTS), min_size=len(sc["arrivals"]),
                            max_size=len(sc["arrivals"])))
    weights = draw(st.lists(st.sampled_from([1.0, 2.0, 4.0]), min_size=3, max_size=3))
    sc["table"] = TenantTable({t: TenantSpec(weight=w) for t, w in zip(TENANTS, weights, strict=True)})
    return _with_tenants(sc, tenants)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sc=tenant_scenarios())
def test_no_tenant_with_waiting_work_starves(sc: dict[str, Any]) -> None:
    """Every admitted request is dispatched or dropped once (none is left behind), and with batches
    taken in queue order the counters of the backlogged tenants never drift apart by more than one
    request's charge and a burst: whoever waits is next once it has the least counter."""
    sc["cfg"]["admission"].update(rate=0.0, max_queued_requests=0)
    sc["cfg"]["planner"]["grouping"] = "fifo"
    sched = BatchScheduler(make_config(**sc["cfg"]), simple_cost_model(const=0.002, per_token=1e-5),
                           sc["table"])
    q = sched.queue
    assert isinstance(q, FairQueue)
    spreads: list[float] = []
    original_take = q.take

    def take(reqs: Any) -> None:
        original_take(reqs)
        vtc = q.vtc  # the view /v1/tenants reads is each tenant's counter, the lift taken once
        assert vtc.all_counters() == {t: vtc.counter(t) for t in vtc.counters}
        backlogged = q.backlogged
        if len(backlogged) > 1:
            counters = [q.counters[t] for t in backlogged]
            spreads.append(max(counters) - min(counters))

    q.take = take  # type: ignore[method-assign]
    log = drive(sched, sc["arrivals"], slots=sc["slots"])
    dispatched = [r.id for _, b in log.batches for r in b.requests]
    dropped = [d.request.id for d in log.dropped]
    assert sorted(dispatched + dropped) == sorted(r.id for r in log.admitted)
    assert sched.num_waiting == 0
    max_len = sc["cfg"]["planner"]["max_len"]
    lightest = min(spec.weight for spec in sc["table"].specs.values())
    burst = sc["cfg"].get("fair_burst_tokens", SchedulerConfig().fair_burst_tokens)
    assert all(s <= (max_len + burst) / lightest + 1e-9 for s in spreads), max(spreads)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sc=tenant_scenarios())
def test_fair_runs_are_deterministic(sc: dict[str, Any]) -> None:
    runs = [_batches(sc["cfg"], sc["arrivals"], sc["slots"], sc["table"]) for _ in range(2)]
    assert runs[0] == runs[1]


def test_a_flood_does_not_lock_the_others_out_of_the_concurrency_limit() -> None:
    sched = BatchScheduler(make_config(admission={"max_concurrent_requests": 8}, queue_order="fair"),
                           simple_cost_model())
    for i in range(8):
        assert sched.submit(make_request(10, 0.0, tenant="flood", id=1000 + i), 0.0) is None
    rej = sched.submit(make_request(10, 0.0, tenant="flood", id=2000), 0.0)
    assert rej is not None and rej.reason.value == "queue_full" and "its weighted share" in rej.message
    for i in range(3):  # light's share of 8 with flood busy is 4: admitted over the limit
        assert sched.submit(make_request(10, 0.0, tenant="light", id=3000 + i), 0.0) is None
    assert sched.num_requests == 11
    # fcfs keeps the plain limit
    plain = BatchScheduler(make_config(admission={"max_concurrent_requests": 8}), simple_cost_model())
    for i in range(8):
        plain.submit(make_request(10, 0.0, tenant="flood", id=4000 + i), 0.0)
    assert plain.submit(make_request(10, 0.0, tenant="light"), 0.0) is not None


def test_a_declared_sla_prices_only_the_work_ahead_in_fair_order() -> None:
    """A flood's backlog sheds the flood, not the tenant that fair order serves before it."""
    cost = simple_cost_model(const=0.01, per_token=1e-4)
    cfg = make_config(admission={"latency_sla_s": 0.5}, policy={"max_batch_size": 8}, queue_order="fair")
    sched = BatchScheduler(cfg, cost)
    admitted = sum(sched.submit(make_request(100, 0.0, tenant="flood"), 0.0) is None for _ in range(400))
    assert admitted < 400  # the flood is shed at its own backlog
    assert sched.submit(make_request(100, 0.0, tenant="light"), 0.0) is None
    fifo = BatchScheduler(make_config(admission={"latency_sla_s": 0.5}, policy={"max_batch_size": 8}), cost)
    for _ in range(400):
        fifo.submit(make_request(100, 0.0, tenant="flood"), 0.0)
    assert fifo.submit(make_request(100, 0.0, tenant="light"), 0.0) is not None
