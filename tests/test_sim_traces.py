"""Trace readers and the Workload's rate scaling and slicing."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from batchpilot.sim.traces import Workload, read_azure_csv, read_mooncake_jsonl, read_trace


def test_azure_csv_with_datetimes_is_offset_and_sorted(tmp_path: Path) -> None:
    p = tmp_path / "az.csv"
    p.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                 "2023-11-16 18:15:47.0000000,10,1\n"
                 "2023-11-16 18:15:46.5000000,20,2\n"
                 "2023-11-16 18:15:48.2500000,30,3\n")
    wl = read_azure_csv(p)
    np.testing.assert_allclose(wl.arrival_s, [0.0, 0.5, 1.75])
    assert wl.input_tokens.tolist() == [20, 10, 30]
    assert wl.output_tokens.tolist() == [2, 1, 3]
    assert read_trace(p).input_tokens.tolist() == [20, 10, 30]


def test_mooncake_jsonl_timestamps_are_milliseconds(tmp_path: Path) -> None:
    p = tmp_path / "mc.jsonl"
    rows = [{"timestamp": 1000, "input_length": 5, "output_length": 7, "hash_ids": [1]},
            {"timestamp": 3500, "input_length": 6, "output_length": 8}]
    p.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    wl = read_mooncake_jsonl(p)
    np.testing.assert_allclose(wl.arrival_s, [0.0, 2.5])
    assert read_trace(p).output_tokens.tolist() == [7, 8]


def test_batchpilot_csv_round_trips_with_priority(tmp_path: Path) -> None:
    wl = Workload.from_columns("x", [0.0, 0.25, 1.0], [3, 4, 5], [1, 2, 3], [0, -1, 2])
    p = tmp_path / "bp.csv"
    wl.to_csv(p)
    back = read_trace(p)
    np.testing.assert_allclose(back.arrival_s, wl.arrival_s)
    for col in ("input_tokens", "output_tokens", "priority"):
        assert getattr(back, col).tolist() == getattr(wl, col).tolist()


def test_rate_scaling_divides_time_and_keeps_rows() -> None:
    wl = Workload.from_columns("x", [0.0, 1.0, 3.0], [1, 2, 3])
    fast = wl.scale_rate(4)
    np.testing.assert_allclose(fast.arrival_s, [0.0, 0.25, 0.75])
    assert len(fast) == 3 and fast.mean_rate == pytest.approx(4 * wl.mean_rate)
    with pytest.raises(ValueError, match="> 0"):
        wl.scale_rate(0)


def test_slice_is_contiguous_and_reoffset() -> None:
    wl = Workload.from_columns("x", [0.0, 1.0, 3.0, 6.0], [1, 2, 3, 4])
    s = wl.slice(1, 2)
    np.testing.assert_allclose(s.arrival_s, [0.0, 2.0])
    assert s.input_tokens.tolist() == [2, 3]
    assert [r.input_tokens for r in wl.slice(2).rows()] == [3, 4]
    with pytest.raises(ValueError, match="outside"):
        wl.slice(10)


def test_unknown_format_and_bad_columns_are_explained(tmp_path: Path) -> None:
    p = tmp_path / "bad.csv"
    p.write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match="unknown trace format"):
        read_trace(p)
    with pytest.raises(ValueError, match="same length"):
        Workload("x", np.zeros(2), np.zeros(3, dtype=np.int64), np.zeros(2), np.zeros(2))
