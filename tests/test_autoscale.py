"""The autoscaling decision (core/autoscale.py) on a fake clock, and driving a simulated fleet."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchpilot.core.autoscale import AutoscaleConfig, Autoscaler, ReplicaSignal, signal_of
from batchpilot.core.config import SchedulerConfig
from batchpilot.core.costmodel import CostModel
from batchpilot.sim.fleet import FleetScaling, simulate_fleet
from batchpilot.sim.synthetic import synthetic_workload
from batchpilot.sim.target import PENDING
from batchpilot.sim.traces import Workload
from core_factories import make_request, make_scheduler, simple_cost_model


def waits(*seconds: float) -> list[ReplicaSignal]:
    return [ReplicaSignal(queue_depth=int(s * 100), predicted_wait_s=s) for s in seconds]


@pytest.mark.parametrize("kwargs", [
    {"min_replicas": 0}, {"min_replicas": 3, "max_replicas": 2}, {"target_queue_wait_s": 0.0},
    {"target_queue_wait_s": math.inf}, {"upscale_delay_s": -1.0}, {"downscale_delay_s": math.nan},
    {"min_replicas": 1.5},
])
def test_a_bad_config_is_refused_with_the_field_named(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="autoscale"):
        AutoscaleConfig(**kwargs)  # type: ignore[arg-type]


def test_unknown_config_keys_are_errors() -> None:
    assert AutoscaleConfig.from_dict({"max_replicas": 4}).max_replicas == 4
    with pytest.raises(ValueError, match="unknown key"):
        AutoscaleConfig.from_dict({"max_replica": 4})


def test_a_bad_signal_is_refused() -> None:
    for bad in ({"queue_depth": -1, "predicted_wait_s": 0.0}, {"queue_depth": 0, "predicted_wait_s": -0.1},
                {"queue_depth": 0, "predicted_wait_s": math.nan}):
        with pytest.raises(ValueError, match="replica signal"):
            ReplicaSignal(**bad)  # type: ignore[arg-type]


def test_the_rule_is_the_fleets_backlog_over_the_target_wait() -> None:
    a = Autoscaler(AutoscaleConfig(min_replicas=1, max_replicas=10, target_queue_wait_s=0.25))
    assert a.raw_desire(2, waits(0.5, 0.5)) == 4  # 1 s of work ahead / 0.25 s each
    assert a.raw_desire(2, waits(0.25, 0.25)) == 2  # exactly on target: no extra replica for float noise
    assert a.raw_desire(2, waits(0.26, 0.25)) == 3
    assert a.raw_desire(3, waits(1.0, 1.0)) == 8  # a replica still starting adds no work
    assert a.raw_desire(4, waits(0.0, 0.0, 0.0, 0.0)) == 1  # idle: the minimum
    assert a.raw_desire(2, waits(100.0, 100.0)) == 10  # never above the maximum


def test_the_load_count_is_the_averaged_busy_slots_over_the_target_utilisation() -> None:
    busy = [ReplicaSignal(0, 0.01, running=2, slots=2)] * 3  # three replicas' worth of busy executors
    now = Autoscaler(AutoscaleConfig(max_replicas=10, busy_window_s=0.0, upscale_delay_s=0.0))
    assert now.decide(0.0, 3, busy) == 4 and now.busy == 3.0  # ceil(3 / 0.8)
    half = [ReplicaSignal(0, 0.01, running=3, slots=2)] * 2  # pipelined: at most all slots busy
    assert Autoscaler(AutoscaleConfig(max_replicas=10, busy_window_s=0.0)).raw_desire(2, []) == 2
    avg = Autoscaler(AutoscaleConfig(max_replicas=10, busy_window_s=10.0))
    avg.decide(0.0, 2, half)
    assert avg.busy == 2.0
    avg.decide(10.0, 2, [ReplicaSignal(0, 0.0, 0, 2)] * 2)  # idle for one time constant
    assert avg.busy == pytest.approx(2.0 * math.exp(-1.0))


def test_scales_up_only_after_the_wish_held_for_the_upscale_delay() -> None:
    a = Autoscaler(AutoscaleConfig(max_replicas=8, upscale_delay_s=5.0, downscale_delay_s=30.0))
    assert a.decide(0.0, 1, waits(1.0)) == 1  # wants 4, starts waiting
    assert a.decide(4.9, 1, waits(0.5)) == 1
    assert a.decide(5.0, 1, waits(2.0)) == 2  # held 5 s; the smallest wish over the wait was 2
    assert a.decide(6.0, 2, waits(0.5, 0.5)) == 2  # a new wish starts its own wait


def test_a_wish_that_lapses_restarts_the_delay() -> None:
    a = Autoscaler(AutoscaleConfig(max_replicas=8, upscale_delay_s=5.0, downscale_delay_s=30.0))
    assert a.decide(0.0, 1, waits(1.0)) == 1
    assert a.decide(3.0, 1, waits(0.1)) == 1  # back to 1 replica's worth: the wish is gone
    assert a.decide(4.0, 1, waits(1.0)) == 1
    assert a.decide(8.9, 1, waits(1.0)) == 1
    assert a.decide(9.0, 1, waits(1.0)) == 4


def test_scales_down_when_idle_after_the_downscale_delay_to_the_largest_wish() -> None:
    a = Autoscaler(AutoscaleConfig(min_replicas=1, max_replicas=8, upscale_delay_s=5.0,
                                   downscale_delay_s=30.0))
    assert a.decide(0.0, 6, waits(0, 0, 0, 0, 0, 0)) == 6
    assert a.decide(10.0, 6, waits(0.2, 0.2, 0, 0, 0, 0)) == 6  # wants 2
    assert a.decide(29.9, 6, waits(0, 0, 0, 0, 0, 0)) == 6
    assert a.decide(30.0, 6, waits(0, 0, 0, 0, 0, 0)) == 2  # the largest wish over the 30 s
    assert a.decide(60.0, 2, waits(0, 0)) == 2
    assert a.decide(90.0, 2, waits(0, 0)) == 1


def test_bounds_are_enforced_at_once_and_no_signal_holds_the_count() -> None:
    a = Autoscaler(AutoscaleConfig(min_replicas=2, max_replicas=4))
    assert a.decide(0.0, 0, []) == 2
    assert a.decide(0.0, 9, waits(0.0)) == 4
    assert a.decide(1.0, 3, []) == 3


def test_time_must_not_go_backwards() -> None:
    a = Autoscaler(AutoscaleConfig())
    a.decide(5.0, 1, waits(0.0))
    with pytest.raises(ValueError, match="backwards"):
        a.decide(4.0, 1, waits(0.0))


def test_zero_delays_act_at_once() -> None:
    a = Autoscaler(AutoscaleConfig(max_replicas=5, upscale_delay_s=0.0, downscale_delay_s=0.0))
    assert a.decide(0.0, 1, waits(1.0)) == 4
    assert a.decide(0.0, 4, waits(0, 0, 0, 0)) == 1


signal = st.tuples(st.floats(0, 3), st.integers(0, 4), st.integers(1, 4)).map(
    lambda t: ReplicaSignal(int(t[0] * 10), t[0], min(t[1], t[2]), t[2]))


@settings(max_examples=200, deadline=None)
@given(lo=st.integers(1, 4), extra=st.integers(0, 5), up=st.floats(0, 10), down=st.floats(0, 40),
       window=st.sampled_from((0.0, 3.0)),
       steps=st.lists(st.tuples(st.floats(0, 5), st.lists(signal, max_size=8)), max_size=40))
def test_the_answer_never_leaves_the_bounds_and_never_moves_before_its_delay(
    lo: int, extra: int, up: float, down: float, window: float,
    steps: list[tuple[float, list[ReplicaSignal]]]
) -> None:
    cfg = AutoscaleConfig(min_replicas=lo, max_replicas=lo + extra, upscale_delay_s=up,
                          downscale_delay_s=down, busy_window_s=window)
    a = Autoscaler(cfg)
    now, current = 0.0, lo
    since: dict[int, float] = {}  # direction -> when raw started being on that side, continuously
    for dt, signals in steps:
        now += dt
        out = a.decide(now, current, signals)
        raw = a.raw_desire(current, signals)  # what decide saw (the busy average is updated by decide)
        side = 0 if not signals or raw == current else (1 if raw > current else -1)
        if signals:
            for d in (1, -1):
                if side != d:
                    since.pop(d, None)
        if side:
            since.setdefault(side, now)
        assert cfg.min_replicas <= out <= cfg.max_replicas
        if out > current:
            assert now - since[1] >= up
        if out < current:
            assert now - since[-1] >= down
        if out != current:
            since.clear()
        current = out


def toy_fleet(a: Autoscaler, load: list[float], slots: int = 10) -> list[int]:
    """A fluid fleet on a fake clock, one step a second: ``load[t]`` replica-seconds of work arrive, each
    replica drains one per second; a replica's slots are busy in proportion to its utilisation and its
    predicted wait is its share of the backlog plus half a 40 ms batch per busy slot."""
    n, backlog, counts = 1, 0.0, []
    for t, work in enumerate(load):
        util = 1.0 if backlog > 0 else min(1.0, work / n)
        backlog = max(backlog + work - n, 0.0)
        sig = ReplicaSignal(int(backlog * 50 / n), backlog / n + 0.02 * util, round(slots * util), slots)
        n = a.decide(float(t), n, [sig] * n)
        counts.append(n)
    return counts


def test_sustained_wait_scales_up_and_idle_scales_back_down() -> None:
    a = Autoscaler(AutoscaleConfig(min_replicas=1, max_replicas=8, target_queue_wait_s=0.25,
                                   upscale_delay_s=5.0, downscale_delay_s=30.0))
    counts = toy_fleet(a, [3.0] * 300 + [0.0] * 200)
    assert counts[10] > 1  # the queue built up: scaled up within the delay and a few steps
    assert all(c == 4 for c in counts[150:300])  # settled at ceil(3 / 0.8) and stayed: no cycling
    assert counts[-1] == 1  # shrank when the work stopped
    assert all(1 <= c <= 8 for c in counts)


def test_without_busy_slots_reported_the_wait_alone_cycles() -> None:
    """Why the signal carries ``running`` and ``slots``: from waits alone, the same steady load makes the
    fleet shrink while it keeps up (almost no backlog) and grow again once it queues, over and over."""
    a = Autoscaler(AutoscaleConfig(min_replicas=1, max_replicas=8, upscale_delay_s=5.0,
                                   downscale_delay_s=30.0))
    n, backlog, counts = 1, 0.0, []
    for t in range(400):
        backlog = max(backlog + 3.0 - n, 0.0)
        n = a.decide(float(t), n, [ReplicaSignal(0, backlog / n + 0.02)] * n)  # running = 0 reported
        counts.append(n)
    assert sum(1 for x, y in zip(counts, counts[1:], strict=False) if x != y) >= 4


def test_signal_of_reads_the_schedulers_backlog() -> None:
    sched = make_scheduler(simple_cost_model(const=0.01), policy={"name": "window", "max_wait_s": 1.0})
    idle = signal_of(sched, 0.0)
    assert idle == ReplicaSignal(0, 0.0, 0, 1)
    for _ in range(5):
        assert sched.submit(make_request(16, 0.0), 0.0) is None
    sig = signal_of(sched, 0.0)
    assert sig.queue_depth == 5 and sig.running == 0
    assert sig.predicted_wait_s == pytest.approx(sched.predicted_backlog_s(0.0)) and sig.predicted_wait_s > 0
    out = sched.schedule(2.0, 1)  # the window has passed: one batch goes
    assert len(out.batches) == 1
    assert signal_of(sched, 2.0).running == 1 and signal_of(sched, 2.0).queue_depth == 0


# -- the autoscaler driving a simulated fleet (sim/fleet.py) -----------------------------

def burst_then_quiet() -> Workload:
    """60 s at 70 req/s (about three replicas' worth), then 200 s at 1 req/s."""
    burst = synthetic_workload("poisson:rate=70", 4200, "lognormal:median=128,sigma=0.8", seed=4)
    quiet = synthetic_workload("poisson:rate=1", 200, "lognormal:median=128,sigma=0.8", seed=5)
    start = float(burst.arrival_s[-1]) + 1.0
    arrivals = np.concatenate([burst.arrival_s, quiet.arrival_s + start])
    return Workload.from_columns("burst-then-quiet", arrivals, np.concatenate([burst.input_tokens,
                                                                               quiet.input_tokens]))


def test_an_autoscaled_fleet_grows_under_a_burst_shrinks_when_idle_and_stays_in_bounds() -> None:
    wl = burst_then_quiet()
    scaling = FleetScaling(AutoscaleConfig(min_replicas=1, max_replicas=5), start_delay_s=10.0)
    out = simulate_fleet(wl, SchedulerConfig(), CostModel.default_cpu_minilm(), autoscale=scaling)
    assert PENDING not in out.run.record.status and (out.routed >= 0).all()
    targets = [t for _, t, _ in scaling.timeline]
    assert all(1 <= t <= 5 for t in targets) and all(0 < r <= t for _, t, r in scaling.timeline)
    assert max(targets) >= 3 and targets[-1] == 1  # grew under the burst, back to one when quiet
    first_up = next(when for when, t, _ in scaling.timeline if t > 1)
    later = wl.arrival_s[out.routed > 0]
    assert later.size and later.min() >= first_up + 10.0  # no request reaches a replica still starting
    assert 0 < scaling.replica_seconds <= 5 * out.run.stats.end_s


def test_autoscale_ticks_do_not_disturb_the_replicas() -> None:
    """min = max: the fixed fleet's run exactly, though the autoscaler reads every replica each second."""
    wl = synthetic_workload("mmpp:rate_on=80,rate_off=5,on_s=120,off_s=120", 2000,
                            "lognormal:median=128,sigma=0.8", seed=0)
    cm = CostModel.default_cpu_minilm()
    fixed = simulate_fleet(wl, SchedulerConfig(), cm, replicas=2)
    scaled = simulate_fleet(wl, SchedulerConfig(), cm,
                            autoscale=FleetScaling(AutoscaleConfig(min_replicas=2, max_replicas=2)))
    assert fixed.routed.tolist() == scaled.routed.tolist()
    for name in ("dispatch_s", "finish_s", "status", "b_start", "b_duration", "b_size"):
        assert getattr(fixed.run.record, name) == getattr(scaled.run.record, name), name


def test_simulate_autoscale_prints_the_replica_count_over_time(capsys: pytest.CaptureFixture[str]) -> None:
    from batchpilot.cli import main

    args = ["simulate", "--workload", "mmpp:rate_on=80,rate_off=5,on_s=60,off_s=60", "--requests", "3000"]
    assert main([*args, "--autoscale", "1:4", "--start-delay-s", "5"]) == 0
    out = capsys.readouterr().out
    assert "autoscaling 1..4" in out and "replicas set" in out
    assert main([*args, "--autoscale", "4"]) == 2
    assert main([*args, "--autoscale", "2:1"]) == 2
