"""The LLM scheduler's fair order (core/llm/fair.py): chunk prices, admission by the least counter with
the lift, a lone tenant served exactly as FCFS, and no starvation (hypothesis), driven by a fake model
as in tests/test_llm_scheduler.py."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batchpilot.core.costmodel import LLM_FEATURES, CostModel
from batchpilot.core.llm.admission import QUEUE_FULL, LLMAdmission
from batchpilot.core.llm.config import LLMSchedulerConfig
from batchpilot.core.llm.fair import TokenPrices
from batchpilot.core.llm.scheduler import LLMScheduler, StepPlan
from batchpilot.core.llm.sequence import SamplingParams, Sequence
from batchpilot.sim.llm import simulate_llm
from batchpilot.sim.tenants import TenantLoad, tenant_mix
from test_llm_scheduler import check_step, fake_tokens


def scheduler(policy: str = "fair", weights: dict[str, float] | None = None, **kw: Any) -> LLMScheduler:
    base: dict[str, Any] = {"max_num_seqs": 2, "max_num_batched_tokens": 64, "num_kv_blocks": 256,
                            "block_size": 4, "max_model_len": 512, "policy": policy}
    base.update(kw)
    w = weights or {}
    return LLMScheduler(LLMSchedulerConfig(**base), weight_of=lambda t: w.get(t, 1.0))


def seq(i: int, tenant: str, arrival: float, prompt: int = 8, out: int = 4) -> Sequence:
    params = SamplingParams(max_tokens=out, ignore_eos=True)
    return Sequence(i, [100 + (i + k) % 50 for k in range(prompt)], params, arrival=arrival, tenant=tenant)


def drive(s: LLMScheduler, arrivals: list[Sequence], max_steps: int = 20_000) -> list[tuple[int, int]]:
    """Add each sequence when the step count reaches its arrival (one step = one time unit); returns
    (step, seq_id) of every first admission."""
    pending = sorted(arrivals, key=lambda q: q.arrival)
    admitted: list[tuple[int, int]] = []
    seen: set[int] = set()
    step = 0
    while pending or s.has_unfinished():
        while pending and pending[0].arrival <= step:
            s.add(pending.pop(0))
        plan: StepPlan = s.schedule(float(step))
        check_step(s, plan)
        for c in plan.chunks:
            if c.seq_id not in seen:
                seen.add(c.seq_id)
                admitted.append((step, c.seq_id))
        s.update(plan, fake_tokens(plan))
        step += 1
        assert step < max_steps, "no progress"
    return admitted


def test_prices_follow_the_step_model() -> None:
    p = TokenPrices()
    assert p.chunk(0, 10, False) == 10.0 and p.chunk(20, 1, True) == 2.0  # VTC's weights
    coef = {"const": 0.01, "prefill_tokens": 1e-4, "decode_seqs": 2e-3, "kv_tokens": 1e-6,
            "prefill_attn": 1e-8, "multi_row": 0.002}
    cm = CostModel(latency_coef=tuple(coef[f] for f in LLM_FEATURES), feature_names=LLM_FEATURES,
                   memory_coef=(0.0,) * len(LLM_FEATURES))
    q = TokenPrices.from_cost_model(cm)
    assert q.chunk(0, 100, False) == pytest.approx(100 * 1e-4 + 100 * 1e-6 + 100 * 100 * 1e-8)
    assert q.chunk(99, 1, True) == pytest.approx(2e-3 + 100 * 1e-6)


def test_a_late_tenant_is_admitted_before_the_rest_of_a_flood() -> None:
    flood = [seq(i, "flood", 0.0, out=6) for i in range(8)]
    late = seq(100, "light", 3.0, out=6)
    fcfs = drive(scheduler("fcfs"), [*(seq(i, "flood", 0.0, out=6) for i in range(8)),
                                      seq(100, "light", 3.0, out=6)])
    fair = drive(scheduler(), [*flood, late])
    at = {order: next(step for step, sid in run if sid == 100)
          for order, run in (("fcfs", fcfs), ("fair", fair))}
    assert at["fair"] < at["fcfs"]
    after = [sid for step, sid in fair if step >= at["fair"]]
    assert after[0] == 100  # the first admission once it waits: flood has been served, light not


def test_weights_share_admissions() -> None:
    """Two tenants always backlogged, weights 1 and 3: over the run the heavier one is admitted about
    three times as often while both wait."""
    arrivals = [seq(i, "one", 0.0, out=3) for i in range(40)] + [seq(100 + i, "three", 0.0, out=3)
                                                                 for i in range(120)]
    run = drive(scheduler(weights={"three": 3.0}), arrivals)
    first = [sid for _, sid in run[:80]]  # while both still wait
    ratio = sum(sid >= 100 for sid in first) / sum(sid < 100 for sid in first)
    assert 2.5 <= ratio <= 3.5


@st.composite
def llm_runs(draw: Any) -> list[Sequence]:
    n = draw(st.integers(1, 25))
    out = []
    for i in range(n):
        out.append(seq(i, draw(st.sampled_from(["a", "b", "c"])), float(draw(st.integers(0, 30))),
                       draw(st.integers(1, 40)), draw(st.integers(1, 8))))
    return out


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(arrivals=llm_runs(), seqs=st.integers(1, 4), kv=st.sampled_from([16, 64, 256]))
def test_a_lone_tenant_is_served_as_fcfs_and_nobody_starves(arrivals: list[Sequence], seqs: int,
                                                             kv: int) -> None:
    lone = [seq(q.seq_id, "x", q.arrival, q.num_prompt_tokens, q.params.max_tokens) for q in arrivals]
    same = [seq(q.seq_id, "x", q.arrival, q.num_prompt_tokens, q.params.max_tokens) for q in arrivals]
    assert drive(scheduler("fair", max_num_seqs=seqs, num_kv_blocks=kv), lone) == \
        drive(scheduler("fcfs", max_num_seqs=seqs, num_kv_blocks=kv), same)
    s = scheduler("fair", max_num_seqs=seqs, num_kv_blocks=kv)
    admitted = drive(s, arrivals)  # drive asserts progress; every sequence is admitted and finishes
    assert {sid for _, sid in admitted} == {q.seq_id for q in arrivals}
    assert all(q.is_finished for q in arrivals)
    assert s.fair is not None and not s.fair.vtc.backlogged


def test_a_recomputed_sequence_rejoins_its_tenants_waiting_count() -> None:
    s = scheduler(max_num_seqs=4, num_kv_blocks=6, max_num_batched_tokens=32)
    arrivals = [seq(i, "ab"[i % 2], 0.0, prompt=8, out=8) for i in range(4)]
    drive(s, arrivals)
    assert s.num_preemptions > 0 and s.fair is not None and not s.fair.vtc.backlogged


def test_the_simulator_runs_the_fair_order_per_tenant() -> None:
    """``simulate_llm`` gives each workload row its tenant and prices chunks with the step model: a light
    tenant beside a flood gets its first token far sooner under fair than under FCFS."""
    loads = [TenantLoad("light", 1.0, workload="conv-llm"), TenantLoad("flood", 12.0, workload="conv-llm",
                                                                        start=3000)]
    wl, _ = tenant_mix(loads, 30.0)
    light = wl.tenant == "light"
    ttft = {}
    for policy in ("fcfs", "fair"):
        run = simulate_llm(wl, LLMSchedulerConfig(policy=policy))
        first = np.asarray(run.record.first_token_s) - wl.arrival_s
        ttft[policy] = float(np.nanpercentile(first[light], 99))
    assert ttft["fair"] * 5 < ttft["fcfs"]


def test_a_light_tenant_does_not_wait_for_a_floods_running_sequences_to_finish() -> None:
    """Both slots held by a flood with long outputs: under fair the light tenant's sequence (in its
    burst; the flood's own first burst of 20 tokens' worth is long used) is admitted at once, a flood
    sequence recomputed for it; under FCFS it waits for a flood sequence to finish."""
    def arrivals() -> list[Sequence]:
        return [*(seq(i, "flood", 0.0, out=40) for i in range(6)), seq(100, "light", 5.0, out=4)]
    at = {}
    for policy in ("fcfs", "fair"):
        s = scheduler(policy, fair_burst_tokens=20)
        run = drive(s, arrivals())
        at[policy] = next(step for step, sid in run if sid == 100)
    assert at["fair"] == 5 and at["fcfs"] > 30


def test_two_backlogged_tenants_do_not_take_turns_preempting_each_other() -> None:
    """A preemption for fair order needs the waiting tenant in a burst and the running one not, or a
    counter gap of more than a burst: two floods whose counters keep crossing (prompts of 64 and 16
    tokens) take turns preempting each other without that margin, and not with it."""
    def floods(burst: int) -> int:
        s = scheduler(max_num_seqs=4, num_kv_blocks=256, fair_burst_tokens=burst)
        drive(s, [seq(i, "ab"[i % 2], 0.0, prompt=16 if i % 2 else 64, out=20) for i in range(40)])
        return s.num_preemptions
    assert floods(0) > 50  # no margin: they thrash
    assert floods(1024) == 0


def test_the_sequence_bound_is_shared_by_weight() -> None:
    """At the bound (max_num_seqs + max_waiting_seqs), a tenant below its weighted share is still
    admitted, up to twice the bound in all; the flood is refused, saying its share."""
    adm = LLMAdmission(LLMSchedulerConfig(max_num_seqs=2, max_waiting_seqs=6, policy="fair"),
                       lambda t: 3.0 if t == "light" else 1.0)
    for i in range(8):
        assert adm.admit([seq(i, "flood", 0.0)]) is None
    refused = adm.admit([seq(50, "flood", 0.0)])
    assert refused is not None and refused.reason == QUEUE_FULL and "weighted share" in refused.message
    # light's share of 8 beside the flood is 8 x 3/4 = 6
    assert all(adm.admit([seq(60 + i, "light", 0.0)]) is None for i in range(6))
    assert adm.ask(1, "light") is not None and adm.held == {"flood": 8, "light": 6}
    adm.release(60)
    assert adm.room(1, "light") is None and adm.room(1, "flood") is not None
    fcfs = LLMAdmission(LLMSchedulerConfig(max_num_seqs=2, max_waiting_seqs=6))
    for i in range(8):
        fcfs.admit([seq(i, "flood", 0.0)])
    assert fcfs.room(1, "light") is not None  # fcfs keeps the plain bound
