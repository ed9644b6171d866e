"""Each dispatch policy's defining behaviour, on hand-built queue states and a fake clock."""

from __future__ import annotations

import math

import pytest

from batchpilot.core.config import PlannerConfig, PolicyConfig
from batchpilot.core.policy import (
    AdaptivePolicy,
    AimdPolicy,
    BacklogPolicy,
    Dispatch,
    HybridPolicy,
    Policy,
    QueueState,
    SlaPolicy,
    StaticPolicy,
    Wait,
    WindowPolicy,
    make_policy,
)
from core_factories import simple_cost_model

COST = simple_cost_model(const=0.010, per_token=1e-5)  # batch of n x 100 tokens: 10 ms + n ms


def policy(name: str, **kw: object) -> Policy:
    """The policy's own window (``wait_only_if_it_pays`` off unless a test turns it on)."""
    kw.setdefault("wait_only_if_it_pays", False)
    return make_policy(PolicyConfig(name=name, **kw), COST, PlannerConfig(padding="dynamic"))  # type: ignore[arg-type]


def state(n: int, oldest: float = 0.0, length: int = 100, deadline: float = math.inf) -> QueueState:
    return QueueState(n, n * length, oldest, deadline, length if n else 0)


def feed(p: Policy, times: list[float]) -> None:
    for t in times:
        p.on_arrival(t)


def test_factory_builds_every_policy() -> None:
    kinds = {"static": StaticPolicy, "window": WindowPolicy, "backlog": BacklogPolicy, "hybrid": HybridPolicy,
             "adaptive": AdaptivePolicy, "sla": SlaPolicy, "aimd": AimdPolicy}
    for name, cls in kinds.items():
        assert type(policy(name)) is cls


def test_window_fires_at_oldest_plus_max_wait() -> None:
    p = policy("window", max_wait_s=0.010, max_batch_size=8)
    assert p.decide(0.003, state(3, oldest=0.001)) == Wait(0.011)
    d = p.decide(0.011, state(3, oldest=0.001))
    assert isinstance(d, Dispatch) and d.urgent and d.max_size == 8


def test_window_fires_early_when_full() -> None:
    p = policy("window", max_wait_s=0.010, max_batch_size=4)
    d = p.decide(0.002, state(4))
    assert isinstance(d, Dispatch) and not d.urgent


def test_full_counts_the_token_budget_too() -> None:
    p = make_policy(PolicyConfig(name="window", max_batch_size=32, wait_only_if_it_pays=False), COST,
                    PlannerConfig(max_batch_tokens=500))
    assert isinstance(p.decide(0.0, state(5, length=100)), Dispatch)
    assert isinstance(p.decide(0.0, state(4, length=100)), Wait)


def test_static_waits_for_a_full_batch_with_max_wait_as_safety_net() -> None:
    p = policy("static", max_batch_size=8, max_wait_s=0.5)
    assert p.decide(0.2, state(7)) == Wait(0.5)  # a partial batch does not go early
    assert isinstance(p.decide(0.2, state(8)), Dispatch)
    assert isinstance(p.decide(0.5, state(1)), Dispatch)  # nothing starves


def test_backlog_fires_before_the_window() -> None:
    p = policy("backlog", max_wait_s=0.010, backlog_requests=3, max_batch_size=32)
    assert isinstance(p.decide(0.001, state(2)), Wait)
    d = p.decide(0.001, state(3))
    assert isinstance(d, Dispatch) and d.reason == "backlog" and not d.urgent
    tok = policy("backlog", backlog_requests=99, backlog_tokens=250)
    assert isinstance(tok.decide(0.0, state(3, length=100)), Dispatch)
    assert isinstance(tok.decide(0.0, state(2, length=100)), Wait)


def test_hybrid_is_patient_when_arrivals_are_imminent() -> None:
    fast = policy("hybrid", max_wait_s=0.010, patience_s=0.010, backlog_requests=8, sla_s=1.0)
    feed(fast, [0.0, 0.002, 0.004, 0.006, 0.008])  # one every 2 ms
    assert fast.decide(0.010, state(2)) == Wait(0.020)  # past the window, but more are due soon
    assert isinstance(fast.decide(0.020, state(2)), Dispatch)  # patience is bounded

    slow = policy("hybrid", max_wait_s=0.010, patience_s=0.010, backlog_requests=8, sla_s=1.0)
    feed(slow, [0.0, 0.5, 1.0])  # one every 500 ms: nobody is coming in the next 10 ms
    assert isinstance(slow.decide(1.010, state(2, oldest=1.0)), Dispatch)


def test_hybrid_patience_yields_to_the_deadline() -> None:
    p = policy("hybrid", max_wait_s=0.010, patience_s=0.010, backlog_requests=8, sla_s=1.0)
    feed(p, [0.0, 0.002, 0.004, 0.006, 0.008])
    # waiting until 20 ms then running a 13 ms batch would miss a deadline at 25 ms
    assert isinstance(p.decide(0.010, state(2, deadline=0.025)), Dispatch)


def test_adaptive_narrows_the_window_when_arrivals_speed_up() -> None:
    p = policy("adaptive", max_wait_s=0.020, min_wait_s=0.001, max_batch_size=8, ewma_alpha=0.5)
    feed(p, [0.0, 0.1, 0.2])  # 100 ms apart: a full batch is 800 ms away, wait the max
    assert p.window_s() == pytest.approx(0.020)
    assert p.decide(0.205, state(1, oldest=0.2)) == Wait(pytest.approx(0.220))
    feed(p, [0.2 + 0.001 * i for i in range(1, 30)])  # now 1 ms apart: 8 arrive in ~8 ms
    assert p.window_s() < 0.010
    assert p.window_s() >= 0.001
    assert isinstance(p.decide(0.240, state(1, oldest=0.229)), Dispatch)
    feed(p, [0.2291 + 0.00001 * i for i in range(1, 60)])  # faster still: clamped at min_wait_s
    assert p.window_s() == pytest.approx(0.001)


def test_sla_waits_while_it_pays_and_is_safe() -> None:
    p = policy("sla", sla_s=1.0, max_batch_size=32)
    feed(p, [0.0, 0.001, 0.002, 0.003])  # 1 ms apart: one more request costs 1 ms, saves 10 ms
    d = p.decide(0.0035, state(4, oldest=0.0))
    assert isinstance(d, Wait) and d.until is not None and d.until > 0.0035


def test_sla_dispatches_early_when_the_urgent_request_would_miss() -> None:
    p = policy("sla", sla_s=1.0, max_batch_size=32)
    feed(p, [0.0, 0.001, 0.002, 0.003])
    # same state, but one request must finish by 18 ms: a 5-request batch takes 15 ms
    d = p.decide(0.0035, state(4, oldest=0.0, deadline=0.018))
    assert isinstance(d, Dispatch) and d.urgent and d.reason == "deadline"


def test_sla_uses_the_high_quantile_not_the_mean() -> None:
    noisy = simple_cost_model(const=0.010, per_token=1e-5, residuals=(0.0, 0.5))  # p99 ~ 1.5 x mean
    cfg = PolicyConfig(name="sla", sla_s=1.0)
    dyn = PlannerConfig(padding="dynamic")
    mean_only = make_policy(cfg, simple_cost_model(const=0.010, per_token=1e-5), dyn)
    pessimist = make_policy(cfg, noisy, PlannerConfig(padding="dynamic"))
    for p in (mean_only, pessimist):
        feed(p, [0.0, 0.001, 0.002, 0.003])
    s = state(4, oldest=0.0, deadline=0.0035 + 0.020)  # mean batch ~15 ms fits, its p99 ~22 ms does not
    assert isinstance(mean_only.decide(0.0035, s), Wait)
    assert isinstance(pessimist.decide(0.0035, s), Dispatch)


def test_sla_does_not_wait_when_waiting_does_not_raise_throughput() -> None:
    p = policy("sla", sla_s=1.0)
    feed(p, [0.0, 0.3, 0.6])  # 300 ms between arrivals: idling that long never pays for 10 ms saved
    d = p.decide(0.6001, state(2, oldest=0.3))
    assert isinstance(d, Dispatch) and d.reason == "throughput"
    fresh = policy("sla", sla_s=1.0)  # no rate estimate yet: nothing is known to be coming
    assert isinstance(fresh.decide(0.0, state(1)), Dispatch)


def test_sla_stops_waiting_when_the_quiet_outlasts_the_gain() -> None:
    p = policy("sla", sla_s=1.0)
    feed(p, [0.0, 0.001, 0.002, 0.003])
    d = p.decide(0.0031, state(4, oldest=0.0))
    assert isinstance(d, Wait) and d.until is not None
    assert isinstance(p.decide(d.until, state(4, oldest=0.0)), Dispatch)


def test_aimd_adds_under_target_and_backs_off_after_a_miss() -> None:
    p = policy("aimd", max_batch_size=16, aimd_target_s=0.1, aimd_add=2, aimd_mult=0.5, aimd_min_batch=2)
    assert isinstance(p, AimdPolicy) and p.batch_cap == 2
    for _ in range(5):
        p.on_batch_done(p.batch_cap, 0.0, 0.05)
    assert p.batch_cap == 12
    p.on_batch_done(3, 0.0, 0.05)  # a partial batch says nothing about the cap
    assert p.batch_cap == 12
    p.on_batch_done(12, 0.0, 0.2)  # a miss: halve
    assert p.batch_cap == 6
    for _ in range(10):
        p.on_batch_done(p.batch_cap, 0.0, 0.5)
    assert p.batch_cap == 2  # never below aimd_min_batch
    for _ in range(20):
        p.on_batch_done(p.batch_cap, 0.0, 0.01)
    assert p.batch_cap == 16  # never above max_batch_size
    d = p.decide(0.0, state(16))
    assert isinstance(d, Dispatch) and d.max_size == 16


def test_wait_bounds() -> None:
    assert policy("window", max_wait_s=0.01).wait_bound_s == 0.01
    assert policy("hybrid", max_wait_s=0.01, patience_s=0.02).wait_bound_s == pytest.approx(0.03)
    assert policy("sla", sla_s=0.5).wait_bound_s == 0.5


# -- windows open only when waiting pays ------------------------------------------------------------
# COST: a batch of n x 100 tokens takes 10 ms + n ms, so with one waiting the break-even gap is
# 2 x 11 ms - 12 ms = 10 ms: waiting for a second request raises throughput only if it comes sooner.

@pytest.mark.parametrize("name", ["window", "backlog", "hybrid", "adaptive"])
def test_a_lone_request_at_light_load_goes_at_once(name: str) -> None:
    p = policy(name, max_wait_s=0.050, wait_only_if_it_pays=True, min_wait_s=0.0)
    feed(p, [0.0, 0.5, 1.0])  # one request every 500 ms, far above the 10 ms break-even gap
    assert p.break_even_gap(1, state(1)) == pytest.approx(0.010)
    d = p.decide(1.0, state(1, oldest=1.0))
    assert isinstance(d, Dispatch) and d.reason == "waiting does not pay" and not d.urgent


@pytest.mark.parametrize("name", ["window", "backlog", "hybrid", "adaptive"])
def test_the_window_opens_when_the_next_request_is_due_sooner_than_break_even(name: str) -> None:
    p = policy(name, max_wait_s=0.050, wait_only_if_it_pays=True, min_wait_s=0.0)
    feed(p, [i * 0.002 for i in range(20)])  # every 2 ms: a second request is worth waiting for
    assert isinstance(p.decide(0.038, state(1, oldest=0.038)), Wait)


def test_a_long_quiet_spell_closes_the_window_even_if_the_ewma_says_busy() -> None:
    p = policy("window", max_wait_s=0.200, wait_only_if_it_pays=True)
    feed(p, [i * 0.002 for i in range(20)])
    assert isinstance(p.decide(0.040, state(1, oldest=0.039)), Wait)
    assert isinstance(p.decide(0.060, state(1, oldest=0.039)), Dispatch)  # 22 ms without an arrival


def test_static_batching_never_skips_its_wait() -> None:
    p = policy("static", max_wait_s=0.050, wait_only_if_it_pays=True)
    feed(p, [0.0, 0.5, 1.0])
    assert p.decide(1.0, state(1, oldest=1.0)) == Wait(1.05)


def test_the_fast_path_is_the_default() -> None:
    assert PolicyConfig().wait_only_if_it_pays
