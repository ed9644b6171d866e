"""BatchPlanner: groupings, padding modes, budgets, and the DP against brute force."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchpilot.core.bucketing import Bucketer
from batchpilot.core.config import BucketingConfig, PlannerConfig
from batchpilot.core.costmodel import CostModel
from batchpilot.core.planner import BatchPlanner, partition
from core_factories import make_request, simple_cost_model

COST = simple_cost_model(const=0.010, per_token=1e-4)


def planner(cost: CostModel = COST, **kw: object) -> BatchPlanner:
    cfg = PlannerConfig(**{"padding": "dynamic", **kw})  # type: ignore[arg-type]
    bucketer = Bucketer(BucketingConfig(boundaries=(32, 64, 128)), cost, cfg.max_len)
    return BatchPlanner(cfg, cost, bucketer)


def reqs(*lengths: int) -> list:  # type: ignore[type-arg]
    return [make_request(n, float(i)) for i, n in enumerate(lengths)]


def test_fifo_takes_queue_order_up_to_the_cap() -> None:
    rs = reqs(10, 500, 20, 30)
    plan = planner(grouping="fifo").plan(rs, cap=3)
    assert plan.requests == rs[:3]
    assert plan.padded_len == 500 and plan.shape.tokens == 1500 and plan.wasted_tokens == 1500 - 530


def test_fifo_stops_at_the_token_budget() -> None:
    rs = reqs(100, 100, 300, 10)
    plan = planner(grouping="fifo", max_batch_tokens=400).plan(rs, cap=8)
    assert plan.requests == rs[:2]  # the third would pad 3 x 300 = 900 > 400: FIFO stops there


def test_memory_budget_limits_the_batch() -> None:
    cost = CostModel(latency_coef=(0.01, 0.0, 1e-4, 0.0), memory_coef=(0.0, 0.0, 1000.0, 0.0))
    plan = planner(cost, grouping="fifo", max_batch_memory_bytes=250_000).plan(reqs(*[100] * 8), cap=8)
    assert plan.shape.n == 2 and cost.memory(plan.shape) <= 250_000


@pytest.mark.parametrize(("padding", "multiple", "expect_len", "expect_tokens"), [
    ("max", 1, 512, 3 * 512), ("dynamic", 1, 70, 210), ("dynamic", 16, 80, 240),
    ("bucket", 1, 128, 384), ("none", 1, 70, 10 + 20 + 70),
])
def test_padding_modes(padding: str, multiple: int, expect_len: int, expect_tokens: int) -> None:
    p = planner(grouping="fifo", padding=padding, pad_to_multiple_of=multiple)
    plan = p.plan(reqs(10, 20, 70), cap=3)
    assert plan.padded_len == expect_len
    assert plan.shape.tokens == expect_tokens
    assert plan.shape.useful_tokens == 100


def test_pad_to_multiple_never_exceeds_max_len() -> None:
    p = planner(grouping="fifo", padding="dynamic", pad_to_multiple_of=64, max_len=500)
    plan = p.plan(reqs(490), cap=1)
    assert plan.padded_len == 500


def test_sorted_groups_similar_lengths() -> None:
    rs = reqs(400, 10, 410, 12, 405, 11)
    plan = planner(grouping="sorted", lookahead=4).plan(rs, cap=3)
    assert sorted(r.length for r in plan.requests) in ([10, 11, 12], [400, 405, 410])


def test_sorted_keeps_the_urgent_head_in_the_batch() -> None:
    rs = reqs(400, 10, 12, 11, 13)
    lazy = planner(grouping="sorted").plan(rs, cap=3, urgent=False)
    assert rs[0] not in lazy.requests  # the short ones pack better
    urgent = planner(grouping="sorted").plan(rs, cap=3, urgent=True)
    assert rs[0] in urgent.requests


def test_bucket_grouping_takes_the_fullest_bucket_or_the_heads() -> None:
    rs = reqs(100, 10, 12, 20, 120)
    p = planner(grouping="bucket", padding="bucket")
    plan = p.plan(rs, cap=8)
    assert [r.length for r in plan.requests] == [10, 12, 20] and plan.padded_len == 32
    plan = p.plan(rs, cap=8, urgent=True)
    assert [r.length for r in plan.requests] == [100, 120] and plan.padded_len == 128


def test_num_candidates_is_the_bounded_lookahead() -> None:
    assert planner(grouping="fifo").num_candidates(8) == 8
    assert planner(grouping="sorted", lookahead=3).num_candidates(8) == 24


def test_dp_reuses_its_partition_only_while_it_is_valid() -> None:
    p = planner(grouping="dp", lookahead=4)
    rs = reqs(*([10] * 6 + [400] * 6))
    first = p.plan(rs, cap=6)
    rest = [r for r in rs if r not in first.requests]
    second = p.plan(rest, cap=6)
    assert {r.length for r in first.requests} != {r.length for r in second.requests}
    assert sorted(first.requests + second.requests, key=lambda r: r.id) == rs
    # a cancelled request invalidates the cache: the DP runs again on what is left
    p.plan(rs, cap=6)
    survivors = rs[:3] + rs[4:6]  # one of the cached group's members is gone
    plan = p.plan([r for r in survivors if r.length == 10] + rs[6:], cap=6)
    assert all(r in survivors + rs[6:] for r in plan.requests)


def _brute_force(lens: list[int], cap: int, planner_: BatchPlanner) -> float:
    """Cheapest split of the sorted lengths into contiguous feasible groups, by enumeration."""
    k = len(lens)
    best = float("inf")
    for cuts in itertools.product([0, 1], repeat=k - 1):
        bounds = [0] + [i + 1 for i, c in enumerate(cuts) if c] + [k]
        total = 0.0
        for s, e in itertools.pairwise(bounds):
            group = lens[s:e]
            if len(group) > cap:
                total = float("inf")
                break
            plan = planner_._make([make_request(n) for n in group])
            if planner_.config.max_batch_tokens and plan.shape.tokens > planner_.config.max_batch_tokens:
                total = float("inf")
                break
            total += plan.predicted_s
        best = min(best, total)
    return best


@settings(max_examples=80, deadline=None)
@given(lens=st.lists(st.integers(1, 300), min_size=1, max_size=9), cap=st.integers(1, 5),
       padding=st.sampled_from(["dynamic", "bucket"]), budget=st.sampled_from([0, 900]),
       attn=st.sampled_from([0.0, 1e-7]))
def test_dp_partition_is_optimal(lens: list[int], cap: int, padding: str, budget: int, attn: float) -> None:
    cost = simple_cost_model(const=0.010, per_req=0.001, per_token=1e-4, attn=attn)
    p = planner(cost, grouping="dp", padding=padding, max_batch_tokens=budget, max_len=300)
    rs = reqs(*lens)
    chosen = p._sorted(rs, cap, urgent=False, dp=True)  # the dispatched group; the rest are cached
    groups = [chosen] + [g for g, _ in p._dp_cache.groups]
    assert sorted(r.id for g in groups for r in g) == sorted(r.id for r in rs)
    total = sum(p._make(g).predicted_s for g in groups)
    assert total == pytest.approx(_brute_force(sorted(lens), cap, p), rel=1e-9)


def test_partition_handles_a_single_candidate() -> None:
    assert partition(1, [0, 0], lambda s, e: 1.0, None) == [(0, 1)]


@pytest.mark.parametrize("grouping", ["sorted", "dp"])
def test_padding_free_batches_keep_queue_order(grouping: str) -> None:
    # Padding-free, a batch costs the same however it is grouped: reordering would only pass over
    # the requests ahead (the short ones would go first, the long head's neighbours last)
    rs = reqs(400, 10, 410, 12, 405, 11, 20)
    plan = planner(grouping=grouping, padding="none", lookahead=4).plan(rs, cap=3)
    assert plan.requests == rs[:3]
