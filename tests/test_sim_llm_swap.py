"""The simulator's LLM target under swap and recompute preemption: the same ``LLMScheduler`` makes the
decisions (replayed call for call against a fresh scheduler, the plans match), a step that swaps costs its
forward plus its block copies, and on a memory-tight workload swapping throws away fewer computed tokens
than recomputing."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

import pytest

from batchpilot.core.llm.config import LLMSchedulerConfig
from batchpilot.core.llm.scheduler import LLMScheduler, PreemptionCosts, SeqOutput, StepPlan
from batchpilot.core.llm.sequence import Sequence
from batchpilot.sim.engine import Engine
from batchpilot.sim.llm import LLMTarget, default_llm_cost_model, sim_preemption_costs, simulate_llm
from batchpilot.sim.traces import Workload

TIGHT = {"num_kv_blocks": 60, "block_size": 16, "max_num_seqs": 16, "max_num_batched_tokens": 512,
         "max_model_len": 1024}


def tight_workload(n: int = 40) -> Workload:
    return Workload.from_columns("tight", [0.05 * i for i in range(n)], [200 + 7 * (i % 5) for i in range(n)],
                                 [100 + 3 * (i % 7) for i in range(n)])


def plan_summary(plan: StepPlan) -> tuple[Any, ...]:
    return (plan.preempted, plan.swapped_out, plan.swapped_in, plan.swap_out, plan.swap_in,
            [(c.seq_id, c.start, c.num_tokens) for c in plan.chunks])


class RecordingScheduler(LLMScheduler):
    """An ``LLMScheduler`` that logs every call the simulator makes, to replay them elsewhere."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.calls: list[tuple[Any, ...]] = []

    def add(self, seq: Sequence) -> str | None:
        self.calls.append(("add", seq.seq_id, list(seq.prompt_token_ids), seq.params, seq.arrival))
        return super().add(seq)

    def schedule(self, now: float | None = None) -> StepPlan:
        plan = super().schedule(now)
        self.calls.append(("schedule", now, plan_summary(plan)))
        return plan

    def update(self, plan: StepPlan, sampled: Mapping[int, int],
               stopped: Collection[int] = ()) -> list[SeqOutput]:
        self.calls.append(("update", dict(sampled)))
        return super().update(plan, sampled, stopped)


@pytest.mark.parametrize("mode", ["swap", "auto", "recompute"])
def test_the_simulator_runs_the_scheduler_s_own_decisions(mode: str) -> None:
    config = LLMSchedulerConfig(**TIGHT, preemption=mode, num_swap_blocks=200)  # type: ignore[arg-type]
    cm = default_llm_cost_model()
    costs = sim_preemption_costs(cm)
    sched = RecordingScheduler(config, costs)
    wl = tight_workload()
    target = LLMTarget(sched, wl, cm, preemption_costs=costs)
    stats = Engine(target, num_slots=1).run(wl.arrival_s)  # type: ignore[arg-type]
    assert not stats.stalled and all(n == out for n, out in zip(target.record.num_output, wl.output_tokens,
                                                                  strict=True))
    # replay every call against a fresh scheduler: the same plans, step for step
    fresh, plans = LLMScheduler(config, costs), []
    for call in sched.calls:
        if call[0] == "add":
            _, sid, prompt, params, arrival = call
            fresh.add(Sequence(sid, prompt, params, arrival=arrival))
        elif call[0] == "schedule":
            plans.append(fresh.schedule(call[1]))
            assert plan_summary(plans[-1]) == call[2]
        else:
            fresh.update(plans[-1], call[1])
    p = sched.preemption
    assert sched.num_preemptions > 0 and fresh.preemption == p
    assert (p.num_swapped_out > 0) is (mode != "recompute")
    # every step is its forward plus its copies: the total is the cost model's plus the blocks copied
    forward = sum(cm.latency(plan.shape) for plan in plans)
    copies = costs.swap_s(p.num_blocks_swapped_out, p.num_blocks_swapped_in)
    assert sum(target.record.step_duration) == pytest.approx(forward + copies)
    assert (copies > 0) is (mode != "recompute")


def test_swap_throws_away_fewer_computed_tokens_than_recompute_on_a_tight_pool() -> None:
    wl = tight_workload()
    rec = simulate_llm(wl, LLMSchedulerConfig(**TIGHT, preemption="recompute"))  # type: ignore[arg-type]
    swp = simulate_llm(wl, LLMSchedulerConfig(**TIGHT, preemption="swap", num_swap_blocks=200))  # type: ignore[arg-type]
    r, s = rec.report(), swp.report()
    assert r.num_finished == s.num_finished == len(wl)
    assert r.num_preemptions > 0 and r.num_swapped_out == 0 and r.num_recomputed_tokens > 0
    assert s.num_swapped_out > 0 and s.num_recomputed_tokens < r.num_recomputed_tokens
    assert ("recomputed tokens", str(s.num_recomputed_tokens)) in s.rows()


def test_sim_costs_come_from_the_profile_meta_else_the_stated_default() -> None:
    cm = default_llm_cost_model()
    assert sim_preemption_costs(cm).swap_out_s_per_block == cm.meta["swap_out_s_per_block"]
    profiled = type(cm)(cm.feature_names, cm.latency_coef, cm.memory_coef,
                        meta={"swap_out_s_per_block": 1e-3, "swap_in_s_per_block": 2e-3})
    assert sim_preemption_costs(profiled) == PreemptionCosts.from_cost_model(profiled)
    bare = type(cm)(cm.feature_names, cm.latency_coef, cm.memory_coef, meta={})
    assert sim_preemption_costs(bare).swap_in_s_per_block == cm.meta["swap_in_s_per_block"]
