"""The pure parts of benchmarks/llm_throughput.py: per-request latency statistics and the round order."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "llm_throughput.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("llm_throughput_bench", _PATH)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def test_summarize_ttft_tpot_and_token_count(bench) -> None:
    # request 0: first token at 1 s, then every 0.5 s; request 1: one token at 3 s (no TPOT)
    times = [[1.0, 1.5, 2.0, 2.5], [3.0]]
    row = bench.summarize(times, [4, 1], makespan=4.0)
    assert row["produced"] == 5 and row["tokens_ok"]
    assert row["tok_s"] == pytest.approx(5 / 4.0)
    assert row["ttft_p50"] == pytest.approx(2.0)  # median of 1 and 3
    assert row["ttft_p99"] == pytest.approx(1.0 + 0.99 * 2.0)
    assert row["tpot_p50"] == pytest.approx(0.5) and row["tpot_p99"] == pytest.approx(0.5)


def test_summarize_counts_what_was_produced(bench) -> None:
    row = bench.summarize([[0.1, 0.2], [0.3]], [3, 1], makespan=1.0)
    assert not row["tokens_ok"] and row["produced"] == 3


def test_round_order_rotates_and_grid_alternates(bench) -> None:
    systems = ["a", "b", "c"]
    orders = [bench.round_order(systems, r) for r in range(3)]
    assert orders == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"]]
    for pos in range(3):  # each system takes each position once in three rounds
        assert sorted(o[pos] for o in orders) == systems
    assert bench.grid_order([1, 2, 3], 0) == [1, 2, 3]
    assert bench.grid_order([1, 2, 3], 1) == [3, 2, 1]


def test_best_of_grid_and_median_spread(bench) -> None:
    rows = [{"config": c, "tok_s": v} for c, v in [(256, 10.0), (512, 12.0), (256, 11.0), (512, 9.0),
                                                  (256, 10.5), (512, 13.0)]]
    assert bench.best_of(rows)["tok_s"] == 13.0
    assert bench.best_config(rows) == (512, 12.0)  # medians: 256 -> 10.5, 512 -> 12.0
    assert bench.median_spread([2.0, 1.0, 4.0]) == (2.0, 1.0, 4.0)
