"""The step profile's own shape error, read back as a factor on the step model's price.

The LLM step model (``core.costmodel``, linear over ``LLM_FEATURES``) is fitted on the step profile's
grid (``models.llm.profile.profile_llm_steps``: prefills alone, decode batches at several contexts,
a prefill beside a few decodes). Its residuals on that grid are not noise. The runner's matmuls run
whole tiles of rows, so a step's cost climbs in stairs with its rows, and one straight line over
decodes and KV tokens cannot follow them: it prices two or three decodes over their time and ten to
twenty under it, short prompts under and long ones over (``python -m batchpilot.sim.llm_step_shape
PROFILE`` prints each grid point's measured time over the line's). Live steps of those shapes run off
by the same fractions, and the serving path's factors per count of sequences (``sim.llm_frontend``)
would otherwise have to learn the grid's shape from a few hundred loaded steps.

``StepShapeTable`` keeps ``log(measured / line)`` of every grid point in three tables and interpolates
them (linearly, in the logarithms of the axes, held at the table's edges beyond them):

* a prefill alone: over its prompt tokens;
* decodes alone: over the decodes and the KV tokens per decode;
* a prefill beside decodes: over its prompt tokens and ``1 + decodes``, the prefill-alone table
  giving the row of no decodes.

``StepPricer`` is the price every LLM prediction takes: the line times the table's factor. The
simulator (``sim.llm``), the serving-path fit (``LLMFrontEnd.fit_steps``) and the step log's
comparison with the profile (``bench.llm_steps``) all price a step through it. A profile without
``step_points`` in its ``meta`` (an older one, or the stated default) gets factor 1. A rechecked profile
(``batchpilot profile --recheck``) keeps the grid's original times beside its rescaled line and
records the ratio as ``meta.step_points_speed``; the table reads the times at that speed.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from batchpilot.core.costmodel import CostModel, StepShape


def _features(shape: StepShape | Mapping[str, float]) -> tuple[float, float, float]:
    if isinstance(shape, StepShape):
        return float(shape.prefill_tokens), float(shape.decode_seqs), float(shape.kv_tokens)
    return float(shape.get("prefill_tokens", 0.0)), float(shape.get("decode_seqs", 0.0)), \
        float(shape.get("kv_tokens", 0.0))


@dataclass(frozen=True)
class Grid2:
    """``z[i, j]`` at ``(x[i], y[j])``, both axes ascending (already in log); bilinear, held at edges."""

    x: np.ndarray
    y: np.ndarray
    z: np.ndarray

    def __call__(self, x: float, y: float) -> float:
        # only the two rows around x: the same bilinear value as interpolating every row, at two calls
        hi = min(max(int(np.searchsorted(self.x, x)), 1), len(self.x) - 1) if len(self.x) > 1 else 0
        lo = max(hi - 1, 0)
        z_lo, z_hi = (float(np.interp(y, self.y, self.z[k])) for k in (lo, hi))
        if hi == lo or x <= self.x[lo]:
            return z_lo
        if x >= self.x[hi]:
            return z_hi
        w = (x - self.x[lo]) / (self.x[hi] - self.x[lo])
        return z_lo + w * (z_hi - z_lo)


def _table(points: dict[tuple[float, float], float]) -> Grid2 | None:
    """A ``Grid2`` of ``points`` (``(x, y) -> z``); a missing cell takes its row's nearest present one
    (the profile skips decode batches larger than the KV pool)."""
    if not points:
        return None
    xs, ys = sorted({x for x, _ in points}), sorted({y for _, y in points})
    z = np.zeros((len(xs), len(ys)))
    for i, x in enumerate(xs):
        have = [j for j, y in enumerate(ys) if (x, y) in points]
        for j in range(len(ys)):
            near = min(have, key=lambda k: abs(k - j))
            z[i, j] = points[(x, ys[near])]
    return Grid2(np.log(xs), np.log(ys), z)


@dataclass(frozen=True)
class StepShapeTable:
    """The grid's ``log(measured / line)`` in three tables (module docstring); ``factor`` reads them."""

    prefill: tuple[np.ndarray, np.ndarray] | None = None  # (log prompt tokens, log ratio)
    decode: Grid2 | None = None  # (log decodes, log KV tokens per decode)
    mixed: Grid2 | None = None  # (log prompt tokens, log(1 + decodes))

    @classmethod
    def from_cost_model(cls, cost_model: CostModel) -> StepShapeTable:
        """The tables of ``cost_model.meta["step_points"]`` against ``cost_model``'s line (none: empty)."""
        pre: dict[float, float] = {}
        dec: dict[tuple[float, float], float] = {}
        mix: dict[tuple[float, float], float] = {}
        speed = float(cost_model.meta.get("step_points_speed", 1.0))  # a rechecked profile's ratio
        for p in cost_model.meta.get("step_points") or ():
            prompts, b, ctx = [int(n) for n in p["prefills"]], int(p["decodes"]), int(p["context"])
            line = cost_model.latency(step_point_shape(prompts, b, ctx))
            if line <= 0 or float(p["latency_s"]) <= 0 or len(prompts) > 1:
                continue
            r = math.log(float(p["latency_s"]) * speed / line)
            if prompts and b == 0:
                pre[float(prompts[0])] = r
            elif prompts:
                mix[(float(prompts[0]), 1.0 + b)] = r
            elif b > 0:
                dec[(float(b), float(ctx))] = r
        prefill = None
        if pre:
            keys = sorted(pre)
            prefill = (np.log(keys), np.array([pre[k] for k in keys]))
            mix.update({(n, 1.0): pre[n] for n in {x for x, _ in mix} if n in pre})
        return cls(prefill, _table(dec), _table(mix))

    def factor(self, shape: StepShape | Mapping[str, float]) -> float:
        """The grid's measured over the line for a step of this shape (1 where no table covers it)."""
        prompt, decodes, kv = _features(shape)
        if prompt > 0 and decodes == 0 and self.prefill is not None:
            return math.exp(float(np.interp(math.log(prompt), *self.prefill)))
        if prompt > 0 and decodes > 0 and self.mixed is not None:
            return math.exp(self.mixed(math.log(prompt), math.log(1.0 + decodes)))
        if prompt == 0 and decodes > 0 and self.decode is not None:
            return math.exp(self.decode(math.log(decodes), math.log(max(kv / decodes, 1.0))))
        return 1.0


def step_point_shape(prompts: Sequence[int], decodes: int, context: int) -> StepShape:
    """The ``StepShape`` of a profile grid point (``models.llm.profile.step_plan``: each prompt a fresh
    chunk, each decode at ``context``)."""
    return StepShape(sum(prompts), decodes, sum(prompts) + decodes * context, sum(n * n for n in prompts))


class StepPricer:
    """A step's predicted seconds: ``cost_model``'s line times its ``StepShapeTable`` factor."""

    def __init__(self, cost_model: CostModel) -> None:
        self.cost_model = cost_model
        self.table = StepShapeTable.from_cost_model(cost_model)

    def latency(self, shape: StepShape | Mapping[str, float]) -> float:
        return self.cost_model.latency(shape) * self.table.factor(shape)

    def sample_latency(self, shape: StepShape | Mapping[str, float], u: float) -> float:
        return self.cost_model.sample_latency(shape, u) * self.table.factor(shape)


def main(argv: list[str]) -> int:
    """``python -m batchpilot.sim.llm_step_shape PROFILE``: each grid point, its time and the line's."""
    if len(argv) != 1:
        print(__doc__)
        return 2
    cm = CostModel.load(argv[0])
    for p in cm.meta.get("step_points") or ():
        shape = step_point_shape(p["prefills"], int(p["decodes"]), int(p["context"]))
        line = cm.latency(shape)
        took = float(p["latency_s"])
        print(f"prefills {str(p['prefills']):>6} decodes {p['decodes']:>3} context {p['context']:>5}: "
              f"{took * 1e3:7.2f} ms, line {line * 1e3:7.2f} ms, measured/line {took / line:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

