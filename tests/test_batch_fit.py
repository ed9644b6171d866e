"""The live batch log's reader and the speed fit on it (``bench.batch_fit``)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from batchpilot.bench.batch_fit import LoggedBatch, calibration_rows, fit_live_batches, read_batches
from batchpilot.core.costmodel import BatchShape, CostModel
from batchpilot.sim.traces import Workload

PROFILE = CostModel(latency_coef=(0.008, 0.0005, 0.0003, 2.5e-7), meta={"source": "test"})


def _batch(lengths: list[int], slot_s: float, start: float = 0.0) -> LoggedBatch:
    return LoggedBatch(start, slot_s, len(lengths), BatchShape.ragged(lengths).features())


def test_read_batches_takes_whole_lines_and_resumes(tmp_path: Path) -> None:
    path = tmp_path / "b.jsonl"
    rows = [{"batch": i, "start": float(i), "slot_s": 0.01 * (i + 1), "n": 1, "predicted_s": 0.01,
             "features": BatchShape.ragged([8 * (i + 1)]).features()} for i in range(2)]
    half = json.dumps(rows[0])[:12]  # a line the server is still writing
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + half)
    got, off = read_batches(path)
    assert [b.slot_s for b in got] == [0.01, 0.02] and got[1].features["tokens"] == 16.0
    assert off == path.read_bytes().rfind(b"\n") + 1
    with open(path, "a") as f:
        f.write(json.dumps(rows[0])[12:] + "\n")  # the server finishes the line
    more, off2 = read_batches(path, off)
    assert len(more) == 1 and more[0].start == 0.0 and off2 == path.stat().st_size


def test_fit_recovers_speed_and_per_batch_cost_on_the_profile_shape() -> None:
    """Live batches = 1.3 x the profile + 2 ms (with 3% noise): the fit finds both numbers, and the
    fitted model predicts a shape the calibration never ran (a batch of 16 long inputs)."""
    rng = np.random.default_rng(1)
    batches = []
    for _ in range(200):
        lengths = rng.integers(8, 200, int(rng.integers(1, 5))).tolist()
        slot = (1.3 * PROFILE.latency(BatchShape.ragged(lengths)) + 0.002) * (1 + rng.normal(0, 0.03))
        batches.append(_batch(lengths, slot))
    fit = fit_live_batches(PROFILE, batches)
    meta = fit.meta["live_fit"]
    assert meta["alpha"] == pytest.approx(1.3, rel=0.05)
    assert meta["const_s"] == pytest.approx(0.002, abs=0.001)
    assert meta["batches"] == 200 and meta["median_rel_error"] < 0.05
    big = BatchShape.ragged([400] * 16)
    assert fit.latency(big) == pytest.approx(1.3 * PROFILE.latency(big) + 0.002, rel=0.05)
    assert fit.rel_residuals == PROFILE.rel_residuals and fit.meta["source"] == "test"


def test_fit_never_makes_a_negative_serving_cost_and_refuses_too_few_batches() -> None:
    batches = [_batch([n], 0.9 * PROFILE.latency(BatchShape.ragged([n])) - 0.004) for n in range(10, 110, 2)]
    meta = fit_live_batches(PROFILE, batches).meta["live_fit"]
    assert meta["const_s"] >= 0.0 and meta["alpha"] > 0
    with pytest.raises(ValueError, match="only 3 batches"):
        fit_live_batches(PROFILE, batches[:3])


def test_calibration_rows_use_other_times_and_the_measured_lengths() -> None:
    wl = Workload.from_columns("w", np.arange(400) * 0.5, np.arange(400) % 97 + 3)
    texts = [f"text {i}" for i in range(400)]
    rows, cal_texts = calibration_rows(wl, texts, measured=100, rate_scale=2.0, seconds=20.0, seed=3)
    assert len(rows) == len(cal_texts) == 81  # rows 100.. at 0.25 s apart: t <= 20 s
    assert set(rows.input_tokens.tolist()) <= set(wl.input_tokens[:100].tolist())
    for n, text in zip(rows.input_tokens.tolist(), cal_texts, strict=True):
        assert wl.input_tokens[int(text.split()[1])] == n  # each text goes with its row's length
    assert rows.arrival_s[1] == pytest.approx(0.25)


def test_delay_under_load_refits_only_the_part_outside_tokenizer_and_batcher() -> None:
    from batchpilot.bench.batch_fit import delay_under_load
    from batchpilot.bench.records import RequestRecord
    from batchpilot.sim.frontend import FrontEnd

    idle = FrontEnd(0.0004, 2e-6, 0.003, 1e-7)
    recs, delays = [], []
    for i in range(40):
        n = 10 + 12 * i
        tok, bat = 0.0004 + 2e-6 * n + 0.002 * (i % 3), 0.05 + 1e-4 * n  # a queue at the tokenizer: not delay
        d = 0.006 + 3e-7 * n + (0.02 if i % 10 == 0 else 0.0)  # a tail: 4 requests wait 20 ms more
        delays.append(d)
        recs.append(RequestRecord(i, 0.0, n, status=200, latency_s=tok + bat + d, server_tokenize_s=tok,
                                  server_batcher_s=bat))
    recs.append(RequestRecord(99, 0.0, 30, status=503, latency_s=0.001))  # refused: not a served request
    fe = delay_under_load(idle, recs)
    tokens = np.array([r.input_tokens for r in recs[:40]], dtype=float)
    # the tail stays in: the simulator adds the mean delay to every request
    assert float(np.mean(fe.delay(tokens))) == pytest.approx(float(np.mean(delays)), rel=1e-6)
    assert fe.delay_const_s > 0.006
    assert (fe.serial_const_s, fe.serial_per_token_s) == (idle.serial_const_s, idle.serial_per_token_s)
    assert delay_under_load(idle, recs[:5]) == idle  # too few served requests: keep the idle fit


def test_calibration_traffic_runs_at_the_measured_rows_rate() -> None:
    """The rows after a measured slice can arrive faster than the slice's own (conv-llm: 1.6-1.9x);
    the calibration keeps their pattern but slows it to the measured mean rate at the same scale."""
    from batchpilot.bench.capacity import rate_matched

    t = np.concatenate([np.arange(100) * 1.0, 100 + np.arange(300) * 0.5])  # then twice as fast
    wl = Workload.from_columns("w", t, np.full(400, 20))
    rows, _ = calibration_rows(wl, ["x"] * 400, measured=100, rate_scale=2.0, seconds=30.0)
    gaps = np.diff(rows.arrival_s)
    assert gaps == pytest.approx(np.full(len(gaps), 0.5))  # the measured rows' rate x2: 2 per second
    assert len(rows) == 61
    same = rate_matched(wl.slice(0, 100), wl.slice(0, 100), 3.0, 10.0)
    assert np.diff(same.arrival_s) == pytest.approx(np.full(len(same) - 1, 1 / 3))
    # the window's own rate is matched, not the mean of all the rows it is cut from: 60 s at 1/s then
    # 600 at 10/s average ~5.5/s, but a 10-second window at the head holds only the slow rows
    other = Workload.from_columns("o", np.concatenate([np.arange(60.0), 60 + np.arange(600) * 0.1]),
                                  np.full(660, 20))
    window = rate_matched(other, wl.slice(0, 100), 2.0, 10.0)  # the measured rows: 1/s, at x2: 2/s
    assert (len(window) - 1) / (window.arrival_s[-1] - window.arrival_s[0]) == pytest.approx(2.0, rel=0.05)


def test_a_calibration_holds_enough_requests_at_low_rates() -> None:
    from batchpilot.bench.capacity import calibration_seconds

    slow = Workload.from_columns("w", np.arange(31) * 3.0, np.full(31, 20))  # 1 request / 3 s
    assert calibration_seconds(slow, 1.0, 45.0, 40) == pytest.approx(120.0)  # 40 requests at 1/3 per s
    assert calibration_seconds(slow, 2.0, 45.0, 40) == pytest.approx(60.0)  # twice the rate: half as long
    assert calibration_seconds(slow, 1.0, 45.0, 10) == 45.0  # 45 s already hold 15
    assert calibration_seconds(slow.slice(0, 1), 1.0, 45.0, 40) == 45.0  # one row: no rate to go by


def test_a_point_is_measured_again_only_when_the_cpu_moved_and_attempts_are_left(
        capsys: pytest.CaptureFixture[str]) -> None:
    from batchpilot.bench.batch_fit import measure_again

    assert not measure_again(0.5, 0.049, 0.05, 1, 3, "batches")  # within the tolerance
    assert measure_again(0.5, -0.08, 0.05, 1, 3, "batches")
    assert "took -8.0%" in capsys.readouterr().out
    assert not measure_again(0.5, 0.2, 0.05, 3, 3, "batches")  # no attempt left
    assert not measure_again(0.5, math.nan, 0.05, 1, 3, "busy steps")  # nothing logged: nothing to judge
