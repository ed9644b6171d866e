"""CostModel: the fit recovers known coefficients, p99 >= mean, JSON round trip, the fast path."""

from __future__ import annotations

import random

import pytest

from batchpilot.core.costmodel import (
    ENCODER_FEATURES,
    LLM_FEATURES,
    PROFILED_ENCODER_FEATURES,
    BatchShape,
    CostModel,
    ProfilePoint,
    StepShape,
)

TRUE = (0.020, 0.001, 2.0e-4, 2.0e-7)


def grid() -> list[BatchShape]:
    return [BatchShape.padded([L] * n, L) for n in (1, 2, 4, 8, 16, 32) for L in (16, 64, 128, 256, 512)]


def points(noise: float = 0.0, seed: int = 0) -> list[ProfilePoint]:
    rnd = random.Random(seed)
    truth = CostModel(latency_coef=TRUE, memory_coef=(1e6, 0.0, 18_432.0, 48.0))
    return [ProfilePoint(s.features(), truth.latency(s) * (1 + rnd.uniform(-noise, noise)), truth.memory(s))
            for s in grid()]


def test_fit_recovers_known_coefficients() -> None:
    model = CostModel.fit(points())
    assert model.latency_coef == pytest.approx(TRUE, rel=1e-6)
    assert model.memory_coef == pytest.approx((1e6, 0.0, 18_432.0, 48.0), rel=1e-6, abs=1e-6)
    assert model.latency_q(grid()[3]) == pytest.approx(model.latency(grid()[3]), rel=1e-6)


def test_noisy_fit_predicts_a_pessimistic_quantile() -> None:
    model = CostModel.fit(points(noise=0.2, seed=1), quantile=0.99)
    for shape in grid():
        assert model.latency_q(shape) >= model.latency(shape)
    assert model.q_factor > 1.05  # 20% noise: the p99 sits well above the mean
    truth = CostModel(latency_coef=TRUE, memory_coef=(0.0,) * 4)
    for shape in grid():  # +-20% noise, 30 points: the mean stays within 15% of the truth
        assert model.latency(shape) == pytest.approx(truth.latency(shape), rel=0.15)


def test_coefficients_are_never_negative() -> None:
    pts = [ProfilePoint({"const": 1.0, "n": float(n), "tokens": 10.0 * n, "attn": 0.0}, 0.05 - 0.001 * n)
           for n in range(1, 20)]
    model = CostModel.fit(pts)
    assert all(c >= 0 for c in model.latency_coef)


def test_json_round_trip(tmp_path: object) -> None:
    from pathlib import Path

    model = CostModel.fit(points(noise=0.1), meta={"device": "cpu"})
    path = Path(str(tmp_path)) / "cost.json"
    model.save(path)
    back = CostModel.load(path)
    assert back.to_dict() == model.to_dict()
    assert back.latency_q(grid()[7]) == model.latency_q(grid()[7])
    wrapped = Path(str(tmp_path)) / "profile.json"  # a profile file holds the model next to its points
    import json

    wrapped.write_text(json.dumps({"cost_model": model.to_dict(), "points": []}))
    assert CostModel.load(wrapped).to_dict() == model.to_dict()


def test_bad_input_says_what_to_fix() -> None:
    with pytest.raises(ValueError, match="missing the field"):
        CostModel.from_dict({"feature_names": ["const"]})
    with pytest.raises(ValueError, match="one coefficient per feature"):
        CostModel(latency_coef=(1.0,))
    with pytest.raises(ValueError, match="at least"):
        CostModel.fit(points()[:2])
    with pytest.raises(ValueError, match="> 0"):
        CostModel.fit([ProfilePoint({"const": 1.0}, 0.0)] * 5, feature_names=("const",))


def test_fast_path_matches_the_shape_api() -> None:
    model = CostModel.default_cpu_minilm()
    for shape in [*grid(), BatchShape.ragged([3, 100, 512])]:
        assert model.batch_latency(shape.n, shape.tokens, shape.attn) == pytest.approx(model.latency(shape))
        assert model.batch_memory(shape.n, shape.tokens, shape.attn) == pytest.approx(model.memory(shape))
    # the stated default: batch 1 at 16 / 128 / 512 tokens
    got = [model.latency(BatchShape.padded([L], L)) for L in (16, 128, 512)]
    assert got == pytest.approx([0.0243, 0.0500, 0.1760], abs=5e-4)


def test_tokens_sq_is_fitted_from_tokens_and_priced_on_both_paths() -> None:
    """A batch of thousands of tokens costs more per token than the linear features say: the profiler
    fits ``tokens_sq`` too; shapes and logged features carry only ``tokens``, from which it is derived."""
    sq = 3.0e-9
    truth = CostModel(PROFILED_ENCODER_FEATURES, (*TRUE, sq), (1e6, 0.0, 18_432.0, 48.0, 0.5))
    shapes = [*grid(), BatchShape.ragged([300] * 16), BatchShape.ragged([5, 40, 250])]
    pts = [ProfilePoint(s.features(), truth.latency(s), truth.memory(s)) for s in shapes]
    assert "tokens_sq" not in shapes[0].features()
    model = CostModel.fit(pts, PROFILED_ENCODER_FEATURES)
    assert model.latency_coef == pytest.approx((*TRUE, sq), rel=1e-5)
    assert model.memory_coef[-1] == pytest.approx(0.5, rel=1e-5)
    big = BatchShape.ragged([300] * 16)
    assert model.latency(big) == pytest.approx(CostModel(latency_coef=TRUE, memory_coef=TRUE).latency(big)
                                               + sq * big.tokens ** 2)
    for shape in shapes:
        assert model.batch_latency(shape.n, shape.tokens, shape.attn) == pytest.approx(model.latency(shape))
        assert model.batch_memory(shape.n, shape.tokens, shape.attn) == pytest.approx(model.memory(shape))
        assert model.latency(dict(shape.features())) == pytest.approx(model.latency(shape))
    assert model.encoder_latency_coef == pytest.approx(TRUE)  # the planner's per-request slopes: linear
    # points with no quadratic cost give it none
    flat = CostModel(latency_coef=TRUE)
    linear = CostModel.fit([ProfilePoint(s.features(), flat.latency(s)) for s in shapes],
                           PROFILED_ENCODER_FEATURES)
    assert linear.latency_coef[-1] == pytest.approx(0.0, abs=1e-15)
    assert CostModel.from_dict(model.to_dict()).latency(big) == pytest.approx(model.latency(big))


def test_shapes_count_padding() -> None:
    padded = BatchShape.padded([10, 20, 30], 32)
    assert (padded.tokens, padded.attn, padded.useful_tokens) == (96, 3 * 32 * 32, 60)
    ragged = BatchShape.ragged([10, 20, 30])
    assert (ragged.tokens, ragged.attn, ragged.useful_tokens) == (60, 1400, 60)


def test_llm_step_shapes_fit_too() -> None:
    truth = CostModel(feature_names=LLM_FEATURES, latency_coef=(0.01, 1e-4, 5e-4, 1e-6, 1e-8, 0.006),
                      memory_coef=(0.0,) * 6)
    rnd = random.Random(3)
    pts = []
    for i in range(40):
        if i % 4 == 0:  # one decode alone: the single-row step that tells const from multi_row
            s = StepShape(0, 1, rnd.randint(1, 2048), 0)
        else:
            s = StepShape(rnd.randint(0, 2048), rnd.randint(2, 64), rnd.randint(0, 50_000),
                          rnd.randint(0, 10**6))
        pts.append(ProfilePoint(s.features(), truth.latency(s)))
    assert StepShape(0, 1, 10).features()["multi_row"] == 0.0
    assert StepShape(2, 0, 2).features()["multi_row"] == StepShape(0, 2, 10).features()["multi_row"] == 1.0
    model = CostModel.fit(pts, feature_names=LLM_FEATURES)
    assert model.latency_coef == pytest.approx(truth.latency_coef, rel=1e-5)
    assert model.encoder_latency_coef == (pytest.approx(0.01), 0.0, 0.0, 0.0)  # no encoder features


def test_sample_latency_is_driven_by_u() -> None:
    model = CostModel(latency_coef=TRUE, memory_coef=(0.0,) * 4, rel_residuals=(-0.1, 0.0, 0.3))
    shape = grid()[5]
    mean = model.latency(shape)
    assert model.sample_latency(shape, 0.0) == pytest.approx(mean * 0.9)
    assert model.sample_latency(shape, 0.99) == pytest.approx(mean * 1.3)
    assert ENCODER_FEATURES == ("const", "n", "tokens", "attn")
