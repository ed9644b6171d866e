"""The samples of one prompt (``n > 1``): one group, sharing the prompt's KV blocks, preempted together.

On a fake driver (``test_llm_scheduler``'s), no model: what the scheduler plans and the block manager holds.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from batchpilot.core.llm.scheduler import LLMScheduler
from batchpilot.core.llm.sequence import FinishReason, SamplingParams, Sequence
from test_llm_scheduler import check_step, fake_tokens, make_scheduler


def group(first_id: int, n: int, prompt: list[int], max_tokens: int = 4, arrival: float = 0.0
          ) -> list[Sequence]:
    return [Sequence(first_id + j, list(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                     arrival=arrival, group=first_id) for j in range(n)]


def test_samples_wait_for_the_prompt_then_share_its_full_blocks() -> None:
    s = make_scheduler(block_size=4, max_num_batched_tokens=64, enable_prefix_caching=False)
    prompt = list(range(100, 118))  # 18 tokens: 4 full blocks, then 2 tokens
    for seq in group(0, 4, prompt):
        assert s.add(seq) is None
    first = s.schedule()
    assert [c.seq_id for c in first.chunks] == [0]  # the samples wait for their first's prompt
    s.update(first, fake_tokens(first))
    second = s.schedule()
    assert sorted(c.seq_id for c in second.chunks) == [0, 1, 2, 3]
    table0 = s.block_manager.block_table(0)
    for sid in (1, 2, 3):
        chunk = next(c for c in second.chunks if c.seq_id == sid)
        assert chunk.start == 16 and chunk.num_tokens == 2  # only the tail after the shared blocks
        assert s.block_manager.block_table(sid)[:4] == table0[:4]
        assert s.block_manager.block_table(sid)[4] != table0[4]  # the partial block is each one's own
    assert all(s.block_manager.ref_count(b) == 4 for b in table0[:4])
    assert s.seqs[1].num_cached_tokens == 16


def test_four_samples_hold_fewer_blocks_than_four_requests() -> None:
    def peak(seqs: list[Sequence]) -> int:
        s = make_scheduler(block_size=4, max_num_batched_tokens=256, num_kv_blocks=256)
        for q in seqs:
            s.add(q)
        most = 0
        while s.has_unfinished():
            plan = s.schedule()
            s.update(plan, fake_tokens(plan))
            most = max(most, s.block_manager.num_used_blocks)
        return most

    prompt = list(range(100, 164))  # 64 tokens = 16 blocks
    alone = [Sequence(j, list(prompt), SamplingParams(max_tokens=8, ignore_eos=True)) for j in range(4)]
    assert peak(group(0, 4, prompt, max_tokens=8)) < peak(alone)
    assert peak(group(0, 4, prompt, max_tokens=8)) <= 16 + 4 * 3


def test_a_preempted_sample_takes_its_running_group_mates_with_it() -> None:
    s = make_scheduler(block_size=4, num_kv_blocks=14, max_num_batched_tokens=64)
    s.add(Sequence(100, list(range(40, 48)), SamplingParams(max_tokens=40, ignore_eos=True), arrival=-1.0))
    for q in group(0, 3, list(range(8)), max_tokens=40):
        s.add(q)
    preempted: list[int] = []
    while s.has_unfinished() and not preempted:
        plan = s.schedule()
        check_step(s, plan)
        preempted = plan.preempted
        s.update(plan, fake_tokens(plan))
    assert preempted, "the pool was meant to run out"
    assert set(preempted) >= {1, 2} or set(preempted) == {2}  # the tail of the group goes together


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 5), prompt_len=st.integers(1, 40), blocks=st.integers(24, 64),
       others=st.integers(0, 3), prefix=st.booleans())
def test_groups_always_finish_with_every_block_back(n: int, prompt_len: int, blocks: int, others: int,
                                                    prefix: bool) -> None:
    s: LLMScheduler = make_scheduler(block_size=4, num_kv_blocks=blocks, max_num_batched_tokens=32,
                                     enable_prefix_caching=prefix)
    seqs = group(0, n, list(range(200, 200 + prompt_len)), max_tokens=12)
    seqs += [Sequence(50 + k, list(range(300, 300 + prompt_len)), SamplingParams(max_tokens=12,
                      ignore_eos=True), arrival=0.5) for k in range(others)]
    for q in seqs:
        assert s.add(q) is None
    for _ in range(5000):
        if not s.has_unfinished():
            break
        plan = s.schedule()
        check_step(s, plan)
        assert not plan.is_empty
        s.update(plan, fake_tokens(plan))
    assert not s.has_unfinished()
    assert all(q.finish_reason is FinishReason.LENGTH and q.num_output_tokens == 12 for q in seqs)
    assert s.block_manager.num_used_blocks == 0


def test_min_tokens_holds_back_eos() -> None:
    s = make_scheduler()
    seq = Sequence(0, [5, 6, 7], SamplingParams(max_tokens=6, min_tokens=3))
    s.add(seq)
    plan = s.schedule()
    outs = s.update(plan, {0: 2})  # EOS as the first token: too early to stop
    assert outs[0].finish_reason is None
    for _ in range(3):  # EOS may be the 4th token: 3 come before it
        plan = s.schedule()
        s.update(plan, {0: 2})
    assert seq.finish_reason is FinishReason.STOP and seq.num_output_tokens == 4
