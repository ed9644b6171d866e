"""The moving average of the gaps between arrivals (core/arrivals.py), against a plain reference."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from batchpilot.core.arrivals import GapAverage


@given(st.lists(st.floats(0.0, 100.0), max_size=40), st.floats(0.01, 1.0))
def test_the_average_weights_each_new_gap_by_alpha(times: list[float], alpha: float) -> None:
    g = GapAverage(alpha)
    mean, last = math.inf, -math.inf
    for t in times:
        g.observe(t)
        if last > -math.inf:
            gap = max(t - last, 0.0)  # an event stamped before the last counts as no gap
            mean = gap if mean == math.inf else alpha * gap + (1 - alpha) * mean
        last = max(last, t)
    assert g.last == last
    assert (g.mean_s == mean == math.inf) or g.mean_s == pytest.approx(mean, abs=1e-12)


def test_two_events_make_a_mean_and_a_bad_weight_is_refused() -> None:
    g = GapAverage(0.5)
    g.observe(1.0)
    assert g.mean_s == math.inf  # one event: no gap yet
    g.observe(3.0)
    assert g.mean_s == 2.0
    g.observe(4.0)
    assert g.mean_s == 1.5
    for bad in (0.0, -0.1, 1.5):
        with pytest.raises(ValueError, match=r"\(0, 1\]"):
            GapAverage(bad)
