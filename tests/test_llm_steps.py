"""The live step log: reading it while it grows, and the run's steps against the step profile."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from batchpilot.bench.llm_fidelity import (
    LoggedStep,
    comparison_rows,
    read_steps,
    repeat_rows,
    simulate,
    speed_vs_profile,
)
from batchpilot.core.costmodel import LLM_FEATURES, CostModel
from batchpilot.runtime.llm.engine import StepLog, StepRecord

TRUE = {"const": 0.008, "prefill_tokens": 4e-4, "decode_seqs": 6e-4, "kv_tokens": 2e-6, "prefill_attn": 0.0,
        "multi_row": 0.005}
PROFILE = CostModel(LLM_FEATURES, tuple(TRUE[f] for f in LLM_FEATURES), (0.0,) * len(LLM_FEATURES),
                    meta={"source": "p"})


def _feats(prefill: int, decodes: int, ctx: int) -> dict[str, float]:
    return {"const": 1.0, "prefill_tokens": float(prefill), "decode_seqs": float(decodes),
            "kv_tokens": float(decodes * ctx + prefill), "prefill_attn": float(prefill * prefill),
            "multi_row": float(prefill + decodes >= 2)}


def _cost(f: dict[str, float]) -> float:
    return sum(TRUE[k] * v for k, v in f.items())


def test_read_steps_takes_whole_lines_and_resumes(tmp_path: Path) -> None:
    log = StepLog(str(tmp_path / "s.jsonl"))
    log(StepRecord(0, 1.0, 0.01, 0.008, 1, _feats(16, 0, 0), True))
    log(StepRecord(1, 1.02, 0.01, 0.008, 2, _feats(0, 2, 40), False))
    log.flush()  # what the log's writer thread does every journal.FLUSH_S
    steps, off = read_steps(tmp_path / "s.jsonl")
    assert [s.start for s in steps] == [1.0, 1.02] and steps[0].after_idle and not steps[1].after_idle
    assert steps[1].seqs == 2 and steps[1].features == _feats(0, 2, 40)
    with open(tmp_path / "s.jsonl", "a") as f:  # a line the server is still writing
        f.write(json.dumps({"start": 2.0})[:7])
    more, off2 = read_steps(tmp_path / "s.jsonl", off)
    assert more == [] and off2 == off
    log.close()
    log(StepRecord(2, 3.0, 0.01, 0.008, 1, _feats(0, 1, 9), False))  # after close: dropped, no error


def test_speed_vs_profile_on_a_hand_built_step_log(tmp_path: Path) -> None:
    """Total logged wall seconds over the profile's total on the same shapes, minus 1: the dear steps
    weigh by their cost, idle gaps between steps do not count, and the log is read from an offset."""
    shapes = [_feats(128, 0, 0), _feats(0, 1, 200), _feats(0, 4, 300), _feats(64, 3, 250)]
    log = StepLog(str(tmp_path / "steps.jsonl"))
    log(StepRecord(0, 0.0, 5.0, 4.0, 1, _feats(512, 0, 0), True))  # before the measured run: skipped
    log.close()
    offset = (tmp_path / "steps.jsonl").stat().st_size
    log = StepLog(str(tmp_path / "steps.jsonl"))
    t = 100.0
    for i, (f, scale) in enumerate(zip(shapes, (1.0, 1.2, 1.1, 1.0), strict=True)):
        log(StepRecord(i + 1, t, _cost(f) * scale, _cost(f) * scale * 0.9, 1, f, i == 2))
        t += 10.0  # long idle gaps: not step time
    log.close()
    steps, _ = read_steps(tmp_path / "steps.jsonl", offset)
    assert len(steps) == 4
    expected = sum(_cost(f) * s for f, s in zip(shapes, (1.0, 1.2, 1.1, 1.0), strict=True))
    assert speed_vs_profile(PROFILE, steps) == pytest.approx(expected / sum(_cost(f) for f in shapes) - 1)
    assert speed_vs_profile(PROFILE, steps[:1]) == pytest.approx(0.0)  # ran exactly as profiled
    assert math.isnan(speed_vs_profile(PROFILE, []))
    half = [LoggedStep(s.start, s.wall_s / 2, s.forward_s / 2, s.seqs, s.after_idle, s.features)
            for s in steps]
    assert speed_vs_profile(PROFILE, half) == pytest.approx((expected / 2) / sum(map(_cost, shapes)) - 1)


def test_comparison_rows_targets_and_speed_column() -> None:
    """Every metric row of a point, its target and verdict, and the point's speed on each row."""
    from batchpilot.bench.records import RequestRecord, summarize
    from batchpilot.core.llm.config import LLMSchedulerConfig
    from batchpilot.sim.traces import Workload

    wl = Workload.from_columns("t", [0.0, 0.5, 1.0, 1.5], [32, 64, 16, 40], [8, 8, 4, 6])
    pred, rep = simulate(wl, LLMSchedulerConfig(), PROFILE, 2.0)
    assert rep.num_rejected == 0 and pred.ttft["p50"] > 0 and pred.output_tokens_per_s > 0
    recs = [RequestRecord(i, t, 32, 8, sent_s=t, done_s=t + 0.2, status=200, latency_s=0.2, ttft_s=0.05,
                          tokens_received=8) for i, t in enumerate((0.0, 0.5, 1.0))]
    recs.append(RequestRecord(3, 1.5, 40, 6, sent_s=1.5, done_s=1.51, status=503, latency_s=0.01))
    meas = summarize(recs, 2.0)
    rows = comparison_rows(0.5, 0.25, pred, 0, meas, 0.071)
    assert [r[2] for r in rows] == ["TTFT P50 ms", "TTFT P99 ms", "TPOT P50 ms", "TPOT P99 ms",
                                    "output tok/s", "rejected"]
    assert [r[6] for r in rows] == ["10%"] * 4 + ["5%", "10% or 5"]
    assert all(r[8] == "+7.1%" for r in rows) and rows[0][4] == "50.00"
    assert rows[-1][3:6] == ["0", "1", "-1"] and rows[-1][7] == "yes"  # one refusal: within 5 requests
    assert comparison_rows(0.5, 0.25, pred, 20, meas, math.nan)[-1][7:] == ["no", "-", "-", "-"]
    # with a speed check before the point: its speed and the profile-alone prediction's error beside
    checked = comparison_rows(0.5, 0.25, pred, 0, meas, 0.071, 0.05, (pred, 3))
    assert all(r[9] == "+5.0%" for r in checked)
    assert checked[0][10] == checked[0][5] and checked[-1][10] == "+2"  # alone = pred here; 3 vs 1 refused


def test_repeat_rows_score_the_second_replay_against_the_first() -> None:
    """A replay is scored against the first under the prediction's targets: 10% on the latencies, 5% on
    the tokens per second, 10% or 5 on the refusals."""
    from batchpilot.bench.records import RequestRecord, summarize

    def run(ttft: float, latency: float, refused: int) -> Any:
        recs = [RequestRecord(i, i * 0.5, 32, 8, sent_s=i * 0.5, done_s=i * 0.5 + latency, status=200,
                              latency_s=latency, ttft_s=ttft, tokens_received=8) for i in range(20)]
        recs += [RequestRecord(20 + i, 10.0, 40, 6, sent_s=10.0, done_s=10.01, status=503, latency_s=0.01)
                 for i in range(refused)]
        return summarize(recs, 2.0)

    first = run(0.050, 0.2, 0)
    rows = repeat_rows(0.8, first, run(0.053, 0.2, 4), (0.02, -0.01))
    assert [r[1] for r in rows] == ["TTFT P50 ms", "TTFT P99 ms", "TPOT P50 ms", "TPOT P99 ms",
                                    "output tok/s", "rejected"]
    assert rows[0][2:6] == ["50.00", "53.00", "+6.0%", "yes"]
    assert rows[2][5] == "yes"  # TPOT: the same 0.2 s less a TTFT 3 ms longer, over the same tokens
    assert rows[-1][2:6] == ["0", "4", "+4", "yes"] and all(r[6] == "+2.0% / -1.0%" for r in rows)
    slow = repeat_rows(0.8, first, run(0.060, 0.3, 9), (math.nan, math.nan))
    assert slow[0][5] == slow[2][5] == slow[-1][5] == "no" and slow[0][6] == "- / -"


def test_llm_points_are_scored_against_the_replays_spread_with_the_shared_scoring() -> None:
    """TTFT/TPOT (ms), tokens/s and refusals of each replay go through ``fidelity.spread_cells``."""
    from batchpilot.bench.fidelity import matrix_score, spread_cells
    from batchpilot.bench.llm_fidelity import SPREAD_METRICS, spread_values
    from batchpilot.bench.records import RequestRecord, summarize

    def run(ttft: float, refused: int) -> Any:
        recs = [RequestRecord(i, i * 0.5, 32, 8, sent_s=i * 0.5, done_s=i * 0.5 + 0.2, status=200,
                              latency_s=0.2, ttft_s=ttft, tokens_received=8) for i in range(20)]
        recs += [RequestRecord(20 + i, 10.0, 40, 6, sent_s=10.0, done_s=10.01, status=503, latency_s=0.01)
                 for i in range(refused)]
        return summarize(recs, 2.0)

    replays = [run(0.050, 0), run(0.060, 2), run(0.040, 0)]
    values = [spread_values(r, r.num_requests - r.num_ok) for r in replays]
    assert values[0][0] == pytest.approx(50.0) and values[1][-1] == 2.0
    assert SPREAD_METRICS[-1] == "rejected" and len(values[0]) == len(SPREAD_METRICS)
    predicted = [70.0, *values[0][1:]]  # TTFT P50 70 ms: above 60 * 1.1 = 66
    cells = spread_cells(0.5, SPREAD_METRICS, predicted, values)
    assert cells[0].median == pytest.approx(50.0) and not cells[0].inside and cells[0].error > 0
    assert cells[-1].inside  # 0 refused predicted, median 0
    score = matrix_score(cells)
    assert score["latency_cells"] == 4 and score["bias"]["TTFT P50 ms"] == pytest.approx(0.4)


def test_speed_vs_profile_with_the_serving_path_counts_the_interval_to_the_next_busy_step() -> None:
    """Against the profile's serving path a busy step costs the interval to the next step's start (the
    gap between steps included), a step before an idle wait its own wall time."""
    from batchpilot.sim.llm import LLMFrontEnd

    fe = LLMFrontEnd(step_alpha=1.0, step_const_s=0.001, step_per_seq_s=0.0005)
    f = _feats(0, 2, 100)
    priced = fe.step_seconds(_cost(f), 2)
    steps = [LoggedStep(0.0, priced - 0.001, 0.0, 2, False, f),  # next starts after exactly `priced`
             LoggedStep(priced, priced, 0.0, 2, False, f),  # next after an idle wait: its wall time
             LoggedStep(50.0, priced, 0.0, 2, True, f)]
    assert speed_vs_profile(PROFILE, steps, fe) == pytest.approx(0.0)
    slow = [LoggedStep(s.start * 2, s.wall_s * 2, 0.0, 2, s.after_idle, f) for s in steps]
    assert speed_vs_profile(PROFILE, slow, fe) == pytest.approx(1.0)


def test_speed_by_seqs_splits_the_forward_from_the_overhead_per_count_of_sequences(tmp_path: Path) -> None:
    """Steps of 1 sequence run their forward as priced and their overhead twice the line; steps of 40,
    the forward 10% over and the overhead as priced. The breakdown says which part moved where, and
    the module's command prints it for a fidelity folder."""
    from batchpilot.bench.llm_fidelity import speed_by_seqs
    from batchpilot.bench.llm_fidelity import steps_main as main
    from batchpilot.sim.llm import LLMFrontEnd

    fe = LLMFrontEnd(step_alpha=1.2, step_const_s=0.001, step_per_seq_s=0.0001)
    steps, t = [], 0.0
    for k in range(20):
        n = 1 if k % 2 else 40
        f = _feats(0, n, 100)
        forward = 1.2 * _cost(f) * (1.0 if n == 1 else 1.1)
        rest = (0.001 + 0.0001 * n) * (2.0 if n == 1 else 1.0)
        steps.append(LoggedStep(t, forward + rest, forward, n, False, f))
        t += forward + rest
    rows = speed_by_seqs(PROFILE, steps, fe)
    assert [(r[0], r[1]) for r in rows] == [("1", 10), ("32+", 10)]
    assert rows[0][2:] == pytest.approx((0.0, 1.0)) and rows[1][2] == pytest.approx(0.1)
    assert rows[1][3] == pytest.approx(0.0, abs=0.02)  # the last step's cycle is its wall time: exact too
    assert speed_by_seqs(PROFILE, [], fe) == []
    by_count = speed_by_seqs(PROFILE, steps, fe, [(1, 1), (2, 39), (40, 40)])  # an empty bin is left out
    assert [(r[0], r[1]) for r in by_count] == [("1", 10), ("40", 10)]
    assert by_count[1][2] == pytest.approx(0.1)
    log = StepLog(str(tmp_path / "steps.jsonl"))
    for k, s in enumerate(steps):
        log(StepRecord(k, s.start, s.wall_s, s.forward_s, s.seqs, s.features, s.after_idle))
    log.close()
    (tmp_path / "llm_profile.json").write_text(json.dumps({"cost_model": PROFILE.to_dict(),
                                                            "frontend": fe.to_dict()}))
    assert main([str(tmp_path)]) == 0 and main([]) == 2 and main([str(tmp_path), "--by-count"]) == 0
    profile = tmp_path / "llm_profile.json"
    assert main([str(tmp_path), str(profile)]) == 0
    assert main([str(tmp_path), str(tmp_path / "missing.json")]) == 2
    assert main([str(tmp_path), "--by-kind"]) == 0


def test_speed_by_seqs_by_kind_keeps_each_steps_cycle_to_the_next_logged_step() -> None:
    """Decode-only steps alternating with steps that carry a prefill: each kind's rows price only its
    own steps, and a step's overhead is still its interval to the very next step, whatever its kind
    (a filtered list would stretch each cycle over the other kind's step)."""
    from batchpilot.bench.llm_fidelity import speed_by_seqs
    from batchpilot.sim.llm import LLMFrontEnd

    fe = LLMFrontEnd(step_alpha=1.0, step_const_s=0.001, step_per_seq_s=0.0, prefill_factor=2.0)
    steps, t = [], 0.0
    for k in range(20):
        with_prefill = k % 2 == 1
        f = _feats(64 if with_prefill else 0, 4, 100)
        forward = _cost(f) * (2.0 if with_prefill else 1.0)  # each kind at its own factor
        steps.append(LoggedStep(t, forward + 0.001, forward, 4, False, f))
        t += forward + (0.003 if with_prefill else 0.001)  # prefill steps: three times the overhead
    decode = speed_by_seqs(PROFILE, steps, fe, prefill=False)
    prefill = speed_by_seqs(PROFILE, steps, fe, prefill=True)
    assert [(r[0], r[1]) for r in decode] == [("4-7", 10)]
    assert [(r[0], r[1]) for r in prefill] == [("4-7", 10)]
    assert decode[0][2:] == pytest.approx((0.0, 0.0)) and prefill[0][2] == pytest.approx(0.0)
    assert prefill[0][3] == pytest.approx(1.8)  # nine of ten at 3x; the last one's own wall time
