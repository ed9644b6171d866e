"""BlockManager: allocation, reference counts, failed allocations, prefix caching, counters."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchpilot.core.llm.blocks import BlockManager, NoFreeBlocksError


def snapshot(bm: BlockManager) -> tuple[object, ...]:
    return (
        [bm.ref_count(b) for b in range(bm.num_blocks)],
        list(bm._free), dict(bm._cache), {k: list(v) for k, v in bm._tables.items()},
        dict(bm._num_slots_used), dict(bm._num_hashed),
    )


def test_allocate_grows_by_blocks_and_free_returns_them() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    assert bm.can_allocate(1, 5)
    bm.allocate(1, 5)
    assert len(bm.block_table(1)) == 2 and bm.num_free_blocks == 2
    bm.allocate(1, 8)  # still two blocks
    assert len(bm.block_table(1)) == 2
    bm.append_slot(1)  # token 9 needs a third block
    assert len(bm.block_table(1)) == 3
    bm.free(1)
    assert bm.num_free_blocks == 4 and all(bm.ref_count(b) == 0 for b in range(4))


def test_failed_allocation_changes_nothing() -> None:
    bm = BlockManager(num_blocks=3, block_size=2)
    bm.allocate(1, 4)
    before = snapshot(bm)
    assert not bm.can_allocate(2, 3)
    with pytest.raises(NoFreeBlocksError):
        bm.allocate(2, 3)
    assert snapshot(bm) == before
    assert bm.stats().num_failed_allocations == 1


def test_fragmentation_and_usage_counters() -> None:
    bm = BlockManager(num_blocks=10, block_size=4)
    bm.allocate(1, 5)  # 2 blocks, 8 slots, 5 used
    s = bm.stats()
    assert s.num_used == 2 and s.usage == pytest.approx(0.2)
    assert s.fragmentation == pytest.approx(3 / 8)
    bm.free(1)
    assert bm.stats().fragmentation == 0.0


def test_prefix_cache_shares_full_computed_blocks() -> None:
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    prompt = list(range(10))  # two full blocks + 2 tokens
    assert bm.allocate(1, 10, prompt) == 0
    assert bm.num_cached_tokens(2, prompt) == 0  # not computed yet: nothing to share
    bm.on_computed(1, prompt, 10)
    assert bm.num_cached_tokens(2, prompt) == 8
    assert bm.allocate(2, 10, prompt) == 8
    t1, t2 = bm.block_table(1), bm.block_table(2)
    assert t1[:2] == t2[:2] and t1[2] != t2[2]
    assert [bm.ref_count(b) for b in t1[:2]] == [2, 2]
    bm.free(1)
    bm.free(2)
    assert all(bm.ref_count(b) == 0 for b in range(8)) and bm.num_free_blocks == 8
    # freed but still keyed: a third prompt with the same prefix revives them
    assert bm.stats().num_cached_free == 2
    assert bm.allocate(3, 12, prompt + [77, 78]) == 8


def test_prefix_cache_never_covers_the_last_token() -> None:
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    prompt = list(range(8))
    bm.allocate(1, 8, prompt)
    bm.on_computed(1, prompt, 8)
    assert bm.num_cached_tokens(2, prompt) == 4  # the last token must be computed to get logits


def test_evicted_block_loses_its_key() -> None:
    bm = BlockManager(num_blocks=2, block_size=2, enable_prefix_caching=True)
    prompt = [1, 2, 3]
    bm.allocate(1, 3, prompt)
    bm.on_computed(1, prompt, 3)
    bm.free(1)
    bm.allocate(2, 4, [9, 9, 9, 9])  # takes both blocks, overwriting the cached one
    assert bm.num_cached_tokens(3, prompt) == 0


ops = st.lists(
    st.tuples(st.sampled_from(["alloc", "append", "free", "computed"]), st.integers(0, 4),
              st.integers(1, 40), st.integers(0, 2)),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(ops=ops, prefix=st.booleans())
def test_random_ops_keep_invariants_and_end_with_everything_free(ops: list[tuple[str, int, int, int]],
                                                                 prefix: bool) -> None:
    bm = BlockManager(num_blocks=12, block_size=4, enable_prefix_caching=prefix)
    prompts = {i: [i % 2] * 40 for i in range(5)}  # two families of identical prompts
    for op, seq, n, _ in ops:
        before = snapshot(bm)
        try:
            if op == "alloc":
                bm.allocate(seq, n, prompts[seq])
            elif op == "append":
                bm.append_slot(seq)
            elif op == "computed":
                bm.on_computed(seq, prompts[seq], min(n, len(bm.block_table(seq)) * 4))
            else:
                bm.free(seq)
        except NoFreeBlocksError:
            assert snapshot(bm) == before
        refs = [0] * bm.num_blocks
        for t in bm._tables.values():
            for b in t:
                refs[b] += 1
        assert refs == [bm.ref_count(b) for b in range(bm.num_blocks)]
        assert set(bm._free) == {b for b in range(bm.num_blocks) if refs[b] == 0}
        assert all(bm._key_of[b] == k for k, b in bm._cache.items())
        assert bm.stats().num_cached_free == sum(1 for b in bm._free if bm._key_of[b] is not None)
    for seq in range(5):
        bm.free(seq)
    assert bm.num_free_blocks == bm.num_blocks
    assert all(bm.ref_count(b) == 0 for b in range(bm.num_blocks))
