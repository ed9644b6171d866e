"""Bucketer: fixed edges, refits (by count and by driver time), and each fitting method."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchpilot.core.bucketing import Bucketer, dp_edges, kmeans_edges, quantile_edges
from batchpilot.core.config import BucketingConfig
from core_factories import simple_cost_model

COST = simple_cost_model(const=0.01, per_req=0.001, per_token=1e-4, attn=1e-7)


def bucketer(**kw: object) -> Bucketer:
    return Bucketer(BucketingConfig(**kw), COST, 512)  # type: ignore[arg-type]


def test_fixed_edges_always_end_at_max_len() -> None:
    b = bucketer(boundaries=(64, 128, 256))
    assert b.boundaries == (64, 128, 256, 512)
    assert [b.bucket_of(x) for x in (1, 64, 65, 512)] == [0, 0, 1, 3]
    assert b.edge_for(100) == 128 and b.edge_for(600) == 600
    assert not b.observe(10, 0.0)  # fixed never refits
    assert bucketer(boundaries=(100, 1000)).boundaries == (100, 512)


def test_quantile_refits_every_n_requests_and_follows_a_shift() -> None:
    b = bucketer(method="quantile", num_buckets=4, refit_every_requests=100, refit_every_s=1e9, history=200)
    rnd = random.Random(0)
    refits = [b.observe(rnd.randint(10, 60), i * 0.001) for i in range(100)]
    assert refits.count(True) == 1 and refits[-1]
    assert b.boundaries[-2] <= 60
    for i in range(300):  # traffic shifts to long inputs: the edges follow
        b.observe(rnd.randint(300, 400), 1.0 + i * 0.001)
    assert b.boundaries[0] >= 300 and b.num_fits == 4


def test_refit_by_driver_time() -> None:
    b = bucketer(method="quantile", refit_every_requests=10**6, refit_every_s=5.0)
    assert not b.observe(50, 0.0)
    assert not b.observe(60, 4.9)
    assert b.observe(70, 5.0)  # five seconds of the driver's clock, whatever the count


def test_kmeans_separates_two_modes() -> None:
    rnd = random.Random(1)
    short = [rnd.randint(20, 40) for _ in range(200)]
    lengths = np.array(short + [rnd.randint(300, 340) for _ in range(200)])
    edges = kmeans_edges(lengths, 2)
    assert edges == [40, 340] or (edges[0] <= 40 and edges[1] >= 300)


def test_quantile_edges() -> None:
    assert quantile_edges(np.arange(1, 101), 4) == [25, 50, 75, 100]


def _waste(lengths: list[int], edges: list[int]) -> float:
    _, c1, c2, c3 = COST.encoder_latency_coef
    total = 0.0
    for x in lengths:
        e = min(e for e in edges if e >= x)
        total += c1 + c2 * e + c3 * e * e
    return total


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(1, 200), min_size=1, max_size=30), k=st.integers(1, 4))
def test_dp_edges_are_optimal(lengths: list[int], k: int) -> None:
    edges = dp_edges(np.array(lengths), k, COST)
    assert len(edges) <= k and max(lengths) in edges
    values = sorted(set(lengths))
    best = min(_waste(lengths, [*combo, max(values)])
               for r in range(0, min(k, len(values)))
               for combo in itertools.combinations(values[:-1], r))
    assert _waste(lengths, edges) == pytest.approx(best, rel=1e-9)


def test_dp_beats_or_ties_quantile_on_skewed_lengths() -> None:
    rnd = random.Random(2)
    lengths = [min(512, max(4, int(rnd.lognormvariate(4.8, 0.8)))) for _ in range(2000)]
    arr = np.array(lengths)
    assert _waste(lengths, dp_edges(arr, 4, COST)) <= _waste(lengths, quantile_edges(arr, 4))


def test_dp_method_through_the_bucketer() -> None:
    b = bucketer(method="dp", num_buckets=3, refit_every_requests=50)
    for i in range(50):
        b.observe(10 if i % 2 else 200, float(i))
    assert b.boundaries == (10, 200, 512)
