"""Tenants in the core (core/tenants.py, core/bucket.py): specs, quotas through the scheduler's admission,
usage, and a reloaded table, on a fake clock."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batchpilot.core.admission import RejectReason
from batchpilot.core.bucket import TokenBucket
from batchpilot.core.scheduler import BatchScheduler
from batchpilot.core.tenants import TenantLedger, TenantSpec, TenantTable
from core_factories import drive, make_config, make_request, simple_cost_model


def scheduler(table: TenantTable, **cfg: Any) -> BatchScheduler:
    return BatchScheduler(make_config(**cfg), simple_cost_model(), table)


def test_spec_validation_and_defaults() -> None:
    assert TenantSpec(tokens_per_s=100.5).burst == 101  # one second's worth by default
    assert TenantSpec(tokens_per_s=100, burst_tokens=5000).burst == 5000
    with pytest.raises(ValueError, match="weight"):
        TenantSpec(weight=0)
    with pytest.raises(ValueError, match="unknown key"):
        TenantSpec.from_dict({"wieght": 2}, "tenants.a")
    table = TenantTable({"a": TenantSpec(weight=3)}, default=TenantSpec(weight=0.5))
    assert table.spec("a").weight == 3 and table.spec("zzz").weight == 0.5 and "a" in table


def test_token_quota_refuses_with_the_refill_time_and_charges_only_admitted_requests() -> None:
    sched = scheduler(TenantTable({"a": TenantSpec(tokens_per_s=100, burst_tokens=200)}))
    assert sched.submit(make_request(150, 0.0, tenant="a"), 0.0) is None
    rej = sched.submit(make_request(100, 0.0, tenant="a"), 0.0)
    assert rej is not None and rej.reason is RejectReason.QUOTA_TOKENS
    assert rej.retry_after_s == pytest.approx(0.5)  # 50 left, 50 more at 100/s
    assert "100 tokens/s" in rej.message
    assert sched.submit(make_request(100, 0.5, tenant="a"), 0.5) is None  # exactly refilled
    assert sched.submit(make_request(10, 0.5, tenant="b"), 0.5) is None  # other tenants: no quota
    huge = sched.submit(make_request(300, 100.0, tenant="a"), 100.0)
    assert huge is not None and huge.retry_after_s is None and "can never be admitted" in huge.message
    usage = {u.tenant: u for u in sched.tenant_usage(0.5)}
    assert usage["a"].tokens == 250 and usage["a"].requests == 2
    assert usage["a"].rejected == {"quota_tokens": 2}
    assert usage["a"].bucket_tokens == pytest.approx(200.0)  # refilled by t = 100


def test_concurrency_quota_counts_requests_until_their_last_input_leaves() -> None:
    sched = scheduler(TenantTable({"a": TenantSpec(max_concurrent_requests=2)}))
    assert sched.submit_group([make_request(10, 0.0, tenant="a") for _ in range(3)], 0.0) is None
    assert sched.submit(make_request(10, 0.0, tenant="a"), 0.0) is None
    rej = sched.submit(make_request(10, 0.0, tenant="a"), 0.0)
    assert rej is not None and rej.reason is RejectReason.QUOTA_CONCURRENCY and rej.retry_after_s
    out = sched.schedule(1.0, 1)
    assert out.batches
    sched.on_batch_done(out.batches[0], 1.1, 0.1)
    assert sched.submit(make_request(10, 1.1, tenant="a"), 1.1) is None


def test_a_multi_input_request_is_admitted_or_refused_whole() -> None:
    sched = scheduler(TenantTable({"a": TenantSpec(tokens_per_s=100, burst_tokens=100)}))
    group = [make_request(40, 0.0, tenant="a") for _ in range(3)]  # 120 tokens: over the burst
    rej = sched.submit_group(group, 0.0)
    assert rej is not None and sched.num_waiting == 0
    ok = [make_request(40, 0.0, tenant="a") for _ in range(2)]
    assert sched.submit_group(ok, 0.0) is None and sched.num_waiting == 2
    assert sched.tenants is not None and sched.tenants.state("a").bucket is not None
    assert sched.tenants.state("a").bucket.level(0.0) == pytest.approx(20.0)  # charged once, 80 tokens


def test_the_check_before_tokenising_charges_nothing() -> None:
    sched = scheduler(TenantTable({"a": TenantSpec(tokens_per_s=10, burst_tokens=10,
                                                   max_concurrent_requests=1)}))
    assert sched.check_tenant("a", 3, 0.0) is None
    assert sched.check_tenant("a", 3, 0.0) is None  # nothing was taken
    assert sched.submit(make_request(10, 0.0, tenant="a"), 0.0) is None
    rej = sched.check_tenant("a", 1, 0.0)
    assert rej is not None and rej.reason is RejectReason.QUOTA_CONCURRENCY
    assert BatchScheduler(make_config(), simple_cost_model()).check_tenant("a", 1, 0.0) is None


def test_a_reloaded_table_applies_to_tracked_tenants() -> None:
    sched = scheduler(TenantTable({"a": TenantSpec(tokens_per_s=100, burst_tokens=1000)}))
    assert sched.submit(make_request(100, 0.0, tenant="a"), 0.0) is None
    sched.set_tenants(TenantTable({"a": TenantSpec(tokens_per_s=10, burst_tokens=50, weight=2)}), 0.0)
    usage = sched.tenant_usage(0.0)[0]
    assert (usage.weight, usage.tokens_per_s, usage.bucket_tokens) == (2, 10, 50)
    assert sched.submit(make_request(60, 0.0, tenant="a"), 0.0) is not None


def test_bucket_reports_waits_and_never_lends() -> None:
    b = TokenBucket(10.0, 20.0)
    assert b.wait_s(0.0, 25) == float("inf")
    assert b.try_take(0.0, 15) == 0.0 and b.try_take(0.0, 10) == pytest.approx(0.5)
    b.reshape(100.0, 4.0, 0.0)
    assert b.level(0.0) == 4.0


def test_the_ledger_forgets_idle_unknown_tenants() -> None:
    ledger = TenantLedger(TenantTable({"known": TenantSpec()}))
    ledger.admit("known", 1, 0.0)
    ledger.leave("known")
    for i in range(5000):
        ledger.admit(f"client-{i}", 1, 0.0)
        ledger.leave(f"client-{i}")
    assert len(ledger) < 4200 and ledger.in_progress("known") == 0
    assert any(name == "known" for name, _ in ledger)


@st.composite
def quota_runs(draw: Any) -> dict[str, Any]:
    rate = draw(st.sampled_from([50.0, 200.0, 1000.0]))
    burst = draw(st.sampled_from([0, 100, 400]))
    n = draw(st.integers(1, 60))
    t, arrivals = 0.0, []
    for _ in range(n):
        t += draw(st.sampled_from([0.0, 0.001, 0.01, 0.1]))
        inputs = draw(st.integers(1, 3))
        arrivals.append((t, [draw(st.integers(1, 120)) for _ in range(inputs)],
                         draw(st.sampled_from(["a", "b"]))))
    return {"spec": TenantSpec(tokens_per_s=rate, burst_tokens=burst,
                               max_concurrent_requests=draw(st.sampled_from([0, 2, 5]))),
            "arrivals": arrivals, "order": draw(st.sampled_from(["fcfs", "fair"]))}


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(run=quota_runs())
def test_quotas_hold_over_any_window(run: dict[str, Any]) -> None:
    """Admitted tokens in any window [t0, t1] never exceed burst + rate * (t1 - t0); requests in
    progress never exceed the concurrency quota; a request is admitted with all its inputs or none."""
    spec: TenantSpec = run["spec"]
    sched = scheduler(TenantTable({"a": spec, "b": spec}), queue_order=run["order"],
                      policy={"max_batch_size": 4})
    admitted: dict[str, list[tuple[float, int]]] = {"a": [], "b": []}
    events: list[Any] = []
    for i, (t, lengths, tenant) in enumerate(run["arrivals"]):
        # finish what the fake executor would have finished by now (one batch per call, its own time)
        while events and events[0][0] <= t:
            done_at, batch = events.pop(0)
            sched.on_batch_done(batch, done_at, batch.predicted_s)
        group = [make_request(n, t, id=i * 10 + j, tenant=tenant) for j, n in enumerate(lengths)]
        rej = sched.submit_group(group, t)
        if rej is None:
            admitted[tenant].append((t, sum(lengths)))
            assert sched.tenants is not None
            if spec.max_concurrent_requests:
                assert sched.tenants.in_progress(tenant) <= spec.max_concurrent_requests
        else:
            assert all(r.id not in sched.queue for r in group)
        free = 1 - len(events)
        for b in sched.schedule(t, max(free, 0)).batches:
            events.append((t + b.predicted_s, b))
    for series in admitted.values():
        for i, (t0, _) in enumerate(series):
            total = 0
            for t1, tokens in series[i:]:
                total += tokens
                assert total <= spec.burst + spec.tokens_per_s * (t1 - t0) + 1e-6


def test_drive_with_tenants_keeps_usage_consistent() -> None:
    sched = scheduler(TenantTable({}), queue_order="fair")
    arrivals = [make_request(20, i * 0.001, tenant="ab"[i % 2]) for i in range(50)]
    log = drive(sched, arrivals)
    assert len(log.admitted) == 50
    usage = {u.tenant: u for u in sched.tenant_usage(10.0)}
    assert usage["a"].requests == usage["b"].requests == 25
    assert usage["a"].in_progress == usage["b"].in_progress == 0
    for u in usage.values():  # 500 tokens each, and at most one request's lift
        assert u.counter is not None and 500.0 <= u.counter <= 520.0
