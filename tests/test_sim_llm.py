"""The simulator's LLM target admits and expires requests by the core's rules, as the live engine does,
and counts a refused or expired request the way the load generator counts an error answer."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from batchpilot.core.costmodel import LLM_FEATURES, CostModel, StepShape
from batchpilot.core.deployment import resolve_llm_deployment
from batchpilot.core.llm.admission import LLMAdmission
from batchpilot.core.llm.config import LLMSchedulerConfig
from batchpilot.core.llm.scheduler import LLMScheduler
from batchpilot.core.llm.sequence import SamplingParams, Sequence
from batchpilot.settings import add_deployment_args, add_llm_args, spec_from_args
from batchpilot.sim.engine import Engine
from batchpilot.sim.llm import (
    LLMServiceModel,
    LLMTarget,
    StepPricer,
    StepShapeTable,
    default_llm_cost_model,
    simulate_llm,
    step_point_shape,
)
from batchpilot.sim.traces import Workload

SMALL = {"max_num_seqs": 2, "max_num_batched_tokens": 64, "num_kv_blocks": 256, "block_size": 16}


def burst(n: int, at: float = 0.0, output: int = 20) -> Workload:
    return Workload.from_columns("burst", [at] * n, [32] * n, [output] * n)


def test_the_simulator_refuses_what_passes_the_waiting_bound_as_the_server_answers_503() -> None:
    cfg = LLMSchedulerConfig(**SMALL, max_waiting_seqs=3)  # at most 2 + 3 sequences admitted
    rep = simulate_llm(burst(12), cfg).report()
    assert rep.num_rejected == 7 and rep.rejected_by_reason == {"queue_full": 7}
    assert rep.num_finished == 5
    assert any("queue_full 7" in value for _, value in rep.rows())
    roomy = simulate_llm(burst(12), LLMSchedulerConfig(**SMALL)).report()  # the default bound: 2 + 256
    assert roomy.num_rejected == 0 and roomy.num_finished == 12


def test_the_simulator_refuses_the_requests_the_core_refuses_in_arrival_order() -> None:
    cfg = LLMSchedulerConfig(**SMALL, max_waiting_seqs=1)
    wl = Workload.from_columns("w", [0.0, 0.0, 0.0, 0.0, 60.0], [32] * 5, [20] * 5)
    run = simulate_llm(wl, cfg)
    adm = LLMAdmission(cfg)  # the same calls by hand: three admitted, the fourth refused
    expect = [adm.admit([Sequence(i, [3] * 32, SamplingParams(max_tokens=20), arrival=0.0)])
              for i in range(4)]
    assert [r is not None for r in expect] == [False, False, False, True]
    assert run.record.rejected == [None, None, None, "queue_full", None]  # by 60 s the queue has drained


def test_a_request_past_the_request_timeout_expires_and_frees_its_blocks() -> None:
    cfg = LLMSchedulerConfig(**SMALL, request_timeout_s=0.5)
    wl = burst(6, output=200)  # far longer than 0.5 s on the default cost model
    sched = LLMScheduler(cfg)
    target = LLMTarget(sched, wl, default_llm_cost_model())
    stats = Engine(target, num_slots=1).run(wl.arrival_s)  # type: ignore[arg-type]
    rec = target.record
    assert not stats.stalled and rec.rejected == ["timeout"] * 6
    assert any(n > 0 for n in rec.num_output)  # some had streamed tokens: still not served
    assert sched.block_manager.num_free_blocks == 256 and target.admission.num_admitted == 0
    assert all(t >= 0.5 for t in rec.finish_s)  # each at the first step after its deadline


def test_the_flags_the_server_takes_make_the_simulator_predict_its_refusals() -> None:
    p = argparse.ArgumentParser()
    add_deployment_args(p)
    add_llm_args(p)
    spec = spec_from_args(p.parse_args(["--max-num-seqs", "2", "--max-concurrency", "4",
                                        "--request-timeout-s", "1000"]))
    config = resolve_llm_deployment(spec).config
    assert (config.max_waiting_seqs, config.request_timeout_s) == (2, 1000.0)
    rep = simulate_llm(burst(10), config).report()
    assert rep.rejected_by_reason == {"queue_full": 6} and rep.num_finished == 4


# ``sim.llm``: the step profile's measured shape read back as a factor on the line's price.

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


# ``sim.llm.LLMServiceModel``: the step terms the serving path adds, fitted on logged steps.

MODEL = CostModel(feature_names=("const", "prefill_tokens", "decode_seqs", "kv_tokens", "prefill_attn",
                                 "multi_row"),
                  latency_coef=(0.01, 2e-4, 5e-4, 1e-6, 0.0, 0.0), memory_coef=(0.0,) * 6)


@given(st.floats(0.5, 3.0), st.floats(0.0, 0.005), st.floats(0.0, 0.001), st.integers(0, 3))
def test_fit_recovers_the_step_terms_of_steps_made_by_them(alpha: float, const: float, per_seq: float,
                                                           idle_every: int) -> None:
    true = LLMServiceModel(0.004, alpha, const, per_seq)
    starts, fwd, wall, seqs, feats, after_idle = [], [], [], [], [], []
    t, idle = 0.0, False
    for k in range(40):
        n = 1 + k % 9
        f = StepShape(16 * (k % 3), n, 100 * n).features()
        pred = MODEL.latency(f)
        starts.append(t)
        after_idle.append(idle)
        fwd.append(alpha * pred)
        cost = true.step_seconds(pred, n)
        seqs.append(n)
        feats.append(f)
        idle = bool(idle_every and k % (idle_every + 2) == 0) or k >= 38  # an idle wait (or the end) next
        # a step going straight on costs its interval to the next start (30% of it between the steps);
        # one before an idle wait costs its own wall time, the wait excluded
        wall.append(cost if idle else 0.7 * cost)
        t += cost + (0.5 if idle else 0.0)
    fe, details = LLMServiceModel.fit_steps(MODEL, starts, fwd, wall, seqs, feats, after_idle, 0.004)
    assert fe.step_alpha == pytest.approx(alpha)
    assert fe.step_const_s == pytest.approx(const, abs=1e-9)
    assert fe.step_per_seq_s == pytest.approx(per_seq, abs=1e-9)
    assert fe.first_token_delay_s == 0.004 and details["steps"] == 40


def test_too_few_steps_add_nothing_but_the_delay_and_bad_values_are_refused() -> None:
    fe, details = LLMServiceModel.fit_steps(MODEL, [0.0], [0.01], [0.01], [1],
                                            [StepShape(0, 1, 10).features()], [True], 0.003)
    assert fe == LLMServiceModel(0.003) and "too few" in details["note"]
    assert LLMServiceModel().step_seconds(0.02, 5) == 0.02
    with pytest.raises(ValueError, match="step_alpha"):
        LLMServiceModel(step_alpha=float("nan"))
    with pytest.raises(ValueError, match="step_per_seq_s"):
        LLMServiceModel(step_per_seq_s=-1e-3)


@given(st.lists(st.floats(0.6, 1.6), min_size=6, max_size=6), st.floats(0.5, 2.0))
def test_the_forward_is_priced_per_count_of_sequences(speeds: list[float], alpha: float) -> None:
    """Steps whose forward runs at a different speed per bin of sequences (as live steps of two or
    three sequences ran over the step model and the others under it): with many steps in every bin,
    the fitted forward factor of each bin is its speed, and a bin's steps are priced at their own
    total; the totals over all steps agree exactly."""
    bins = (1, 2, 4, 8, 16, 32)
    counts = [n for lo in bins for n in [lo] * 300]
    fwd, feats, starts = [], [], []
    t = 0.0
    for n in counts:
        f = StepShape(0, n, 100 * n).features()
        speed = speeds[max(i for i, lo in enumerate(bins) if n >= lo)]
        fwd.append(alpha * speed * MODEL.latency(f))
        feats.append(f)
        starts.append(t)
        t += fwd[-1]
    fe, details = LLMServiceModel.fit_steps(MODEL, starts, fwd, fwd, counts, feats, [False] * len(counts))
    priced = [fe.forward_factor(n) * MODEL.latency(f) for n, f in zip(counts, feats, strict=True)]
    assert sum(priced) == pytest.approx(sum(fwd))
    for lo, speed in zip(bins, speeds, strict=True):
        got = fe.forward_factor(lo) / fe.forward_factor(1) * speeds[0]
        assert got == pytest.approx(speed, rel=0.05)
    assert [lo for lo, _ in fe.step_seq_factors] == list(bins) and details["seq_factor_steps"] == [300] * 6


@given(st.floats(0.6, 1.6), st.floats(0.6, 1.6), st.floats(0.6, 1.6), st.integers(20, 200))
def test_steps_with_a_prefill_are_priced_apart_from_the_decodes(decode_lo: float, decode_hi: float,
                                                                 prefill: float, prefill_steps: int) -> None:
    """Decode-only steps that run at one speed under 8 sequences and another from 8, and steps with a
    prefill chunk at a third speed at every count, in any mix: each kind is priced at its own speed
    (the prefill factor within its prior's pull towards ``step_alpha``), and the decodes' factors are
    not pulled towards the prefills' speed by sharing a bin with them."""
    rows = [(n, False) for n in (2, 12) for _ in range(300)] + [(n, True) for n in (2, 12)
                                                               for _ in range(prefill_steps)]
    fwd, feats, counts = [], [], []
    for n, with_prefill in rows:
        f = StepShape(64 if with_prefill else 0, n, 100 * n).features()
        speed = prefill if with_prefill else (decode_lo if n < 8 else decode_hi)
        fwd.append(speed * MODEL.latency(f))
        feats.append(f)
        counts.append(n)
    starts = list(range(len(rows)))
    fe, details = LLMServiceModel.fit_steps(MODEL, starts, fwd, fwd, counts, feats, [False] * len(rows))
    assert fe.forward_factor(2) == pytest.approx(decode_lo, rel=0.05)  # 300 steps beside a prior of 10
    assert fe.forward_factor(12) == pytest.approx(decode_hi, rel=0.05)
    pull = 10.0 / (10.0 + prefill_steps * 2)  # SEQ_PRIOR_STEPS steps at 1 beside the prefill steps
    assert abs(fe.forward_factor(2, prefill=True) - prefill) <= abs(fe.step_alpha - prefill) * pull + 1e-9
    assert fe.forward_factor(12, prefill=True) == fe.forward_factor(2, prefill=True)
    assert details["prefill_steps"] == 2 * prefill_steps and sum(details["seq_factor_steps"]) == 600


def test_seq_factors_survive_the_profile_file_and_bad_ones_are_refused(tmp_path: Path) -> None:
    fe = LLMServiceModel(0.002, 1.1, 0.001, 1e-4, ((1, 0.9), (2, 1.2), (4, 1.0)))
    assert [fe.forward_factor(n) for n in (1, 2, 3, 4, 64)] == pytest.approx([0.99, 1.32, 1.32, 1.1, 1.1])
    assert fe.step_seconds(0.01, 2) == pytest.approx(1.32 * 0.01 + 0.001 + 2e-4)
    assert fe.step_seconds(0.01, 2, prefill=True) == pytest.approx(1.1 * 0.01 + 0.001 + 2e-4)
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"cost_model": {}, "service": fe.to_dict()}))
    assert LLMServiceModel.from_profile(path) == fe
    with_prefill = LLMServiceModel(step_alpha=2.0, prefill_factor=0.9)
    path.write_text(json.dumps({"cost_model": {}, "service": with_prefill.to_dict()}))
    assert LLMServiceModel.from_profile(path).forward_factor(3, prefill=True) == pytest.approx(1.8)
    assert LLMServiceModel(step_alpha=1.3).forward_factor(7) == 1.3  # a profile without factors
    for bad in (((1, 0.0),), ((2, 1.0), (1, 1.0)), ((1, float("nan")),)):
        with pytest.raises(ValueError, match="step_seq_factors"):
            LLMServiceModel(step_seq_factors=bad)


def test_from_profile_reads_the_service_entry(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    entry = {"first_token_delay_s": 0.002, "step_alpha": 1.2, "other": 5}
    path.write_text(json.dumps({"cost_model": {}, "service": entry}))
    assert LLMServiceModel.from_profile(path) == LLMServiceModel(0.002, 1.2)
    path.write_text(json.dumps({"cost_model": {}}))
    assert LLMServiceModel.from_profile(path) == LLMServiceModel()


def test_a_few_steps_at_many_sequences_count_as_much_as_many_at_few() -> None:
    """Open-loop steps at 1-3 sequences outnumber a burst's (one per count from 4 to 64) a hundredfold;
    the line still follows the whole range (here the cost per sequence grows past 3), and the report
    says which sequences per step it covered."""
    def extra(n: int) -> float:  # beyond the forward
        return 0.002 + 2e-4 * n + 2e-4 * max(n - 3, 0) + (5e-4 if n == 1 else 0.0)

    counts = [1, 2, 3] * 2000 + list(range(4, 65))
    starts, fwd, wall, feats = [], [], [], []
    t = 0.0
    for n in counts:
        f = StepShape(0, n, 100 * n).features()
        pred = MODEL.latency(f)
        starts.append(t)
        fwd.append(pred)
        wall.append(pred + extra(n))
        feats.append(f)
        t += pred + extra(n)
    fe, details = LLMServiceModel.fit_steps(MODEL, starts, fwd, wall, counts, feats, [False] * len(counts))
    assert fe.step_alpha == pytest.approx(1.0)
    for n in (32, 51, 64):  # where a loaded server runs (a line over every step misses by 4-5%)
        assert fe.step_const_s + fe.step_per_seq_s * n == pytest.approx(extra(n), rel=0.02)
    assert details["max_seqs"] == 64 and details["seqs_levels"] == 64
    assert details["mean_seqs"] == pytest.approx(sum(counts) / len(counts))
    assert details["p90_seqs"] == 3.0


def test_the_step_models_own_error_does_not_tilt_the_overhead_line() -> None:
    """The forward runs 0.75x its prediction at one sequence and 0.9x at 64 (a step model off by a
    different fraction at each end); the overhead beyond the forward is 0.8 ms + 0.05 ms a sequence.
    The line prices that overhead, not the step model's error: measured against ``step_alpha`` times
    the prediction instead, the slope came out two thirds steeper and the constant zero."""
    counts = list(range(1, 65)) * 20
    starts, fwd, wall, feats = [], [], [], []
    t = 0.0
    for n in counts:
        f = StepShape(0, n, 100 * n).features()
        forward = MODEL.latency(f) * (0.75 + 0.15 * (n - 1) / 63)
        cost = forward + 8e-4 + 5e-5 * n
        starts.append(t)
        fwd.append(forward)
        wall.append(cost)
        feats.append(f)
        t += cost
    fe, _ = LLMServiceModel.fit_steps(MODEL, starts, fwd, wall, counts, feats, [False] * len(counts))
    assert fe.step_const_s == pytest.approx(8e-4, rel=1e-6)
    assert fe.step_per_seq_s == pytest.approx(5e-5, rel=1e-6)


def test_an_older_profile_is_refused_and_without_removes_exactly_one_term(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"cost_model": {}, "frontend": {"step_alpha": 1.2}}))
    with pytest.raises(ValueError, match="older batchpilot version"):
        LLMServiceModel.from_profile(path)
    fe = LLMServiceModel(0.002, 1.1, 0.001, 1e-4, ((1, 0.9), (2, 1.2)), 0.9)
    assert set(LLMServiceModel.TERMS) == {"first-token delay", "step speed", "step overhead",
                                          "sequence factors", "prefill factor"}
    assert fe.without("first-token delay").first_token_delay_s == 0.0
    assert fe.without("step speed").step_alpha == 1.0
    assert fe.without("step overhead") == LLMServiceModel(0.002, 1.1, 0.0, 0.0, ((1, 0.9), (2, 1.2)), 0.9)
    assert fe.without("sequence factors").step_seq_factors == ()
    assert fe.without("prefill factor").prefill_factor == 1.0
