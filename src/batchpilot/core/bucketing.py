"""Length buckets: upper edges that padded batches round up to, refitted as traffic shifts.

Methods (``BucketingConfig.method``):

* ``fixed``    — the configured boundaries, never refitted;
* ``quantile`` — equal-count buckets over recent lengths;
* ``kmeans``   — 1-D k-means (Lloyd, quantile initialisation) over recent lengths, edges at cluster maxima;
* ``dp``       — the edges that minimise the predicted per-sequence cost of padding every recent length up
  to its bucket's edge, by dynamic programming over the distinct lengths (cost model optimal).

Every fit ends with the model's ``max_len`` so each admissible request has a bucket. A refit happens
after ``refit_every_requests`` observations or ``refit_every_s`` seconds of the *driver's* time.
"""

from __future__ import annotations

import bisect
from collections import deque

import numpy as np

from batchpilot.core.config import BucketingConfig
from batchpilot.core.costmodel import CostModel


class Bucketer:
    def __init__(self, config: BucketingConfig, cost_model: CostModel, max_len: int) -> None:
        self.config = config
        self.cost_model = cost_model
        self.max_len = max_len
        self.boundaries: tuple[int, ...] = _close(config.boundaries, max_len)
        self.num_fits = 0
        self._history: deque[int] = deque(maxlen=config.history)
        self._since_fit = 0
        self._last_fit: float | None = None

    def bucket_of(self, length: int) -> int:
        """Index of the smallest edge >= length (lengths above every edge go to the last bucket)."""
        return min(bisect.bisect_left(self.boundaries, length), len(self.boundaries) - 1)

    def edge_for(self, length: int) -> int:
        """The padded length of a bucket holding ``length`` (never shorter than ``length``)."""
        return max(self.boundaries[self.bucket_of(length)], length)

    def observe(self, length: int, now: float) -> bool:
        """Record an admitted length; refit when due. Returns True when boundaries were refitted."""
        cfg = self.config
        if cfg.method == "fixed":
            return False
        self._history.append(length)
        self._since_fit += 1
        if self._last_fit is None:
            self._last_fit = now
        due = self._since_fit >= cfg.refit_every_requests or now - self._last_fit >= cfg.refit_every_s
        if not due:
            return False
        self.refit(now)
        return True

    def refit(self, now: float) -> None:
        self._since_fit = 0
        self._last_fit = now
        if not self._history:
            return
        lengths = np.fromiter(self._history, dtype=np.int64, count=len(self._history))
        k = self.config.num_buckets
        method = self.config.method
        if method == "quantile":
            edges = quantile_edges(lengths, k)
        elif method == "kmeans":
            edges = kmeans_edges(lengths, k)
        elif method == "dp":
            edges = dp_edges(lengths, k, self.cost_model)
        else:
            return
        self.boundaries = _close(edges, self.max_len)
        self.num_fits += 1


def _close(edges: tuple[int, ...] | list[int], max_len: int) -> tuple[int, ...]:
    """Sorted unique edges within [1, max_len], always ending at max_len."""
    kept = sorted({int(e) for e in edges if 1 <= e < max_len})
    return (*kept, max_len)


def quantile_edges(lengths: np.ndarray, k: int) -> list[int]:
    # edge i is the smallest length that covers i/k of the recent lengths
    qs = np.quantile(lengths, np.arange(1, k + 1) / k, method="inverted_cdf")
    return [int(q) for q in qs]


def kmeans_edges(lengths: np.ndarray, k: int, iters: int = 30) -> list[int]:
    """1-D k-means; returns the largest length of each cluster (its padding edge)."""
    x = np.sort(lengths.astype(float))
    centers = np.unique(np.quantile(x, (np.arange(k) + 0.5) / k))
    for _ in range(iters):
        # In 1-D the assignment is by the midpoints between sorted centres.
        cuts = (centers[1:] + centers[:-1]) / 2
        idx = np.searchsorted(cuts, x)
        new = np.array([x[idx == j].mean() if (idx == j).any() else centers[j] for j in range(len(centers))])
        if np.allclose(new, centers):
            break
        centers = new
    cuts = (centers[1:] + centers[:-1]) / 2
    idx = np.searchsorted(cuts, x)
    return [int(x[idx == j].max()) for j in range(len(centers)) if (idx == j).any()]


def dp_edges(lengths: np.ndarray, k: int, cost_model: CostModel) -> list[int]:
    """Edges minimising Σ per-sequence cost of padding each length to its edge (exact DP).

    The per-sequence cost of a length padded to ``e`` is ``c_n + c_tok * e + c_attn * e**2`` from the
    cost model (the per-call constant does not depend on edges). Candidates are the distinct lengths;
    ``best[j][i]`` is the cheapest way to cover the i smallest distinct lengths with j edges.
    """
    values, counts = np.unique(lengths, return_counts=True)
    d = len(values)
    k = min(k, d)
    _, c_n, c_tok, c_attn = cost_model.encoder_latency_coef
    per_seq = c_n + c_tok * values + c_attn * values.astype(float) ** 2
    if not per_seq.any():  # an all-zero model gives no preference: fall back to quantiles
        return quantile_edges(lengths, k)
    cum = np.concatenate([[0], np.cumsum(counts)])
    inf = float("inf")
    best = np.full((k + 1, d + 1), inf)
    arg = np.zeros((k + 1, d + 1), dtype=np.int64)
    best[0, 0] = 0.0
    for j in range(1, k + 1):
        for i in range(1, d + 1):
            # The last bucket covers distinct values s..i-1 and pads them to values[i-1].
            s = np.arange(0, i)
            cand = best[j - 1, :i] + (cum[i] - cum[s]) * per_seq[i - 1]
            m = int(np.argmin(cand))
            best[j, i], arg[j, i] = cand[m], m
    j = int(np.argmin(best[1:, d])) + 1
    edges, i = [], d
    while j > 0 and i > 0:
        edges.append(int(values[i - 1]))
        i, j = int(arg[j, i]), j - 1
    return sorted(edges)
