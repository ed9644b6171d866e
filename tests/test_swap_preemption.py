"""Swap preemption beside recompute: the cost rule, the host swap space, and the scheduler running both.

The scheduler runs under a fake driver that keeps a fake KV cache: every slot holds ``(position, hash of
the tokens up to it)``, what a real K/V row depends on. The driver makes the plan's block copies, writes
each chunk's slots, then checks every chunk's whole context reads back through its block table as the
sequence's own tokens: a swap that lost or misplaced a block, or a block handed out while still in use,
fails there. Time is a fake clock (one second per step).
"""

from __future__ import annotations

import functools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchpilot.core.costmodel import LLM_FEATURES, CostModel
from batchpilot.core.llm.blocks import BlockManager, NoFreeBlocksError, NoFreeSwapBlocksError, SwapSpace
from batchpilot.core.llm.config import LLMSchedulerConfig
from batchpilot.core.llm.scheduler import LLMScheduler, PreemptionCosts, StepPlan, choose
from batchpilot.core.llm.sequence import FinishReason, SamplingParams, SeqStatus, Sequence
from llm_workloads import Arrivals, Work, rule_key, workload

CHEAP_SWAP = PreemptionCosts(1e-6, 1e-6, 1e-3, 1e-6)  # copying a block costs far less than a token
DEAR_SWAP = PreemptionCosts(1.0, 1.0, 1e-6, 0.0)


def make_scheduler(costs: PreemptionCosts | None = None, **kw: object) -> LLMScheduler:
    base: dict[str, object] = {"max_num_seqs": 8, "max_num_batched_tokens": 64, "num_kv_blocks": 64,
                               "block_size": 4, "max_model_len": 512}
    base.update(kw)
    return LLMScheduler(LLMSchedulerConfig(**base), costs)  # type: ignore[arg-type]


def make_seq(i: int, prompt_len: int = 8, max_tokens: int = 8, arrival: float | None = None,
             priority: int = 0, prompt: list[int] | None = None) -> Sequence:
    return Sequence(i, prompt or [100 + (i + k) % 50 for k in range(prompt_len)],
                    SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                    arrival=float(i if arrival is None else arrival), priority=priority)


def fake_tokens(plan: StepPlan) -> dict[int, int]:
    return {c.seq_id: 10 + (c.seq_id + c.context_len) % 7 for c in plan.chunks if c.sample}


class FakeKV:
    """Device and host blocks of slots holding ``(position, prefix hash)``; see the module docstring."""

    def __init__(self, s: LLMScheduler) -> None:
        c = s.config
        self.s, self.bs = s, c.block_size
        self.dev: list[list[object]] = [[None] * c.block_size for _ in range(c.num_kv_blocks)]
        self.host: list[list[object]] = [[None] * c.block_size for _ in range(c.num_swap_blocks)]

    def step(self, plan: StepPlan) -> None:
        assert not (plan.swap_out and plan.swap_in), "a step both swaps out and swaps in"
        for d, h in plan.swap_out:
            self.host[h] = list(self.dev[d])
        for h, d in plan.swap_in:
            self.dev[d] = list(self.host[h])
        bs = self.bs
        rows = {c.seq_id: self._rows(self.s.seqs[c.seq_id].all_token_ids) for c in plan.chunks}
        for c in plan.chunks:
            for pos in range(c.start, c.context_len):
                self.dev[c.block_table[pos // bs]][pos % bs] = rows[c.seq_id][pos]
        for c in plan.chunks:  # attention reads the whole context after the step's writes
            got = [self.dev[c.block_table[pos // bs]][pos % bs] for pos in range(c.context_len)]
            assert got == rows[c.seq_id][: c.context_len], f"sequence {c.seq_id} reads a wrong KV"

    @staticmethod
    def _rows(tokens: list[int]) -> list[object]:
        return [(pos, hash(tuple(tokens[: pos + 1]))) for pos in range(len(tokens))]


def check_accounting(s: LLMScheduler) -> None:
    """Device: free + used = total, each used block referenced exactly by the tables holding it. Host:
    free + held = total, no host block in two tables. Swapped sequences hold no device block."""
    bm, sw = s.block_manager, s.swap_space
    held: dict[int, int] = {}
    for table in bm._tables.values():
        for b in table:
            held[b] = held.get(b, 0) + 1
    assert all(bm.ref_count(b) == held.get(b, 0) for b in range(bm.num_blocks))
    assert bm.num_free_blocks + len(held) == bm.num_blocks
    assert set(bm._free).isdisjoint(held)
    host = [h for t in sw._tables.values() for h in t]
    assert len(host) == len(set(host)) and set(host).isdisjoint(sw._free)
    assert sw.num_free_blocks + len(host) == sw.num_blocks
    assert {q.seq_id for q in s.swapped} == set(sw._tables)
    for q in s.swapped:
        assert q.status is SeqStatus.WAITING and not bm.has_blocks(q.seq_id)
        assert len(sw.host_table(q.seq_id)) == bm.blocks_for(q.num_computed_tokens)
    for q in s.waiting:
        assert not bm.has_blocks(q.seq_id) and not sw.has(q.seq_id)


def drive(s: LLMScheduler, kv: FakeKV | None = None, max_steps: int = 5000) -> list[StepPlan]:
    kv, plans = kv or FakeKV(s), []
    while s.has_unfinished():
        plan = s.schedule(float(len(plans)))
        assert not plan.is_empty, "no progress: the scheduler deadlocked"
        kv.step(plan)
        s.update(plan, fake_tokens(plan))
        check_accounting(s)
        plans.append(plan)
        assert len(plans) < max_steps, "starvation"
    return plans


# -- the cost rule -------------------------------------------------------------------------------
def test_choose_by_mode_room_and_cost() -> None:
    assert choose("recompute", CHEAP_SWAP, 4, 16, 100) == "recompute"
    assert choose("swap", DEAR_SWAP, 4, 16, 100) == "swap"  # swap mode ignores the cost
    assert choose("swap", DEAR_SWAP, 4, 16, 3) == "recompute"  # no room on the host
    assert choose("auto", CHEAP_SWAP, 4, 16, 100) == "swap"
    assert choose("auto", DEAR_SWAP, 4, 16, 100) == "recompute"
    assert choose("auto", CHEAP_SWAP, 4, 16, 3) == "recompute"
    assert choose("auto", None, 4, 16, 100) == "recompute"  # nothing to compare
    assert choose("auto", CHEAP_SWAP, 4, 16, 0) == "recompute"  # no swap space
    for mode in ("swap", "auto"):
        assert choose(mode, CHEAP_SWAP, 4, 16, 100, shares_blocks=True) == "recompute"
        assert choose(mode, CHEAP_SWAP, 0, 0, 100) == "recompute"  # nothing computed: nothing to copy


def test_auto_swaps_exactly_when_the_round_trip_is_cheaper_than_the_recompute() -> None:
    costs = PreemptionCosts(swap_out_s_per_block=2e-3, swap_in_s_per_block=1e-3, prefill_s_per_token=1e-4,
                            prefill_s_per_attn=1e-6)
    for tokens in range(1, 400, 7):
        blocks = -(-tokens // 16)
        swap = blocks * 3e-3 < 1e-4 * tokens + 1e-6 * tokens * tokens
        assert choose("auto", costs, blocks, tokens, 1000) == ("swap" if swap else "recompute")
    # long contexts favour swap: attention makes recompute quadratic, copies stay linear
    assert choose("auto", costs, 2, 20, 1000) == "recompute"
    assert choose("auto", costs, 25, 400, 1000) == "swap"


def test_costs_from_a_step_cost_model_and_its_profile_meta() -> None:
    coef = {"const": 0.01, "prefill_tokens": 2e-4, "decode_seqs": 5e-4, "kv_tokens": 1e-6,
            "prefill_attn": 3e-9, "multi_row": 0.002}
    cm = CostModel(LLM_FEATURES, tuple(coef[f] for f in LLM_FEATURES), (0.0,) * len(LLM_FEATURES),
                   meta={"swap_out_s_per_block": 4e-5, "swap_in_s_per_block": 5e-5})
    costs = PreemptionCosts.from_cost_model(cm)
    assert costs.prefill_s_per_token == pytest.approx(2e-4 + 1e-6) and costs.prefill_s_per_attn == 3e-9
    assert (costs.swap_out_s_per_block, costs.swap_in_s_per_block) == (4e-5, 5e-5)
    assert costs.recompute_s(100) == pytest.approx(100 * 2.01e-4 + 1e4 * 3e-9)
    assert costs.swap_s(2, 3) == pytest.approx(2 * 4e-5 + 3 * 5e-5) and costs.to_meta() == cm.meta
    bare = CostModel(LLM_FEATURES, cm.latency_coef, cm.memory_coef, meta={"source": "old profile"})
    with pytest.raises(ValueError, match="swap_out_s_per_block"):
        PreemptionCosts.from_cost_model(bare)
    assert PreemptionCosts.from_cost_model(bare, 1e-5, 2e-5).swap_in_s_per_block == 2e-5
    with pytest.raises(ValueError, match=">= 0"):
        PreemptionCosts(-1.0, 0.0, 0.0)


# -- the host swap space -------------------------------------------------------------------------
def test_swap_space_moves_a_sequence_out_and_back_with_its_copies() -> None:
    bm, sw = BlockManager(num_blocks=6, block_size=4), SwapSpace(4)
    bm.allocate(1, 10)  # 3 blocks
    dev = bm.block_table(1)
    out = sw.swap_out(bm, 1, 3)
    assert [d for d, _ in out] == dev and sw.host_table(1) == [h for _, h in out]
    assert not bm.has_blocks(1) and bm.num_free_blocks == 6 and sw.num_free_blocks == 1
    bm.allocate(2, 20)  # another sequence takes 5 of the 6 device blocks
    with pytest.raises(NoFreeBlocksError):
        sw.swap_in(bm, 1, 11)
    assert sw.has(1) and sw.num_free_blocks == 1  # a failed swap-in changes nothing
    bm.free(2)
    back = sw.swap_in(bm, 1, 13)  # room for the next token too: 4 device blocks, 3 copies
    assert [h for h, _ in back] == [h for _, h in out] and [d for _, d in back] == bm.block_table(1)[:3]
    assert len(bm.block_table(1)) == 4 and not sw.has(1) and sw.num_free_blocks == 4


def test_swap_space_refuses_without_room_and_abort_frees_host_blocks() -> None:
    bm, sw = BlockManager(num_blocks=6, block_size=4), SwapSpace(2)
    bm.allocate(1, 12)
    with pytest.raises(NoFreeSwapBlocksError):
        sw.swap_out(bm, 1, 3)
    assert bm.has_blocks(1) and sw.num_free_blocks == 2  # nothing changed
    sw.swap_out(bm, 1, 2)  # the first two blocks hold the computed tokens
    with pytest.raises(ValueError, match="already swapped"):
        sw.swap_out(bm, 1, 1)
    sw.free(1)
    sw.free(1)  # no-op
    assert sw.num_free_blocks == 2 and not sw.has(1)
    with pytest.raises(ValueError, match="not swapped"):
        sw.swap_in(bm, 1, 4)


# -- the scheduler ------------------------------------------------------------------------------
def test_swapped_sequences_keep_their_progress_and_resume_before_waiting_ones() -> None:
    # 6 blocks of 4: three sequences of 8 + 8 tokens cannot all stay resident
    s = make_scheduler(num_kv_blocks=6, num_swap_blocks=16, preemption="swap")
    seqs = [make_seq(i, 8, 8) for i in range(3)]
    for q in seqs:
        s.add(q)
    kv = FakeKV(s)
    late_added = False
    step = 0
    while s.has_unfinished():
        plan = s.schedule(float(step))
        kv.step(plan)
        for sid in plan.swapped_in:
            chunk = next(c for c in plan.chunks if c.seq_id == sid)
            assert chunk.start > 0 and chunk.start == s.seqs[sid].num_computed_tokens  # no recompute
        if plan.swapped_out and not late_added:  # a new arrival while one is swapped out
            s.add(make_seq(9, 4, 2, arrival=float(step)))
            late_added = True
        if any(c.seq_id == 9 and c.start == 0 for c in plan.chunks):
            assert not s.swapped and s.preemption.num_swapped_in > 0  # swapped ones went first
        s.update(plan, fake_tokens(plan))
        check_accounting(s)
        step += 1
        assert step < 500
    p = s.preemption
    assert p.num_swapped_out > 0 and p.num_swapped_in == p.num_swapped_out
    assert p.num_recompute_preemptions == 0 and p.num_recomputed_tokens == 0
    assert s.num_preemptions == p.num_swapped_out and p.num_blocks_swapped_in == p.num_blocks_swapped_out
    assert all(q.num_output_tokens == 8 for q in seqs) and s.swap_space.num_free_blocks == 16


def test_without_host_room_swap_mode_falls_back_to_recompute() -> None:
    s = make_scheduler(num_kv_blocks=6, num_swap_blocks=1, preemption="swap")
    for i in range(3):
        s.add(make_seq(i, 8, 8))
    drive(s)
    p = s.preemption
    assert p.num_swapped_out == 0 and p.num_recompute_preemptions > 0 and p.num_recomputed_tokens > 0


@pytest.mark.parametrize(("costs", "swaps"), [(CHEAP_SWAP, True), (DEAR_SWAP, False), (None, False)])
def test_auto_mode_follows_the_cost_rule(costs: PreemptionCosts | None, swaps: bool) -> None:
    s = make_scheduler(costs, num_kv_blocks=6, num_swap_blocks=16, preemption="auto")
    for i in range(3):
        s.add(make_seq(i, 8, 8))
    drive(s)
    assert (s.preemption.num_swapped_out > 0) is swaps
    assert (s.preemption.num_recompute_preemptions > 0) is not swaps


def test_a_sequence_sharing_prefix_blocks_is_recomputed_and_its_prefix_is_served_from_the_cache() -> None:
    prompt = list(range(200, 216))  # 4 full blocks of 4 shared by both sequences
    s = make_scheduler(CHEAP_SWAP, num_kv_blocks=9, num_swap_blocks=32, preemption="swap",
                       enable_prefix_caching=True)
    first = make_seq(0, prompt=prompt + [1], max_tokens=12)
    second = make_seq(1, prompt=prompt + [2], max_tokens=12)
    s.add(first)
    kv = FakeKV(s)
    plan = s.schedule(0.0)  # the first computes its prompt: the 4 full blocks enter the prefix cache
    kv.step(plan)
    s.update(plan, fake_tokens(plan))
    s.add(second)
    step = 1
    while s.has_unfinished():
        plan = s.schedule(float(step))
        kv.step(plan)
        s.update(plan, fake_tokens(plan))
        check_accounting(s)
        step += 1
        assert step < 500
    assert second.num_cached_tokens == 16  # the shared prefix
    assert s.block_manager.num_cache_hit_tokens >= 32  # and again when the recompute came back
    assert s.num_preemptions > 0 and s.preemption.num_swapped_out == 0  # shared: recompute, not swap
    assert first.num_output_tokens == second.num_output_tokens == 12


def test_abort_of_a_swapped_sequence_frees_its_host_blocks() -> None:
    s = make_scheduler(num_kv_blocks=6, num_swap_blocks=16, preemption="swap")
    for i in range(3):
        s.add(make_seq(i, 8, 8))
    kv = FakeKV(s)
    while not s.swapped:
        kv.step(plan := s.schedule())
        s.update(plan, fake_tokens(plan))
    victim = s.swapped[0]
    assert s.swap_space.num_free_blocks < 16
    assert s.abort(victim.seq_id) and victim.finish_reason is FinishReason.ABORT
    assert s.swap_space.num_free_blocks == 16 and not s.swapped
    drive(s, kv)
    assert s.block_manager.num_free_blocks == 6


def test_priority_victims_are_swapped_and_come_back_in_key_order() -> None:
    s = make_scheduler(num_kv_blocks=8, num_swap_blocks=32, preemption="swap", policy="priority",
                       max_priority_wait_s=0.0)
    for i, prio in enumerate([5, 1, 3, 0]):
        s.add(make_seq(i, 8, 8, arrival=0.0, priority=prio))
    order: list[int] = []
    kv = FakeKV(s)
    for step in range(500):
        if not s.has_unfinished():
            break
        plan = s.schedule(float(step))
        kv.step(plan)
        for sid in plan.preempted:  # the victim is worse than everything still running
            assert all(s._key(s.seqs[sid]) > s._key(r) for r in s.running)
        assert [q.seq_id for q in s.swapped] == [q.seq_id for q in sorted(s.swapped, key=s._key)]
        order += plan.swapped_in
        s.update(plan, fake_tokens(plan))
    assert not s.has_unfinished() and order and s.preemption.num_recompute_preemptions == 0


def run_workload(work: Work, **cfg: object) -> tuple[LLMScheduler, list[Sequence]]:
    """Arrivals by step, one second per step; aborts some; checks every step's KV, accounting and order."""
    costs = cfg.pop("costs", None)
    s = make_scheduler(costs, **cfg)  # type: ignore[arg-type]
    kv = FakeKV(s)
    arrivals = Arrivals(work)
    step = 0
    while arrivals or s.has_unfinished():
        arrivals.add_due(s, step)
        if step % 7 == 3 and s.swapped and s.swapped[-1].seq_id % 4 == 1:
            s.abort(s.swapped[-1].seq_id)  # an abort while swapped out
        now = float(step)
        was_waiting = {q.seq_id for q in s.waiting}
        plan = s.schedule(now)
        c = s.config
        assert plan.num_batched_tokens <= c.max_num_batched_tokens and len(s.running) <= c.max_num_seqs
        key = functools.partial(rule_key, now=now, policy=str(c.policy), wait=c.max_priority_wait_s)
        for x in (s.seqs[ch.seq_id] for ch in plan.chunks if ch.seq_id in was_waiting):
            assert all(key(x) < key(w) for w in s.waiting), "a waiting sequence was overtaken"
            assert not s.swapped, "a waiting sequence was admitted while one was swapped out"
        if s.has_unfinished():
            assert not plan.is_empty, "no progress"
        kv.step(plan)
        s.update(plan, fake_tokens(plan))
        check_accounting(s)
        step += 1
        assert step < 5000, "starvation: the workload did not finish"
    return s, arrivals.admitted


@settings(max_examples=250, deadline=None)
@given(work=workload, blocks=st.integers(12, 20), swap_blocks=st.integers(0, 30), budget=st.integers(1, 48),
       seqs=st.integers(2, 8), mode=st.sampled_from(["recompute", "swap", "auto"]),
       costs=st.sampled_from([CHEAP_SWAP, DEAR_SWAP, PreemptionCosts(1e-4, 1e-4, 1e-5, 1e-7)]),
       policy=st.sampled_from(["fcfs", "priority"]), chunked=st.booleans(), prefix=st.booleans(),
       wait=st.sampled_from([0.0, 2.0]))
def test_random_workloads_finish_exactly_with_kv_intact(work: Work, blocks: int, swap_blocks: int,
                                                       budget: int, seqs: int, mode: str,
                                                       costs: PreemptionCosts, policy: str, chunked: bool,
                                                       prefix: bool, wait: float) -> None:
    s, admitted = run_workload(work, num_kv_blocks=blocks, num_swap_blocks=swap_blocks,
                               max_num_batched_tokens=budget, max_num_seqs=seqs, preemption=mode, costs=costs,
                               policy=policy, enable_chunked_prefill=chunked, enable_prefix_caching=prefix,
                               max_priority_wait_s=wait)
    # what an unpreempted run gives: the fake sampler's token at each context length
    for q in admitted:
        assert q.is_finished
        if q.finish_reason is not FinishReason.ABORT:
            n = q.num_prompt_tokens
            assert q.output_token_ids == [10 + (q.seq_id + n + k) % 7 for k in range(q.params.max_tokens)]
    p = s.preemption
    assert s.num_preemptions == p.num_swapped_out + p.num_recompute_preemptions
    assert p.num_swapped_in <= p.num_swapped_out
    if mode == "recompute" or swap_blocks == 0:
        assert p.num_swapped_out == 0
    bm, sw = s.block_manager, s.swap_space
    assert bm.num_free_blocks == blocks and not bm._tables
    assert sw.num_free_blocks == swap_blocks and not sw._tables


def test_swap_recomputes_fewer_tokens_than_recompute_on_the_same_workload() -> None:
    work = [(24, 12, 0, i // 2, False) for i in range(10)]
    cfg = {"num_kv_blocks": 24, "max_num_batched_tokens": 32, "max_num_seqs": 6}
    rec, _ = run_workload(work, preemption="recompute", **cfg)
    swp, _ = run_workload(work, preemption="swap", num_swap_blocks=64, **cfg)
    assert rec.preemption.num_recomputed_tokens > 0 and swp.preemption.num_swapped_out > 0
    assert swp.preemption.num_recomputed_tokens < rec.preemption.num_recomputed_tokens
