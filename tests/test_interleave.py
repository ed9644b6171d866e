"""Interleaved live comparisons and the tuner check's statistics (pure parts, no server)."""

from __future__ import annotations

import math
import threading

import pytest

from batchpilot.bench.interleave import Turns
from batchpilot.bench.tuner_check import pick, spearman


def test_turns_run_one_party_at_a_time_round_robin_and_skip_the_finished() -> None:
    turns = Turns(["a", "b", "c"])
    log: list[str] = []
    inside = [0]
    counts = {"a": 3, "b": 1, "c": 2}

    def party(name: str) -> None:
        for _ in range(counts[name]):
            with turns.turn(name):
                inside[0] += 1
                assert inside[0] == 1  # never two at once
                log.append(name)
                inside[0] -= 1
        turns.done(name)

    # the order the threads start in does not matter
    threads = [threading.Thread(target=party, args=(n,)) for n in ("c", "b", "a")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert log == ["a", "b", "c", "a", "c", "a"]


def test_spearman_and_pick() -> None:
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert spearman([1, 2, 3], [5, 5, 6]) == pytest.approx(math.sqrt(3) / 2)  # a tie shares its mean rank
    assert math.isnan(spearman([1, 1], [1, 2]))
    # spread over the predicted goodput, not the rank: a ranking bunched near the top yields its winner,
    # its last and the configs nearest to evenly spaced levels between
    rps = [50.0, 49.9, 49.8, 49.5, 49.0, 48.0, 40.0, 30.0, 21.0, 10.0]
    assert pick(rps, 5) == [0, 6, 7, 8, 9]
    assert pick([float(x) for x in range(19, -1, -1)], 5) == [0, 5, 9, 14, 19]  # evenly spread: as the rank
    assert pick([3.0, 2.0, 1.0], 5) == [0, 1, 2]
    assert pick([5.0, 5.0, 5.0, 5.0], 2) == [0, 1]  # all equal: the first ones
