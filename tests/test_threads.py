"""The per-batch thread plan (models/encoder.py): pure choice from times, and the real encoder using it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from batchpilot.models.device import available_cores
from batchpilot.models.encoder import (
    PROBE_SHAPES,
    EncoderExecutor,
    ThreadPlan,
    candidate_counts,
    choose_thread_plan,
    plan_for,
    plan_from_times,
)
from batchpilot.models.tasks import load_model


@pytest.fixture(scope="module")
def encoder() -> EncoderExecutor:
    """The embedded model as ``serve`` loads it without ``--threads``: its plan measured at load."""
    return load_model(None, dtype="float32")


def test_small_batches_on_one_thread_large_on_two() -> None:
    times = {16: {1: 3.6, 2: 8.9}, 160: {1: 20.0, 2: 21.0}, 1024: {1: 130.0, 2: 90.0}}
    plan = plan_from_times(times)
    assert plan.steps == ((0, 1), (1024, 2))
    assert [plan.threads_for(t) for t in (1, 16, 1023, 1024, 5000)] == [1, 1, 1, 2, 2]
    assert plan.max_threads == 2 and "2 from 1024 tokens" in plan.describe()


def test_fewer_threads_win_within_the_margin() -> None:
    assert plan_from_times({100: {1: 10.4, 2: 10.0}}).steps == ((0, 1),)  # 4% slower: fewer threads
    assert plan_from_times({100: {1: 10.6, 2: 10.0}}).steps == ((0, 2),)  # 6% slower: the faster


@given(st.dictionaries(st.integers(1, 4096), st.fixed_dictionaries(
    {1: st.floats(0.1, 1e3), 2: st.floats(0.1, 1e3), 4: st.floats(0.1, 1e3)}), min_size=1, max_size=8))
def test_a_plan_never_falls_and_each_shape_gets_a_near_fastest_or_larger_count(
        times: dict[int, dict[int, float]]) -> None:
    plan = plan_from_times(times)  # __post_init__ checks the steps ascend and never fall
    for tokens, by in times.items():
        chosen = plan.threads_for(tokens)
        near = [t for t, ms in by.items() if ms <= min(by.values()) * 1.05]
        assert chosen in by and chosen >= min(near)
    assert ThreadPlan.from_json(plan.to_json()) == plan


@pytest.mark.parametrize("steps", [(), ((5, 1),), ((0, 2), (100, 1)), ((0, 1), (0, 2)), ((0, 0),)])
def test_malformed_plans_are_refused(steps: tuple[tuple[int, int], ...]) -> None:
    with pytest.raises(ValueError):
        ThreadPlan(steps)


def test_candidate_counts_double_up_to_the_cores() -> None:
    assert candidate_counts(1) == [1] and candidate_counts(2) == [1, 2]
    assert candidate_counts(6) == [1, 2, 4, 6] and candidate_counts(8) == [1, 2, 4, 8]


def test_one_core_is_one_thread_unmeasured() -> None:
    calls: list[tuple[int, int]] = []
    assert choose_thread_plan(lambda n, k: calls.append((n, k)), cores=1).steps == ((0, 1),)
    assert calls == []


def test_the_probe_times_every_count_and_restores_the_pool() -> None:
    seen: list[tuple[int, int, int]] = []
    before = torch.get_num_threads()
    plan = choose_thread_plan(lambda n, k: seen.append((n, k, torch.get_num_threads())), cores=2,
                              repeats=1, shapes=((1, 16), (4, 128)))
    assert {(n, k, t) for n, k, t in seen} == {(1, 16, 1), (1, 16, 2), (4, 128, 1), (4, 128, 2)}
    assert set(plan.measured) == {16, 512} and torch.get_num_threads() == 2
    torch.set_num_threads(before)


def test_loading_without_a_count_measures_a_plan(encoder: EncoderExecutor) -> None:
    plan = encoder.threads
    assert plan is not None and plan.max_threads <= available_cores()
    assert available_cores() == 1 or set(plan.measured) == {n * k for n, k in PROBE_SHAPES}


def test_the_encoder_runs_each_batch_on_its_planned_count(encoder: EncoderExecutor) -> None:
    ids = encoder.tokenize(["a short query", "a longer passage " * 40])
    before = encoder.encode(ids, padding="none")
    saved, pool = encoder.threads, torch.get_num_threads()
    try:
        encoder.threads = ThreadPlan(((0, 1), (100, 2)))
        assert plan_for(encoder, 1).steps == ((0, 1),)  # an explicit count wins over any plan
        assert plan_for(encoder, None, encoder.threads) is encoder.threads  # a profile's plan is kept
        encoder.encode([ids[0]], padding="none")
        assert torch.get_num_threads() == 1
        np.testing.assert_allclose(encoder.encode(ids, padding="none"), before, atol=1e-5)
        assert torch.get_num_threads() == 2  # the two inputs hold more than 100 tokens
    finally:
        encoder.threads = saved
        torch.set_num_threads(pool)
