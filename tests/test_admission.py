"""Admission: each rejection reason, its message and retry hint, and the token bucket."""

from __future__ import annotations

import pytest

from batchpilot.core.admission import AdmissionController, RejectReason, TokenBucket
from batchpilot.core.config import AdmissionConfig, PlannerConfig
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


def test_every_reason_has_a_stable_value() -> None:
    expected = {"queue_full", "rate_limited", "infeasible_deadline", "too_long", "deadline_expired"}
    assert {r.value for r in RejectReason} >= expected
