"""Fleets (sim/fleet.py, sim/fleet.py, sim/router.py): the plain simulation per replica, routing, theory.

* A fleet of one replica is the plain simulation, request by request and batch by batch (pipelined
  slots, the serving path, noise, deadlines).
* hypothesis: no request is lost or duplicated across replicas, and every batch is one replica's.
* Routers: round robin in turn, least_loaded never picks a replica with more outstanding requests than
  another, power_of_two the same choices for the same seed.
* Queueing theory, batch size 1 and deterministic service D: under round robin each replica's waits
  equal the Lindley recursion on the rows it got (exactly); two replicas at 2 lambda wait less on
  average than one at lambda, which matches Pollaczek-Khinchine. (Round robin splits a Poisson stream
  into Erlang-2 streams of half the rate; GI/D/1 mean waits grow in the convex order of the
  inter-arrival law and Erlang-2 is below the exponential in it, so the inequality is a theorem for the
  stationary means; the seeded 40,000-row runs show it with a wide margin.)
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchpilot.core.config import AdmissionConfig, PlannerConfig, PolicyConfig, SchedulerConfig
from batchpilot.core.costmodel import CostModel
from batchpilot.sim.fleet import simulate_fleet
from batchpilot.sim.metrics import summarize
from batchpilot.sim.router import ROUTERS, LeastLoaded, PowerOfTwo, RoundRobin, make_router
from batchpilot.sim.service import BatchCost, Noise, RequestCost, ServiceModel
from batchpilot.sim.synthetic import synthetic_workload
from batchpilot.sim.target import DONE, PENDING, simulate_encoder
from batchpilot.sim.traces import conv_embed
from core_factories import lindley_waits

FIELDS = ("dispatch_s", "finish_s", "status", "reasons", "b_start", "b_duration", "b_size", "b_padded_len",
          "b_tokens", "b_useful", "b_attn")
SERVICE = ServiceModel(RequestCost(delay_const_s=0.002, delay_per_token_s=1e-6),
                       BatchCost(overhead_s=0.0005, alpha=1.1, const_s=0.0002,
                                 token_factors=((0, 1.1), (64, 0.95))),
                       Noise(residuals=(-0.1, 0.0, 0.2)))


def linear_cost(c0: float) -> CostModel:
    return CostModel(latency_coef=(c0, 0.0, 0.0, 0.0), memory_coef=(0.0, 0.0, 0.0, 0.0))


def one_at_a_time() -> SchedulerConfig:
    return SchedulerConfig(policy=PolicyConfig(name="window", max_batch_size=1, max_wait_s=0.0,
                                               wait_only_if_it_pays=False),
                           planner=PlannerConfig(grouping="fifo", padding="dynamic"))


@pytest.mark.parametrize("slots,pipeline,service,request_sla", [
    (1, "off", None, None), (2, "on", None, None), (1, "on", SERVICE, None), (2, "on", SERVICE, 0.4),
])
def test_a_one_replica_fleet_is_the_plain_simulation(
    slots: int, pipeline: str, service: ServiceModel | None, request_sla: float | None
) -> None:
    wl = conv_embed().slice(0, 1500).scale_rate(3)
    cfg = SchedulerConfig(num_slots=slots, pipeline=pipeline, pipeline_lead_s=0.01,  # type: ignore[arg-type]
                          admission=AdmissionConfig(timeout_s=2.0))
    cm = CostModel.default_cpu_minilm()
    plain = simulate_encoder(wl, cfg, cm, noise=True, seed=5, request_sla_s=request_sla, service=service)
    fleet = simulate_fleet(wl, cfg, cm, replicas=1, noise=True, seed=5, request_sla_s=request_sla,
                           service=service)
    for name in FIELDS:
        got, want = getattr(fleet.run.record, name), getattr(plain.record, name)
        if isinstance(want, dict):
            assert got == want, name
        else:  # nan (never dispatched: refused) equals nan
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=name)
    assert fleet.run.stats.num_pipelined == plain.stats.num_pipelined
    if pipeline == "on":
        assert plain.stats.num_pipelined > 0  # the pipelined path was exercised
    a, b = summarize(plain), summarize(fleet.run)
    assert a.p99_all == b.p99_all and a.queue == b.queue
    assert b.utilisation == pytest.approx(a.utilisation)


@settings(max_examples=25, deadline=None)
@given(replicas=st.integers(1, 4), router=st.sampled_from(ROUTERS), rate=st.floats(5, 80),
       batch=st.sampled_from((1, 4, 16)), slots=st.integers(1, 2), with_service=st.booleans(),
       concurrency=st.sampled_from((0, 8)), seed=st.integers(0, 3))
def test_no_request_is_lost_or_duplicated_across_replicas(
    replicas: int, router: str, rate: float, batch: int, slots: int, with_service: bool, concurrency: int,
    seed: int
) -> None:
    wl = synthetic_workload(f"poisson:rate={rate}", 300, "lognormal:median=64,sigma=0.8", seed=seed)
    cfg = SchedulerConfig(policy=PolicyConfig(name="window", max_batch_size=batch, max_wait_s=0.01),
                          num_slots=slots, admission=AdmissionConfig(max_concurrent_requests=concurrency))
    out = simulate_fleet(wl, cfg, CostModel.default_cpu_minilm(), replicas=replicas, router=router,
                         seed=seed, service=SERVICE if with_service else None)
    rec = out.run.record
    assert (out.routed >= 0).all() and set(out.routed.tolist()) <= set(range(replicas))
    assert PENDING not in rec.status  # every row finished, was refused or was dropped
    for k, own in enumerate(out.records):
        mine = set(np.flatnonzero(out.routed == k).tolist())
        handled = {i for i, s in enumerate(own.status) if s != PENDING}
        assert handled == mine  # each row handled by the replica it went to, and by no other
        assert sum(own.b_size) == sum(1 for i in mine if own.status[i] == DONE)  # one batch each
        assert out.per_replica[k].requests == len(mine)
    assert sum(rec.b_size) == rec.status.count(DONE) == summarize(out.run).num_completed


def test_every_batch_holds_requests_of_one_replica_only() -> None:
    wl = synthetic_workload("poisson:rate=60", 800, "lognormal:median=64,sigma=0.8", seed=1)
    cfg = SchedulerConfig(policy=PolicyConfig(name="window", max_batch_size=16, max_wait_s=0.02))
    from batchpilot.sim import fleet as fleet_module

    batches: list[tuple[int, list[int]]] = []
    original = fleet_module.FleetTarget.on_job_done

    def spy(self: fleet_module.FleetTarget, job, now):  # type: ignore[no-untyped-def]
        batches.append((self.routed[job.payload.requests[0].id], [r.id for r in job.payload.requests]))
        original(self, job, now)

    fleet_module.FleetTarget.on_job_done = spy  # type: ignore[method-assign]
    try:
        out = simulate_fleet(wl, cfg, CostModel.default_cpu_minilm(), replicas=3, router="power_of_two")
    finally:
        fleet_module.FleetTarget.on_job_done = original  # type: ignore[method-assign]
    assert batches and any(len(ids) > 1 for _, ids in batches)
    for k, ids in batches:
        assert {int(out.routed[i]) for i in ids} == {k}


def test_round_robin_takes_replicas_in_turn() -> None:
    rr = RoundRobin()
    assert [rr.choose([5, 0, 9]) for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    wl = synthetic_workload("poisson:rate=20", 90, "constant:value=16", seed=0)
    out = simulate_fleet(wl, one_at_a_time(), linear_cost(0.01), replicas=3)
    assert out.routed.tolist() == [i % 3 for i in range(90)]


@given(st.lists(st.integers(0, 20), min_size=1, max_size=12))
def test_least_loaded_never_picks_a_replica_with_more_outstanding_than_another(loads: list[int]) -> None:
    k = LeastLoaded().choose(loads)
    assert loads[k] == min(loads) and k == loads.index(min(loads))  # ties to the lowest index


def test_least_loaded_in_a_fleet_picks_the_fewest_outstanding_at_every_arrival() -> None:
    seen: list[tuple[list[int], int]] = []

    class Spy(LeastLoaded):
        def choose(self, outstanding):  # type: ignore[no-untyped-def]
            k = super().choose(outstanding)
            seen.append((list(outstanding), k))
            return k

    from batchpilot.sim import fleet as fleet_module

    wl = synthetic_workload("poisson:rate=150", 1000, "lognormal:median=128,sigma=0.8", seed=2)
    cfg = SchedulerConfig(policy=PolicyConfig(name="window", max_batch_size=8, max_wait_s=0.02))
    original = fleet_module.make_router
    fleet_module.make_router = lambda name, seed=0: Spy()  # type: ignore[assignment]
    try:
        simulate_fleet(wl, cfg, CostModel.default_cpu_minilm(), replicas=3, router="least_loaded")
    finally:
        fleet_module.make_router = original
    assert len(seen) == len(wl) and max(max(o) for o, _ in seen) > 1  # queues did build up
    assert all(o[k] == min(o) for o, k in seen)


def test_power_of_two_is_deterministic_per_seed_and_compares_two_distinct_replicas() -> None:
    wl = synthetic_workload("poisson:rate=80", 600, "lognormal:median=64,sigma=0.8", seed=0)
    cfg = SchedulerConfig()
    cm = CostModel.default_cpu_minilm()
    runs = [simulate_fleet(wl, cfg, cm, replicas=4, router="power_of_two", seed=s).routed for s in (0, 0, 1)]
    assert runs[0].tolist() == runs[1].tolist()
    assert runs[0].tolist() != runs[2].tolist()
    p2c = PowerOfTwo(seed=3)
    picks = [p2c.choose([0, 0, 0, 9]) for _ in range(400)]
    assert set(picks) == {0, 1, 2}  # replica 3 loses every comparison: the two draws are never both 3
    assert PowerOfTwo(seed=1).choose([7]) == 0
    with pytest.raises(ValueError, match="router"):
        make_router("random")


def waits_of(run: object, wl_arrival: np.ndarray) -> np.ndarray:
    return np.asarray(run.record.dispatch_s) - wl_arrival  # type: ignore[attr-defined]


def test_round_robin_replicas_are_each_a_lindley_queue_and_beat_one_replica_at_half_the_rate() -> None:
    service, rho, n = 0.01, 0.6, 40_000
    lam = rho / service
    one = synthetic_workload(f"poisson:rate={lam}", n, "constant:value=16", seed=11)
    two = one.scale_rate(2.0)  # the same arrivals at twice the rate, to twice the replicas
    run1 = simulate_encoder(one, one_at_a_time(), linear_cost(service))
    fleet = simulate_fleet(two, one_at_a_time(), linear_cost(service), replicas=2, router="round_robin")
    w1, w2 = waits_of(run1, one.arrival_s), waits_of(fleet.run, two.arrival_s)
    for k in range(2):
        rows = np.flatnonzero(fleet.routed == k)
        np.testing.assert_allclose(w2[rows], lindley_waits(two.arrival_s[rows], service), atol=1e-9)
    pk = lam * service**2 / (2 * (1 - rho))  # M/D/1, Pollaczek-Khinchine
    assert abs(w1.mean() / pk - 1) < 0.05
    assert w2.mean() < 0.8 * w1.mean()  # Erlang-2 arrivals at each replica queue less than Poisson
    assert summarize(fleet.run).utilisation == pytest.approx(rho, rel=0.03)


def test_the_fleet_stops_early_on_its_misses_together() -> None:
    wl = synthetic_workload("poisson:rate=400", 2000, "constant:value=16", seed=0)
    cm = linear_cost(0.01)
    out = simulate_fleet(wl, one_at_a_time(), cm, replicas=2, stop_after_misses=(0.05, 20, 0.0))
    assert out.run.stats.aborted
    full = simulate_fleet(wl, one_at_a_time(), cm, replicas=2)
    assert not full.run.stats.aborted and summarize(full.run).p99_all > 0.05
    assert simulate_fleet(wl.scale_rate(0.1), one_at_a_time(), cm, replicas=2,
                          stop_after_misses=(0.05, 20, 0.0)).run.stats.aborted is False


def test_more_replicas_carry_a_load_one_cannot() -> None:
    wl = conv_embed().slice(0, 1500).scale_rate(8)
    cm = CostModel.default_cpu_minilm()
    p99 = [summarize(simulate_fleet(wl, SchedulerConfig(), cm, replicas=n, router="least_loaded").run).p99_all
           for n in (1, 2, 4)]
    assert p99[0] > p99[1] > p99[2]
    with pytest.raises(ValueError, match="replicas"):
        simulate_fleet(wl, SchedulerConfig(), cm, replicas=0)


def test_simulate_replicas_prints_the_fleet_and_each_replica(capsys: pytest.CaptureFixture[str]) -> None:
    from batchpilot.cli import main

    args = ["simulate", "--workload", "conv-embed", "--rate-scale", "8", "--requests", "600"]
    assert main([*args, "--replicas", "3", "--router", "least_loaded"]) == 0
    out = capsys.readouterr().out
    assert "3 replicas behind least_loaded: each replica's share" in out
    assert main([*args, "--replicas", "0"]) == 2
    assert main(["simulate", "--workload", "conv-llm", "--requests", "10", "--replicas", "2"]) == 2


def test_tune_max_replicas_finds_the_fewest_that_hold_and_writes_the_per_replica_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from batchpilot.cli import main
    from batchpilot.settings import load_spec

    out = tmp_path / "best.yaml"
    rc = main(["tune", "--workload", "conv-embed", "--rate-scale", "12", "--requests", "500",
               "--candidates", "2", "--sla-p99", "1.0", "--max-replicas", "4", "--router", "round_robin",
               "-o", str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text
    found = re.search(r"replicas: (\d+)", text)
    assert found is not None and 1 < int(found.group(1)) <= 4  # one replica cannot carry x12
    n = int(found.group(1))
    assert f"# replicas: {n} (router round_robin), holds" in out.read_text()
    assert load_spec(out).encoder.policy.max_batch_size >= 1  # serve and simulate read it unchanged
    for line in text.splitlines():  # the table's "holds" column: no below the answer, yes at it
        cells = [c.strip() for c in line.split("│") if c.strip()]
        if cells and cells[0].isdigit() and cells[-1] in ("yes", "no"):
            assert (cells[-1] == "yes") == (int(cells[0]) == n)
    assert main(["tune", "--workload", "conv-embed", "--requests", "400", "--max-replicas", "0",
                 "-o", str(out)]) == 2


def test_tune_without_max_replicas_is_the_plain_tuner(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from batchpilot.cli import main

    out = tmp_path / "best.yaml"
    assert main(["tune", "--workload", "conv-embed", "--requests", "400", "--candidates", "2",
                 "-o", str(out)]) == 0
    assert "replicas" not in out.read_text() and "sizing a fleet" not in capsys.readouterr().out


def test_a_fleet_tuner_of_one_replica_finds_the_plain_tuners_capacity() -> None:
    from batchpilot.sim.tune import Candidate, FleetTuner, TuneConfig, Tuner

    wl = conv_embed().slice(0, 600)
    tc = TuneConfig(sla_p99_s=1.0)
    cm = CostModel.default_cpu_minilm()
    caps = []
    for tuner in (Tuner(wl, cm, tc), FleetTuner(wl, cm, tc, replicas=1, router="round_robin")):
        cand = Candidate("default", SchedulerConfig())
        tuner.capacity(cand, wl, 0.02, 1.0)
        caps.append((cand.capacity, cand.probes))
    assert caps[0] == caps[1]
