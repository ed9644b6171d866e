"""LLMScheduler: budgets, chunked prefill, preemption by recompute, policies, aging, rejection.

A fake driver stands in for the model: it "samples" a deterministic token for every chunk that asks
for one. Time is a fake clock the test passes to ``schedule(now)`` (or none: no time passes).
"""

from __future__ import annotations

import functools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchpilot.core.llm.config import LLMSchedulerConfig
from batchpilot.core.llm.scheduler import LLMScheduler, StepPlan
from batchpilot.core.llm.sequence import FinishReason, SamplingParams, SeqStatus, Sequence
from llm_workloads import Arrivals, Work, rule_key, workload

EOS = 2


def make_scheduler(**kw: object) -> LLMScheduler:
    base: dict[str, object] = {"max_num_seqs": 8, "max_num_batched_tokens": 64, "num_kv_blocks": 64,
                               "block_size": 4, "max_model_len": 512, "eos_token_ids": (EOS,)}
    base.update(kw)
    return LLMScheduler(LLMSchedulerConfig(**base))  # type: ignore[arg-type]


def make_seq(seq_id: int, prompt_len: int = 8, max_tokens: int = 4, arrival: float | None = None,
             priority: int = 0, **params: object) -> Sequence:
    return Sequence(seq_id=seq_id, prompt_token_ids=[100 + (seq_id + i) % 50 for i in range(prompt_len)],
                    params=SamplingParams(max_tokens=max_tokens, ignore_eos=True, **params),  # type: ignore[arg-type]
                    arrival=float(seq_id if arrival is None else arrival), priority=priority)


def fake_tokens(plan: StepPlan) -> dict[int, int]:
    return {c.seq_id: 10 + (c.seq_id + c.context_len) % 7 for c in plan.chunks if c.sample}


def check_step(s: LLMScheduler, plan: StepPlan) -> None:
    c = s.config
    assert plan.num_batched_tokens <= c.max_num_batched_tokens
    assert len(s.running) <= c.max_num_seqs
    assert len({ch.seq_id for ch in plan.chunks}) == len(plan.chunks)
    for ch in plan.chunks:
        assert len(ch.block_table) * c.block_size >= ch.context_len  # every KV slot has a block
    # victims are worse (lowest priority, then latest arrival) than every sequence still running; under
    # fair, victims of a tenant that fair order places last (tests/test_llm_fair.py)
    for vid in plan.preempted:
        victim = next(q for q in [*s.waiting, *s.swapped] if q.seq_id == vid)
        assert s.fair is not None or all(s._key(victim) > s._key(r) for r in s.running)


def run(s: LLMScheduler, max_steps: int = 10_000) -> list[StepPlan]:
    plans = []
    while s.has_unfinished():
        plan = s.schedule()
        check_step(s, plan)
        assert not plan.is_empty, "no progress: the scheduler deadlocked"
        s.update(plan, fake_tokens(plan))
        plans.append(plan)
        assert len(plans) < max_steps
    return plans


def test_chunked_prefill_splits_a_long_prompt_and_samples_only_at_its_end() -> None:
    s = make_scheduler(max_num_batched_tokens=16)
    seq = make_seq(0, prompt_len=40, max_tokens=3)
    s.add(seq)
    plans = run(s)
    first = [p.chunks[0] for p in plans]
    assert [c.num_tokens for c in first] == [16, 16, 8, 1, 1]
    assert [c.sample for c in first] == [False, False, True, True, True]
    assert [c.is_decode for c in first] == [False, False, False, True, True]
    assert seq.finish_reason is FinishReason.LENGTH and seq.num_output_tokens == 3


def test_decodes_and_prefill_chunks_share_a_step() -> None:
    s = make_scheduler(max_num_batched_tokens=10)
    s.add(make_seq(0, prompt_len=4, max_tokens=20))
    s.update(plan := s.schedule(), fake_tokens(plan))
    s.add(make_seq(1, prompt_len=30, max_tokens=2))
    plan = s.schedule()
    assert [(c.seq_id, c.num_tokens, c.is_decode) for c in plan.chunks] == [(0, 1, True), (1, 9, False)]
    shape = plan.shape
    assert (shape.prefill_tokens, shape.decode_seqs) == (9, 1)
    assert shape.kv_tokens == 5 + 9 and shape.prefill_attn == 9 * 9


def test_max_num_seqs_caps_running() -> None:
    s = make_scheduler(max_num_seqs=2)
    for i in range(5):
        s.add(make_seq(i))
    plan = s.schedule()
    assert [c.seq_id for c in plan.chunks] == [0, 1] and s.num_waiting == 3


def test_preemption_by_recompute_resumes_and_finishes_everything() -> None:
    # 6 blocks of 4 = 24 slots; three sequences of 8 + 8 tokens each cannot all stay resident
    s = make_scheduler(num_kv_blocks=6)
    seqs = [make_seq(i, prompt_len=8, max_tokens=8) for i in range(3)]
    for q in seqs:
        s.add(q)
    plans = run(s)
    assert s.num_preemptions > 0
    assert all(q.finish_reason is FinishReason.LENGTH and q.num_output_tokens == 8 for q in seqs)
    # the earliest arrival is never a victim; the latest is the first one
    victims = [v for p in plans for v in p.preempted]
    assert 0 not in victims and victims[0] == 2
    assert s.block_manager.num_free_blocks == 6


def test_recomputed_chunk_replays_prompt_and_outputs() -> None:
    s = make_scheduler(num_kv_blocks=4, max_num_batched_tokens=64)
    a, b = make_seq(0, prompt_len=4, max_tokens=8), make_seq(1, prompt_len=4, max_tokens=8)
    s.add(a)
    s.add(b)
    while not b.num_preemptions:
        s.update(plan := s.schedule(), fake_tokens(plan))
    generated = list(b.output_token_ids)
    while b.status is not SeqStatus.RUNNING:
        s.update(plan := s.schedule(), fake_tokens(plan))
    resumed = next(c for c in plan.chunks if c.seq_id == 1)
    assert resumed.start == 0
    assert resumed.token_ids == b.prompt_token_ids + generated[: len(resumed.token_ids) - 4]


def test_priority_policy_admits_urgent_first_and_preempts_least_urgent() -> None:
    s = make_scheduler(policy="priority", num_kv_blocks=6, max_num_seqs=8)
    low = make_seq(0, prompt_len=8, max_tokens=8, priority=5)
    mid = make_seq(1, prompt_len=8, max_tokens=8, priority=1)
    s.add(low)
    s.add(mid)
    urgent = make_seq(2, prompt_len=8, max_tokens=8, priority=-1)
    s.add(urgent)
    plan = s.schedule()
    assert [c.seq_id for c in plan.chunks] == [2, 1, 0]
    plans = [plan, *run(s)]
    victims = [v for p in plans for v in p.preempted]
    assert victims and victims[0] == 0 and 2 not in victims


def test_fcfs_ignores_priority() -> None:
    s = make_scheduler(policy="fcfs", max_num_seqs=1)
    s.add(make_seq(0, priority=9))
    s.add(make_seq(1, priority=-9))
    assert [c.seq_id for c in s.schedule().chunks] == [0]


# -- priorities and aging, on a fake clock ---------------------------------------------------------
URGENT, LOW = -10, 10


def stream_of_urgent_arrivals(wait: float, steps: int, dt: float = 0.1,
                              max_tokens: int = 3) -> tuple[Sequence, list[float]]:
    """One slot; at t=0 an urgent and a low-priority sequence arrive, then one more urgent sequence per
    step, faster than the slot serves them (each takes ``max_tokens`` steps): the urgent queue only
    grows. Returns the low sequence and the times (step starts) it was scheduled at."""
    s = make_scheduler(policy="priority", max_num_seqs=1, num_kv_blocks=512, max_priority_wait_s=wait)
    low = make_seq(1, max_tokens=max_tokens, arrival=0.0, priority=LOW)
    s.add(make_seq(0, max_tokens=max_tokens, arrival=0.0, priority=URGENT))
    s.add(low)
    served: list[float] = []
    for k in range(steps):
        now = k * dt
        if k:
            s.add(make_seq(k + 1, max_tokens=max_tokens, arrival=now, priority=URGENT))
        plan = s.schedule(now)
        check_step(s, plan)
        if any(c.seq_id == low.seq_id for c in plan.chunks):
            served.append(now)
        s.update(plan, fake_tokens(plan))
    return low, served


def test_priority_serves_the_most_urgent_waiting_sequence_first() -> None:
    s = make_scheduler(policy="priority", max_num_seqs=1, max_priority_wait_s=10.0)
    for i, prio in enumerate([LOW, 0, URGENT, 0]):
        s.add(make_seq(i, max_tokens=1, arrival=0.1 * i, priority=prio))
    order = []
    for k in range(4):
        plan = s.schedule(1.0 + 0.1 * k)  # all younger than the aging bound
        order += [c.seq_id for c in plan.chunks]
        s.update(plan, fake_tokens(plan))
    assert order == [2, 1, 3, 0]  # by priority, then arrival


def test_strict_priority_starves_a_low_sequence_under_a_stream_of_urgent_arrivals() -> None:
    low, served = stream_of_urgent_arrivals(wait=0.0, steps=300)
    assert not served and low.status is SeqStatus.WAITING  # what aging is for


def test_a_low_sequence_under_a_stream_of_urgent_arrivals_starts_within_the_aging_bound() -> None:
    """The bound: max_priority_wait_s after its arrival, plus what it then waits on: the sequence already
    running (3 steps at most here); every urgent sequence that arrives later stays behind it."""
    wait, dt, max_tokens = 1.0, 0.1, 3
    low, served = stream_of_urgent_arrivals(wait, steps=300, dt=dt, max_tokens=max_tokens)
    assert served, "starved"
    assert wait <= served[0] <= wait + max_tokens * dt + 1e-9
    assert low.finish_reason is FinishReason.LENGTH and len(served) == max_tokens  # and it runs through


def test_aged_sequences_go_first_in_arrival_order_whatever_their_priority() -> None:
    s = make_scheduler(policy="priority", max_num_seqs=1, max_priority_wait_s=2.0)
    s.add(make_seq(0, max_tokens=1, arrival=0.0, priority=LOW))
    s.add(make_seq(1, max_tokens=1, arrival=0.5, priority=LOW + 5))
    s.add(make_seq(2, max_tokens=1, arrival=2.9, priority=URGENT))
    s.add(make_seq(3, max_tokens=1, arrival=1.0, priority=0))
    order = []
    for now in (3.0, 3.1, 3.2, 3.3):  # 0, 1 and 3 have waited 2 s; 2 has not (until 4.9)
        plan = s.schedule(now)
        order += [c.seq_id for c in plan.chunks]
        s.update(plan, fake_tokens(plan))
    assert order == [0, 1, 3, 2]


def test_preemption_victims_follow_the_aged_order() -> None:
    """Two sequences outgrow 6 blocks of 4. Under strict priority the low one is the victim; once it has
    waited the aging bound it ranks ahead of the younger urgent one, which is preempted instead."""
    first_victim = {}
    for wait in (0.0, 2.0):
        s = make_scheduler(policy="priority", num_kv_blocks=6, max_priority_wait_s=wait)
        s.add(make_seq(0, prompt_len=8, max_tokens=8, arrival=0.0, priority=LOW))
        s.update(plan := s.schedule(0.0), fake_tokens(plan))
        s.add(make_seq(1, prompt_len=8, max_tokens=8, arrival=1.0, priority=URGENT))
        for step in range(1, 20):
            plan = s.schedule(float(step))
            check_step(s, plan)  # victims rank below everything still running, by the aged order
            if plan.preempted:
                first_victim[wait] = (plan.preempted[0], float(step))
                break
            s.update(plan, fake_tokens(plan))
    assert first_victim[0.0][0] == 0  # the low one, as ever
    victim, at = first_victim[2.0]
    assert victim == 1 and at >= 2.0  # the low one has aged by then: the urgent newcomer goes


def test_fcfs_is_unchanged_by_the_aging_setting() -> None:
    orders = []
    for wait in (0.0, 1.0):
        s = make_scheduler(policy="fcfs", max_num_seqs=1, max_priority_wait_s=wait)
        for i, prio in enumerate([9, -9, 0]):
            s.add(make_seq(i, max_tokens=1, arrival=0.5 * i, priority=prio))
        order = []
        for k in range(3):
            plan = s.schedule(5.0 + k)
            order += [c.seq_id for c in plan.chunks]
            s.update(plan, fake_tokens(plan))
        orders.append(order)
    assert orders == [[0, 1, 2], [0, 1, 2]]


def test_without_a_clock_nothing_ages() -> None:
    s = make_scheduler(policy="priority", max_num_seqs=1, max_priority_wait_s=1.0)
    s.add(make_seq(0, max_tokens=1, arrival=0.0, priority=LOW))
    s.add(make_seq(1, max_tokens=1, arrival=0.0, priority=URGENT))
    assert [c.seq_id for c in s.schedule().chunks] == [1]


def test_max_priority_wait_s_is_validated() -> None:
    for bad in (-1.0, math.nan):
        with pytest.raises(ValueError, match="max_priority_wait_s must be >= 0"):
            LLMSchedulerConfig(max_priority_wait_s=bad)
    assert LLMSchedulerConfig(max_priority_wait_s=0).max_priority_wait_s == 0
    assert LLMSchedulerConfig().max_priority_wait_s == 10.0


def test_never_fit_requests_are_rejected_with_a_reason() -> None:
    s = make_scheduler(num_kv_blocks=4, max_model_len=64)
    too_long = make_seq(0, prompt_len=60, max_tokens=10)
    assert "context length" in (s.add(too_long) or "")
    assert too_long.finish_reason is FinishReason.REJECTED
    too_big = make_seq(1, prompt_len=20, max_tokens=10)
    reason = s.add(too_big) or ""
    assert "KV blocks" in reason and "num_kv_blocks" in reason
    s2 = make_scheduler(enable_chunked_prefill=False, max_num_batched_tokens=16)
    assert "chunked prefill" in (s2.add(make_seq(0, prompt_len=20)) or "")
    assert not s.has_unfinished() and s.num_rejected == 2


def test_stop_conditions() -> None:
    s = make_scheduler()
    eos = Sequence(0, [5, 6], SamplingParams(max_tokens=10))
    stop_id = Sequence(1, [5, 6], SamplingParams(max_tokens=10, stop_token_ids=(11,)))
    by_text = Sequence(2, [5, 6], SamplingParams(max_tokens=10))
    for q in (eos, stop_id, by_text):
        s.add(q)
    plan = s.schedule()
    out = s.update(plan, {0: EOS, 1: 11, 2: 12}, stopped={2})
    assert [o.finish_reason for o in out] == [FinishReason.STOP] * 3
    assert s.block_manager.num_free_blocks == s.config.num_kv_blocks


def test_ignore_eos_keeps_generating() -> None:
    s = make_scheduler()
    q = make_seq(0, max_tokens=3)
    s.add(q)
    for _ in range(3):
        plan = s.schedule()
        s.update(plan, {0: EOS})
    assert q.output_token_ids == [EOS] * 3 and q.finish_reason is FinishReason.LENGTH


def test_abort_frees_blocks_wherever_the_sequence_is() -> None:
    s = make_scheduler(max_num_seqs=1)
    s.add(make_seq(0))
    s.add(make_seq(1))
    plan = s.schedule()
    assert s.abort(0) and s.abort(1) and not s.abort(1)
    assert s.update(plan, fake_tokens(plan)) == []
    assert s.block_manager.num_free_blocks == s.config.num_kv_blocks and not s.has_unfinished()


def test_prefix_caching_skips_shared_prompt_blocks() -> None:
    s = make_scheduler(enable_prefix_caching=True)
    first = make_seq(0, prompt_len=13, max_tokens=2)
    s.add(first)
    run(s)
    second = Sequence(1, list(first.prompt_token_ids), SamplingParams(max_tokens=2), arrival=1.0)
    s.add(second)
    plan = s.schedule()
    assert plan.chunks[0].start == 12 and second.num_cached_tokens == 12
    run(s)
    assert s.block_manager.num_free_blocks == s.config.num_kv_blocks


@settings(max_examples=120, deadline=None)
@given(workload=workload, blocks=st.integers(12, 40), budget=st.integers(1, 48), seqs=st.integers(1, 6),
       policy=st.sampled_from(["fcfs", "priority"]), chunked=st.booleans(), prefix=st.booleans(),
       wait=st.sampled_from([0.0, 1.0, 3.0]))
def test_random_workloads_finish_with_every_block_free(workload: Work,
                                                       blocks: int, budget: int, seqs: int, policy: str,
                                                       chunked: bool, prefix: bool, wait: float) -> None:
    """Also: every admission follows the stated order at the step's time (nothing waiting was ahead of a
    sequence admitted), and the running queue is in that order, so victims are chosen by it too."""
    s = make_scheduler(num_kv_blocks=blocks, max_num_batched_tokens=budget, max_num_seqs=seqs,
                       policy=policy, enable_chunked_prefill=chunked, enable_prefix_caching=prefix,
                       max_priority_wait_s=wait)
    arrivals = Arrivals(workload)  # arrive by step number
    step = 0
    while arrivals or s.has_unfinished():
        arrivals.add_due(s, step)
        now = float(step)  # one second per step
        was_waiting = {q.seq_id for q in s.waiting}
        plan = s.schedule(now)
        check_step(s, plan)
        key = functools.partial(rule_key, now=now, policy=policy, wait=wait)
        for x in (s.seqs[c.seq_id] for c in plan.chunks if c.seq_id in was_waiting):
            assert all(key(x) < key(w) for w in s.waiting), "a waiting sequence was overtaken"
        assert [q.seq_id for q in s.running] == [q.seq_id for q in sorted(s.running, key=key)]
        if s.has_unfinished():
            assert not plan.is_empty, "no progress"
        for out in s.update(plan, fake_tokens(plan)):
            assert out.token_id >= 10
        step += 1
        assert step < 5000, "starvation: the workload did not finish"
    for q in arrivals.admitted:
        assert q.is_finished
        if q.finish_reason is not FinishReason.ABORT:
            assert q.num_output_tokens == q.params.max_tokens
    bm = s.block_manager
    assert bm.num_free_blocks == blocks and all(bm.ref_count(b) == 0 for b in range(blocks))
    assert not bm._tables


def test_the_same_scheduler_runs_in_the_simulator() -> None:
    from batchpilot.sim.llm import default_llm_cost_model, simulate_llm
    from batchpilot.sim.traces import Workload

    wl = Workload.from_columns("t", [0.0, 0.0, 0.01, 0.5], [40, 8, 300, 16], [5, 20, 3, 1])
    cfg = LLMSchedulerConfig(num_kv_blocks=30, block_size=4, max_num_batched_tokens=32)
    run = simulate_llm(wl, cfg, default_llm_cost_model())
    rep = run.report()
    assert rep.num_finished == 3 and rep.num_rejected == 1  # 300 + 3 tokens never fit 30 blocks of 4
    assert run.record.num_output[:2] == [5, 20] and run.record.num_output[3] == 1
    assert rep.ttft_p50 > 0 and rep.tpot_p50 > 0 and not run.stats.stalled
    # steps never exceed the token budget and the first step is the cost model's price for its shape
    assert max(run.record.step_tokens) <= 32
    assert run.record.step_duration[0] > default_llm_cost_model().latency_coef[0]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(1, 3000), max_size=80), st.integers(1, 4096))
def test_decode_groups_partition_the_decodes_within_the_token_bound(ctx: list[int], bound: int) -> None:
    from batchpilot.core.llm.scheduler import decode_groups

    ctx = sorted(ctx)
    groups = decode_groups(ctx, bound)
    assert [i for a, b in groups for i in range(a, b)] == list(range(len(ctx)))  # a partition, in order
    for a, b in groups:  # each run's padded keys within the bound, or one decode alone
        assert (b - a) * ctx[b - 1] <= bound or b - a == 1
    for (a, b), (c, _) in zip(groups, groups[1:], strict=False):  # a run ends where the next would pass it
        assert (b - a + 1) * ctx[c] > bound


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 96), st.sampled_from([256, 512, 1000, 2048, 4096]), st.sampled_from([1, 8, 16, 32]),
       st.integers(64, 8192), st.data())
def test_largest_gather_bounds_every_gather_and_is_reached(seqs: int, length: int, block: int, bound: int,
                                                           data: st.DataObject) -> None:
    """What the memory plan reserves for a gather (``largest_gather``) holds every run ``decode_groups``
    makes of any running set, and one full sequence, in whole blocks; and some running set reaches it."""
    from batchpilot.core.llm.config import largest_gather
    from batchpilot.core.llm.scheduler import decode_groups

    c = LLMSchedulerConfig(max_num_seqs=seqs, max_model_len=length, block_size=block, decode_run_tokens=bound,
                           num_kv_blocks=seqs * -(-length // block))
    peak = largest_gather(c)

    def blocks(t: int) -> int:
        return -(-t // block) * block

    assert blocks(length) <= peak <= seqs * blocks(length)
    ctx = sorted(data.draw(st.lists(st.integers(1, length), min_size=1, max_size=seqs)))
    assert max((b - a) * blocks(ctx[b - 1]) for a, b in decode_groups(ctx, bound)) <= peak
    runs = [(1, length)] + [(m, min(bound // m, length)) for m in range(2, seqs + 1) if bound // m >= 1]
    m, each = max(runs, key=lambda r: r[0] * blocks(r[1]))  # m decodes at context `each` (1: one alone)
    same = [each] * m
    assert max((b - a) * blocks(same[b - 1]) for a, b in decode_groups(same, bound)) == peak


def test_step_shape_counts_the_kv_the_runner_gathers() -> None:
    """Decodes are padded to the longest context of their group: 120/250/380 read 3 x 380."""
    from batchpilot.core.llm.config import DECODE_RUN_TOKENS
    from batchpilot.core.llm.scheduler import ScheduledChunk

    def dec(i: int, ctx: int) -> ScheduledChunk:
        return ScheduledChunk(i, ctx - 1, [5], [0], True, True)

    prefill = ScheduledChunk(9, 0, [7] * 10, [1], True, False)
    plan = StepPlan(0, [dec(0, 250), dec(1, 120), dec(2, 380), prefill])
    shape = plan.shape
    assert (shape.decode_seqs, shape.prefill_tokens) == (3, 10)
    assert shape.kv_tokens == 3 * 380 + 10
    # 30 decodes at 100-129: a run takes decodes while its padded keys stay within the bound
    many = StepPlan(0, [dec(i, 100 + i) for i in range(30)])
    first = max(k for k in range(1, 31) if k * (99 + k) <= DECODE_RUN_TOKENS)
    assert first < 30
    rest = 30 - first
    assert many.shape.kv_tokens == first * (99 + first) + rest * 129


def test_the_configured_decode_run_bound_reaches_the_plan_and_its_shape() -> None:
    from batchpilot.core.llm.scheduler import LLMScheduler

    kv = {}
    for bound in (2048, 100):
        sched = LLMScheduler(LLMSchedulerConfig(decode_run_tokens=bound, max_model_len=256))
        for i, prompt in enumerate((30, 40, 90)):
            assert sched.add(Sequence(i, [5] * prompt, SamplingParams(max_tokens=4, ignore_eos=True))) is None
        prefill = sched.schedule()
        sched.update(prefill, {c.seq_id: 9 for c in prefill.chunks if c.sample})
        decode = sched.schedule()  # three decodes at contexts 31, 41, 91
        assert decode.decode_run_tokens == bound and decode.shape.decode_seqs == 3
        kv[bound] = decode.shape.kv_tokens
    assert kv == {2048: 3 * 91, 100: 2 * 41 + 91}  # 100: runs [31, 41] and [91]
    with pytest.raises(ValueError, match="decode_run_tokens"):
        LLMSchedulerConfig(decode_run_tokens=0)


def test_a_preempted_recompute_longer_than_the_budget_is_chunked_even_with_chunking_off() -> None:
    """Found by the property test above in a fresh CI run: a 27-token prompt fits the 28-token budget,
    but after preemption its recompute is 32 tokens; with chunked prefill off it could never run."""
    s = make_scheduler(num_kv_blocks=12, max_num_batched_tokens=28, max_num_seqs=2,
                       enable_chunked_prefill=False)
    work = [(1, 1), (1, 1), (1, 1), (6, 8), (27, 7)]
    for i, (plen, mtok) in enumerate(work):
        assert s.add(Sequence(i, [7 + (i % 2)] * plen, SamplingParams(max_tokens=mtok, ignore_eos=True),
                              arrival=0.0)) is None
    preempted = False
    for _ in range(100):
        plan = s.schedule()
        preempted |= bool(plan.preempted)
        assert not plan.is_empty or not s.has_unfinished(), "stalled"
        assert plan.num_batched_tokens <= 28
        s.update(plan, fake_tokens(plan))
        if not s.has_unfinished():
            break
    assert preempted and not s.has_unfinished()
    assert s.block_manager.num_free_blocks == 12
