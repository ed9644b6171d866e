"""``sim.llm``: the step profile's measured shape read back as a factor on the line's price."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from batchpilot.core.costmodel import LLM_FEATURES, CostModel, StepShape
from batchpilot.sim.llm import StepPricer, StepShapeTable, step_point_shape

LINE = (0.01, 2e-4, 5e-4, 1e-6, 0.0, 0.0)
PREFILLS = (16, 64, 256)
DECODES = (1, 2, 4, 16, 64)
CONTEXTS = (64, 512)
MIXED = ((64, 1), (64, 4), (256, 1), (256, 4))


def bump(prompts: list[int], decodes: int, context: int) -> float:
    """A made-up measured/line ratio per grid point: stairs the line cannot follow."""
    return 1.0 + 0.1 * math.sin(decodes + 0.01 * context + 0.1 * sum(prompts))


def model(skip: tuple[int, int] | None = None) -> CostModel:
    points = [([n], 0, 1) for n in PREFILLS] + [([], b, c) for b in DECODES for c in CONTEXTS
                                                 if (b, c) != skip] + [([p], b, 512) for p, b in MIXED]
    line = CostModel(feature_names=LLM_FEATURES, latency_coef=LINE, memory_coef=(0.0,) * 6)
    step_points = [{"prefills": pre, "decodes": b, "context": c,
                    "latency_s": line.latency(step_point_shape(pre, b, c)) * bump(pre, b, c)}
                   for pre, b, c in points]
    return CostModel(feature_names=LLM_FEATURES, latency_coef=LINE, memory_coef=(0.0,) * 6,
                     meta={"step_points": step_points})


def test_the_price_of_every_grid_point_is_its_measured_time() -> None:
    cm = model()
    pricer = StepPricer(cm)
    for p in cm.meta["step_points"]:
        shape = step_point_shape(p["prefills"], p["decodes"], p["context"])
        assert pricer.latency(shape) == pytest.approx(p["latency_s"], rel=1e-9)
        assert pricer.latency(shape.features()) == pytest.approx(p["latency_s"], rel=1e-9)


@given(st.integers(1, 1000), st.integers(0, 200), st.integers(1, 4000))
def test_between_and_beyond_the_grid_the_factor_stays_within_the_grids_own(prompt: int, decodes: int,
                                                                         context: int) -> None:
    """Interpolated between grid points and held at the edges beyond them: never outside the range of
    the measured ratios (0.9-1.1 here)."""
    table = StepShapeTable.from_cost_model(model())
    b = max(decodes, 1)
    for shape in (StepShape(prompt, 0, prompt, prompt**2), StepShape(0, b, b * context),
                  StepShape(prompt, b, prompt + b * context, prompt**2)):
        assert 0.9 - 1e-9 <= table.factor(shape) <= 1.1 + 1e-9


def test_a_decode_batch_the_profile_skipped_takes_its_nearest_context() -> None:
    """The profile leaves out decode batches larger than the KV pool (64 decodes at 512 here)."""
    table = StepShapeTable.from_cost_model(model(skip=(64, 512)))
    assert table.factor(StepShape(0, 64, 64 * 512)) == pytest.approx(bump([], 64, 64))


def test_a_profile_without_its_grid_prices_at_the_line() -> None:
    line = CostModel(feature_names=LLM_FEATURES, latency_coef=LINE, memory_coef=(0.0,) * 6)
    pricer = StepPricer(line)
    for shape in (StepShape(100, 0, 100, 10**4), StepShape(0, 8, 800), StepShape(50, 3, 400, 2500)):
        assert pricer.latency(shape) == line.latency(shape)
    assert StepShapeTable.from_cost_model(line).factor({"const": 1.0}) == 1.0


@given(st.floats(-1.0, 6.0), st.floats(-1.0, 8.0))
def test_the_two_row_interpolation_is_the_bilinear_one_over_every_row(x: float, y: float) -> None:
    """``Grid2`` reads only the two rows around ``x``: the same value as interpolating every row at
    ``y`` and then the column at ``x`` (held at the edges on both axes)."""
    import numpy as np

    grid = StepShapeTable.from_cost_model(model()).decode
    assert grid is not None
    column = np.array([np.interp(y, grid.y, row) for row in grid.z])
    assert grid(x, y) == pytest.approx(float(np.interp(x, grid.x, column)), abs=1e-12)
