"""``RowPlan``: the row counts the LLM runner pads a step's token rows to (``models/llm/runner.py``)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from batchpilot.models.llm.runner import LOOKAHEAD, MARGIN, MAX_ROWS, RowPlan


def tiled(t: int) -> float:
    """Seconds of a matmul whose row counts of 3 mod 4 run a kernel twice as dear per row."""
    return 1.0 + t + (t if t % 4 == 3 else 0.0)


def test_pads_the_dear_counts_to_the_next_tile() -> None:
    plan = RowPlan.from_times([0.0] + [tiled(t) for t in range(1, MAX_ROWS + LOOKAHEAD + 1)])
    assert plan.rows(3) == 4 and plan.rows(7) == 8 and plan.rows(MAX_ROWS - 1) == MAX_ROWS
    assert plan.rows(4) == 4 and plan.rows(5) == 5 and plan.rows(1) == 1  # no faster count within reach
    assert plan.rows(MAX_ROWS + 1) == MAX_ROWS + 1 and plan.rows(500) == 500  # beyond the plan: exact
    assert plan.padded() == {t: t + 1 for t in range(3, MAX_ROWS, 4)}
    assert RowPlan().rows(3) == 3 and RowPlan().padded() == {}


@given(st.lists(st.floats(0.5, 2.0), min_size=MAX_ROWS + LOOKAHEAD, max_size=MAX_ROWS + LOOKAHEAD))
def test_a_padded_count_is_within_reach_and_faster_by_the_margin(times: list[float]) -> None:
    seconds = [0.0] + times
    plan = RowPlan.from_times(seconds)
    for t in range(1, MAX_ROWS + 1):
        r = plan.rows(t)
        assert t <= r <= t + LOOKAHEAD
        if r != t:
            assert seconds[r] < (1.0 - MARGIN) * seconds[t]
            assert seconds[r] == min(seconds[t: t + LOOKAHEAD + 1])
        else:
            assert min(seconds[t: t + LOOKAHEAD + 1]) >= (1.0 - MARGIN) * seconds[t]


def test_rejects_a_plan_that_drops_rows_and_too_few_timings() -> None:
    with pytest.raises(ValueError, match="fewer rows"):
        RowPlan((0, 1, 1))
    with pytest.raises(ValueError, match="timings"):
        RowPlan.from_times([0.0, 1.0, 1.0])


def test_measure_times_every_count_on_the_given_matrices() -> None:
    weights = [torch.randn(64, 32), torch.randn(32, 64)]
    plan = RowPlan.measure(weights, torch.device("cpu"), torch.float32, max_rows=8, lookahead=2, repeats=1)
    assert len(plan.pad_to) == 9
    assert all(t <= plan.rows(t) <= t + 2 for t in range(1, 9))
