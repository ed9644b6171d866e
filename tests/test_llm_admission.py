"""LLM admission and deadlines in the core: a request's sequences admitted together or refused together
with a reason, the bound of ``max_num_seqs + max_waiting_seqs``, the routes' deadline, and the
scheduler's expiry step, on a fake clock (one second per step)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchpilot.core.llm.admission import (
    NEVER_FITS,
    QUEUE_FULL,
    QUOTA_CONCURRENCY,
    QUOTA_TOKENS,
    LLMAdmission,
    past_deadline,
    request_deadline,
)
from batchpilot.core.llm.config import LLMSchedulerConfig
from batchpilot.core.llm.scheduler import LLMScheduler
from batchpilot.core.llm.sequence import FinishReason, SamplingParams, SeqStatus, Sequence
from batchpilot.core.tenants import TenantSpec, TenantTable


def config(**kw: object) -> LLMSchedulerConfig:
    base: dict[str, object] = {"max_num_seqs": 2, "max_waiting_seqs": 1, "max_num_batched_tokens": 64,
                               "num_kv_blocks": 64, "block_size": 4, "max_model_len": 128}
    base.update(kw)
    return LLMSchedulerConfig(**base)  # type: ignore[arg-type]


def seq(seq_id: int, prompt_len: int = 8, max_tokens: int = 4, arrival: float = 0.0,
        deadline: float | None = None) -> Sequence:
    return Sequence(seq_id, [100 + (seq_id + i) % 50 for i in range(prompt_len)],
                    SamplingParams(max_tokens=max_tokens, ignore_eos=True), arrival=arrival,
                    deadline=deadline)


def test_a_request_is_admitted_with_all_its_prompts_or_refused_with_none() -> None:
    adm = LLMAdmission(config())  # at most 2 + 1 sequences
    assert adm.capacity == 3
    assert adm.admit([seq(0), seq(1)]) is None and adm.num_admitted == 2
    refusal = adm.admit([seq(2), seq(3)])  # one would fit, the request would not: neither is taken
    assert refusal is not None and refusal.reason == QUEUE_FULL and refusal.retry_after_s == 1.0
    assert "2 sequences admitted of at most 3" in refusal.message and "max_waiting_seqs" in refusal.message
    assert adm.num_admitted == 2 and adm.refused == {QUEUE_FULL: 1}
    assert adm.admit([seq(4)]) is None and adm.num_admitted == 3
    assert adm.room(1) is not None and adm.admit([seq(5)]) is not None
    adm.release(0)
    adm.release(1)
    assert adm.room(2) is None and adm.admit([seq(6), seq(7)]) is None and adm.num_admitted == 3


def test_asking_for_room_counts_a_refusal_as_the_requests_answer_and_admits_nothing() -> None:
    adm = LLMAdmission(config())  # at most 3 sequences
    assert adm.ask(3) is None and adm.num_admitted == 0 and not adm.refused
    assert adm.admit([seq(0), seq(1)]) is None
    refusal = adm.ask(2)
    assert refusal is not None and refusal.reason == QUEUE_FULL and refusal.retry_after_s == 1.0
    assert adm.num_admitted == 2 and adm.refused == {QUEUE_FULL: 1}
    assert adm.room(2) is not None and adm.refused == {QUEUE_FULL: 1}  # room alone counts nothing


def test_a_prompt_that_can_never_fit_refuses_the_request_whatever_the_load() -> None:
    adm = LLMAdmission(config())
    refusal = adm.admit([seq(0), seq(1, prompt_len=120, max_tokens=16)])  # 136 > max_model_len 128
    assert refusal is not None and refusal.reason == NEVER_FITS and refusal.retry_after_s is None
    assert "exceeds the model's context length of 128" in refusal.message and adm.num_admitted == 0
    assert adm.admit([seq(2), seq(3), seq(4)]) is None  # full now: a request that never fits is still 400
    refusal = adm.admit([seq(5, prompt_len=120, max_tokens=16)])
    assert refusal is not None and refusal.reason == NEVER_FITS
    assert adm.refused == {NEVER_FITS: 2}


def test_admission_refuses_misuse_saying_what_to_do() -> None:
    adm = LLMAdmission(config())
    with pytest.raises(ValueError, match="pass all of them together"):
        adm.admit([])
    with pytest.raises(ValueError, match="at least one sequence"):
        adm.room(0)
    with pytest.raises(ValueError, match="release each admitted sequence exactly once"):
        adm.release(7)  # never admitted
    assert adm.admit([seq(1)]) is None
    adm.release(1)
    with pytest.raises(ValueError, match="release each admitted sequence exactly once"):
        adm.release(1)  # twice


def test_the_deadline_is_the_request_timeout_or_sooner_when_the_request_asks() -> None:
    cfg = config(request_timeout_s=10.0)
    assert request_deadline(cfg, 5.0) == 15.0
    assert request_deadline(cfg, 5.0, 2.0) == 7.0
    assert request_deadline(cfg, 5.0, 30.0) == 15.0  # never later than the engine's timeout
    assert request_deadline(cfg, 5.0, 5e-324 / 1000.0) == 5.0  # the routes' tiniest deadline_ms: due at once
    for bad in (-1.0, float("nan")):
        with pytest.raises(ValueError, match="must be >= 0 seconds"):
            request_deadline(cfg, 5.0, bad)
    assert past_deadline(seq(0, deadline=3.0), 3.0) and not past_deadline(seq(0, deadline=3.0), 2.999)
    assert not past_deadline(seq(0), 1e18)


def test_expire_ends_the_sequences_past_their_deadline_wherever_they_are_and_frees_their_blocks() -> None:
    s = LLMScheduler(config(max_num_seqs=1))
    late_running, late_waiting, on_time = seq(0, deadline=2.0), seq(1, deadline=2.5), seq(2, deadline=9.0)
    for q in (late_running, late_waiting, on_time):
        assert s.add(q) is None
    plan = s.schedule(0.0)
    s.update(plan, {c.seq_id: 10 for c in plan.chunks if c.sample})
    assert late_running.status is SeqStatus.RUNNING and s.block_manager.num_free_blocks < 64
    assert s.expire(1.999) == []
    assert s.expire(2.5) == [late_running, late_waiting]
    assert all(q.finish_reason is FinishReason.EXPIRED for q in (late_running, late_waiting))
    assert s.block_manager.num_free_blocks == 64 and list(s.seqs) == [2]
    assert s.expire(2.5) == []  # each sequence expires once
    while s.has_unfinished():
        plan = s.schedule(3.0)
        s.update(plan, {c.seq_id: 10 for c in plan.chunks if c.sample})
    assert on_time.finish_reason is FinishReason.LENGTH


# (number of prompts, prompt length, max_tokens, arrival step, deadline after arrival in steps or None)
requests = st.lists(st.tuples(st.integers(1, 3), st.integers(1, 60), st.integers(1, 10), st.integers(0, 8),
                              st.one_of(st.none(), st.integers(0, 12))), min_size=1, max_size=16)


@settings(max_examples=150, deadline=None)
@given(work=requests, seqs=st.integers(1, 4), waiting=st.integers(0, 4), blocks=st.integers(12, 40),
       preemption=st.sampled_from(["recompute", "swap", "auto"]))
def test_no_sequence_is_lost_or_duplicated_and_refused_requests_leave_nothing_behind(
        work: list[tuple[int, int, int, int, int | None]], seqs: int, waiting: int, blocks: int,
        preemption: str) -> None:
    """A driver as the engine and the simulator run one: admit each request whole, expire before each
    step, release each sequence once when it ends. Every sequence ends exactly one way (finished,
    expired, or refused with its whole request: too long for the pool, or past the bound); expired ones
    free their blocks, at the first step at or after their deadline, and nothing finishes after it."""
    cfg = config(max_num_seqs=seqs, max_waiting_seqs=waiting, num_kv_blocks=blocks, max_model_len=64,
                 preemption=preemption, num_swap_blocks=8, max_num_batched_tokens=24)
    s, adm = LLMScheduler(cfg), LLMAdmission(cfg)
    pending = sorted(enumerate(work), key=lambda x: x[1][3])
    ended: dict[int, str] = {}  # seq id -> how it ended
    by_id: dict[int, Sequence] = {}
    refused_groups: list[list[Sequence]] = []
    next_id, step = 0, 0
    while pending or s.has_unfinished():
        now = float(step)
        while pending and pending[0][1][3] <= step:
            _, (n, plen, mtok, _, after) = pending.pop(0)
            due = None if after is None else now + after
            group = [seq(next_id + k, plen, mtok, now, due) for k in range(n)]
            next_id += n
            by_id.update({q.seq_id: q for q in group})
            before = (adm.num_admitted, set(s.seqs))
            if adm.admit(group) is not None:
                assert (adm.num_admitted, set(s.seqs)) == before  # nothing admitted, nothing queued
                refused_groups.append(group)
                ended.update({q.seq_id: "refused" for q in group})
                continue
            for q in group:
                assert s.add(q) is None  # admission ran the scheduler's own fit test
        for q in s.expire(now):
            assert q.deadline is not None and q.deadline <= now < q.deadline + 1
            assert q.seq_id not in ended
            ended[q.seq_id] = "expired"
            adm.release(q.seq_id)
        assert adm.num_admitted == len(s.seqs) <= adm.capacity
        plan = s.schedule(now)
        assert not plan.is_empty or not s.has_unfinished(), "stalled"
        for out in s.update(plan, {c.seq_id: 10 for c in plan.chunks if c.sample}):
            if out.finish_reason is not None:
                assert out.seq_id not in ended and not past_deadline(by_id[out.seq_id], now)
                ended[out.seq_id] = "finished"
                adm.release(out.seq_id)
        step += 1
        assert step < 2000, "the workload did not finish"
    assert sorted(ended) == list(range(next_id))  # every sequence ended, each once
    assert adm.num_admitted == 0 and not s.seqs and not adm.held
    assert all(st.in_progress == 0 for _, st in adm.tenants)  # every request ended in its tenant's usage
    assert s.block_manager.num_free_blocks == blocks and s.swap_space.num_free_blocks == 8
    for group in refused_groups:  # untouched: never queued, never finished
        assert all(q.status is SeqStatus.WAITING and q.finish_reason is None and not q.num_computed_tokens
                   for q in group)


def test_a_tenants_quotas_hold_for_its_llm_requests() -> None:
    """The keys file's quotas on the LLM path: the token bucket is charged a request's prompts plus
    max_tokens (all its sequences together); requests in progress are counted until their last sequence
    is released; refusals carry the quota's reason and Retry-After, counted per tenant."""
    adm = LLMAdmission(config(max_num_seqs=8, max_waiting_seqs=8))
    adm.set_tenants(TenantTable({"t": TenantSpec(tokens_per_s=10.0, burst_tokens=30.0,
                                                 max_concurrent_requests=1)}), 0.0)

    def of(i: int, tenant: str = "t") -> Sequence:
        q = seq(i, prompt_len=8, max_tokens=4)
        q.tenant = tenant
        return q
    assert adm.admit([of(0)], now=0.0) is None  # 12 tokens of 30
    busy = adm.admit([of(1)], now=0.0)
    assert busy is not None and busy.reason == QUOTA_CONCURRENCY  # one request in progress
    adm.release(0)
    assert adm.admit([of(2)], now=0.0) is None  # 24 of 30
    adm.release(2)
    late = adm.admit([of(3)], now=0.0)  # 6 left for 12: 0.6 s to refill
    assert late is not None and late.reason == QUOTA_TOKENS and late.retry_after_s == pytest.approx(0.6)
    assert adm.admit([of(4), of(5)], now=10.0) is None  # refilled: 24 tokens for two prompts at once
    adm.release(4)
    assert adm.ask(1, "t", 10.0) is not None  # the request is in progress until its last sequence ends
    adm.release(5)
    never = adm.admit([of(6), of(7), of(8)], now=100.0)  # 36 tokens > the burst of 30: never
    assert never is not None and never.reason == QUOTA_TOKENS and never.retry_after_s is None
    assert adm.admit([of(9, "other")], now=0.0) is None  # no quota for a tenant the table leaves out
    usage = dict(adm.tenants)
    assert usage["t"].requests == 3 and usage["t"].tokens == 48
    assert usage["t"].rejected == {QUOTA_CONCURRENCY: 2, QUOTA_TOKENS: 2}
