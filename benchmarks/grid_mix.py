"""Padding-free profile grid: which lengths in its batches price live-like batches right.

    .venv/bin/python benchmarks/grid_mix.py [--rounds 5] [--holdout 32] [--threads 1]

One process, one MiniLM executor (``--dtype auto`` chooses as ``serve`` does), padding "none". Four
sets of batches are built: the standard grid with every input of exactly ``L`` (``uniform``), the same
grid with lengths spread evenly over ``L +- 25%`` so that a batch of ``n`` holds ``n * L`` tokens
(``even``), the same grid with lengths drawn at random over ``L +- 25%`` as
``models.profiler.grid_lengths`` draws them (``random``: what ``batchpilot profile`` measures), and
``--holdout`` batches of 1-16 rows drawn from the conv-embed trace (seeded; a quarter lone rows, the
rest sorted by length and cut into neighbours, as the sorted planner forms them). Every batch of the
four sets is timed once per round, all interleaved, so a drift of this CPU's speed falls on all of
them alike. Each grid is fitted (``CostModel.fit``) on its own points, and every fit predicts the same
held-out batches. Printed: the relative error of each fit on them (median and max of |error|, and the
mean signed error, overall and for lone rows: negative = the fit prices live batches too low).
"""

from __future__ import annotations

import argparse
import random
import statistics

import numpy as np

from batchpilot.core.costmodel import CostModel
from batchpilot.models.device import resolve_device
from batchpilot.models.encoder import EncoderConfig, EncoderExecutor
from batchpilot.models.precision import choose_precision
from batchpilot.models.profiler import (
    MIX_SPREAD,
    STANDARD_BATCH_SIZES,
    STANDARD_LENGTHS,
    _Shape,
    grid_lengths,
)
from batchpilot.sim.traces import load_workload


def even_lengths(n: int, length: int, limit: int) -> list[int]:
    """``n`` lengths spread evenly over ``length +- 25%`` (``n * length`` tokens where the range allows)."""
    if n < 2:
        return [length] * n
    lo, hi = length * (1.0 - MIX_SPREAD), length * (1.0 + MIX_SPREAD)
    return [min(max(int(round(lo + (hi - lo) * i / (n - 1))), 3), limit) for i in range(n)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--holdout", type=int, default=32)
    ap.add_argument("--max-batch-tokens", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=3)
    ap.add_argument("--verbose", action="store_true", help="print every held-out batch")
    args = ap.parse_args()

    def load(dtype: str) -> EncoderExecutor:
        return EncoderExecutor(EncoderConfig(dtype=dtype, num_threads=args.threads))  # type: ignore[arg-type]

    ex, precision = choose_precision(load, args.dtype, resolve_device("cpu"), 0.999, "torch")
    ex.warmup()
    limit = int(ex.max_length)
    rng = random.Random(args.seed)
    grid = [(b, L) for b in STANDARD_BATCH_SIZES for L in STANDARD_LENGTHS if b * L <= args.max_batch_tokens]
    lengths_rng = random.Random(args.seed + 1)
    sets: dict[str, list[_Shape]] = {
        "uniform": [_Shape(ex, [min(L, limit)] * b, "none", rng, False) for b, L in grid],
        "even": [_Shape(ex, even_lengths(b, min(L, limit), limit), "none", rng, False) for b, L in grid],
        "random": [_Shape(ex, grid_lengths(b, min(L, limit), limit, lengths_rng), "none", rng, False)
                   for b, L in grid],
    }
    rows = load_workload("conv-embed", start=0, count=5000).input_tokens
    trace = [min(max(int(n), 3), limit) for n in rows]
    held = []
    for i in range(args.holdout):
        n = 1 if i % 4 == 0 else rng.randint(2, 16)
        pool = sorted(rng.sample(trace, 64))
        at = rng.randrange(len(pool) - n + 1)
        lens = pool[at:at + n]
        while sum(lens) > args.max_batch_tokens:
            lens = lens[:-1]
        held.append(_Shape(ex, lens, "none", rng, False))
    sets["held-out"] = held
    order = [s for shapes in sets.values() for s in shapes]
    print(f"{ex.model_name}, {precision.chosen}, {ex.num_threads} threads; {len(grid)} grid shapes per grid, "
          f"{len(held)} held-out batches, {args.rounds} interleaved rounds", flush=True)
    for r in range(args.rounds):
        rng.shuffle(order)
        for s in order:
            s.time_once()
        print(f"round {r + 1}/{args.rounds}", flush=True)
    meas = {k: [s.measurement() for s in v] for k, v in sets.items()}
    lone = np.array([m.n == 1 for m in meas["held-out"]])
    for name in ("uniform", "even", "random"):
        model = CostModel.fit([m.point() for m in meas[name]])
        err = np.array([model.latency(m.features) / m.latency_s - 1.0 for m in meas["held-out"]])
        coef = " ".join(f"{f}={c:.3g}" for f, c in zip(model.feature_names, model.latency_coef, strict=True))
        a = np.abs(err)
        print(f"{name:8s} grid: held-out |error| median {np.median(a):.1%} max {np.max(a):.1%}; mean signed "
              f"{np.mean(err):+.1%} (lone rows {np.mean(err[lone]):+.1%}, batches {np.mean(err[~lone]):+.1%})"
              f"   [{coef}]")
        if args.verbose:
            for m in meas["held-out"]:
                print(f"    n={m.n:2d} T={sum(m.lengths):5d} max={max(m.lengths):3d} "
                      f"distinct={len(set(m.lengths)):2d} measured {m.latency_s * 1e3:7.2f} ms "
                      f"predicted {model.latency(m.features) * 1e3:7.2f}")
    sizes = [m.n for m in meas["held-out"]]
    print(f"held-out batches: {statistics.median(sizes)} rows median, "
          f"{statistics.median(sum(m.lengths) for m in meas['held-out'])} tokens median")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
