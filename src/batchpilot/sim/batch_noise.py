"""How a served batch's time scatters around its line: a spread per batch and a wander of the machine's speed.

The profile's loaded phase (``server.serving_load.fit_loaded``) prices every batch it served by the
loaded line (``sim.frontend.served_seconds``) and keeps ``slot / line - 1``. That scatter has two parts
that matter differently to a queue:

* **per batch**: one batch runs a few percent off and the next one does not. Over the dozen batches a
  burst takes, it averages out;
* **the wander**: on a shared machine the speed itself moves, and the batches of the same few seconds
  run slow (or fast) together. A burst that meets a slow second queues longer at every batch of it,
  which is what sets a bursty workload's P99.

``split_wander`` separates them on the loaded batches: the spread of the log of the batches' ratio
between ``WANDER_WINDOW_S`` windows, beyond what the per-batch spread alone gives windows of their
size, is the wander's (a standard deviation of the log speed, ``FrontEnd.loaded_wander``); every
batch's residual with its window's mean taken out is the per-batch part (``loaded_residuals``).
``BatchNoise`` draws both, seeded: a residual per batch from the profile's list, and a speed factor per
window of simulated time (log-normal with mean 1), the same for every batch that starts in it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from batchpilot.sim.frontend import residual_scale

WANDER_WINDOW_S = 2.0  # the wander is one speed factor per window of this many seconds
MIN_WINDOW_BATCHES = 4  # a window with fewer loaded batches says nothing about its mean: left out
POOL = 4096  # uniforms drawn at once for the per-batch residuals


def split_wander(starts: Sequence[float], rel: Sequence[float],
                 window_s: float = WANDER_WINDOW_S) -> tuple[float, np.ndarray, int]:
    """``(sigma, within, windows)`` for batches starting at ``starts`` with relative residuals ``rel``
    (> -1) around their line: ``sigma`` the standard deviation of the log speed between windows of
    ``window_s`` (windows of at least ``MIN_WINDOW_BATCHES`` batches; their between-window variance less
    what the within-window spread explains for windows of that many batches, at least 0), ``within``
    each residual with its window's mean log ratio taken out (unchanged in a window that is left out),
    ``windows`` how many windows were used. Fewer than 3 usable windows: sigma 0, residuals unchanged."""
    t = np.asarray(starts, dtype=float)
    logs = np.log1p(np.asarray(rel, dtype=float))
    if t.size == 0:
        return 0.0, np.expm1(logs), 0
    cell = np.floor((t - t.min()) / window_s).astype(int)
    means, variances, counts, members = [], [], [], []
    for c in np.unique(cell):
        idx = np.flatnonzero(cell == c)
        if idx.size >= MIN_WINDOW_BATCHES:
            means.append(float(logs[idx].mean()))
            variances.append(float(logs[idx].var(ddof=1)))
            counts.append(idx.size)
            members.append(idx)
    if len(means) < 3:
        return 0.0, np.expm1(logs), len(means)
    m = np.asarray(means)
    between = float(m.var(ddof=1))
    explained = float(np.mean(np.asarray(variances) / np.asarray(counts)))
    sigma = math.sqrt(max(between - explained, 0.0))
    within = logs.copy()
    centre = float(m.mean())
    for mean, idx in zip(means, members, strict=True):
        within[idx] -= mean - centre  # the window's offset from the others, not the overall level
    return sigma, np.expm1(within), len(means)


class BatchNoise:
    """Draws a served batch's time around its line ``mean`` (``draw``), seeded.

    ``residuals``: relative residuals in the units of a batch of ``ref_s`` seconds (0: relative at every
    length; ``sim.frontend.residual_scale``), one picked per batch; ``wander``: the standard deviation
    of the log speed between ``WANDER_WINDOW_S`` windows of simulated time, one log-normal factor (mean
    1) per window, the same for every batch that starts in it (0: none). The residual picks come from
    their own stream, so a profile without a wander draws exactly what it drew before one existed."""

    def __init__(self, residuals: Sequence[float], ref_s: float = 0.0, wander: float = 0.0,
                 seed: int = 0, window_s: float = WANDER_WINDOW_S) -> None:
        if wander < 0 or not math.isfinite(wander):
            raise ValueError(f"wander must be a finite standard deviation >= 0, got {wander!r}")
        self._residuals = tuple(residuals)
        self._ref_s = ref_s
        self._rng = np.random.default_rng(seed)
        self._u: list[float] = []
        self._wander = wander
        self._window_s = window_s
        self._speed: dict[int, float] = {}
        self._wander_rng = np.random.default_rng((seed, 1)) if wander > 0 else None

    def speed(self, start_s: float) -> float:
        """The wander's factor for a batch starting at ``start_s`` (1 without a wander)."""
        if self._wander_rng is None:
            return 1.0
        k = int(math.floor(start_s / self._window_s))
        f = self._speed.get(k)
        if f is None:
            s = self._wander
            f = self._speed[k] = math.exp(float(self._wander_rng.normal(0.0, s)) - 0.5 * s * s)
        return f

    def draw(self, mean: float, start_s: float = 0.0) -> float:
        """``mean`` times the window's speed factor, times one plus a drawn residual (scaled down for a
        batch longer than ``ref_s``); never below 0."""
        line = mean
        mean *= self.speed(start_s)
        if not self._residuals:
            return mean
        if not self._u:
            self._u = self._rng.random(POOL).tolist()
        res = self._residuals
        r = res[min(int(self._u.pop() * len(res)), len(res) - 1)] * residual_scale(line, self._ref_s)
        return max(mean * (1.0 + r), 0.0)
