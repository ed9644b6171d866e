"""Does a padding-free batch cost more when its inputs have more distinct lengths, at the same tokens?

    .venv/bin/python benchmarks/distinct_lengths.py [--rounds 7] [--threads 1]

The padding-free forward runs attention once per distinct input length. The cost model's features
(inputs, tokens, the sum of squared lengths) do not count distinct lengths, and live batches of many
inputs have nearly all lengths distinct, where the profile grid's short inputs repeat lengths. Here,
for each batch size n and mean length L, two batches of the same token count and nearly the same
attention work: ``same`` (every input of length L) and ``distinct`` (n different lengths spread evenly
over L +- 40%, shifted to the same total). One MiniLM executor (``--dtype auto`` as ``serve``
chooses), padding "none"; every batch timed once per round, all interleaved, so a drift of this CPU's
speed falls on both alike. Printed per (n, L): the median of each, their ratio, and what the
cost model fitted on the ``same`` batches predicts for the ``distinct`` one (its own features).
"""

from __future__ import annotations

import argparse
import random
import statistics

from batchpilot.core.costmodel import CostModel
from batchpilot.models.profiler import _Shape
from batchpilot.models.tasks import load_model

SIZES = (2, 4, 8, 16)
LENGTHS = (16, 32, 64, 128)


def distinct(n: int, length: int) -> list[int]:
    """``n`` different lengths over ``length`` +- 40% that sum to ``n * length``."""
    if n == 1:
        return [length]
    span = max(int(0.4 * length), n // 2 + 1)
    out = [length - span + round(2 * span * i / (n - 1)) for i in range(n)]
    out[-1] += n * length - sum(out)  # the same tokens as ``same``
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--seed", type=int, default=5)
    args = ap.parse_args()

    ex = load_model(None, task="embed", num_threads=args.threads, dtype=args.dtype)  # as `serve` loads it
    ex.warmup()
    rng = random.Random(args.seed)
    cells = [(n, L) for n in SIZES for L in LENGTHS]
    shapes = {(n, L, kind): _Shape(ex, [L] * n if kind == "same" else distinct(n, L), "none", rng, False)
              for n, L in cells for kind in ("same", "distinct")}
    order = list(shapes)
    for _ in range(args.rounds):
        rng.shuffle(order)
        for key in order:
            shapes[key].time_once()
    same = [shapes[(n, L, "same")].measurement() for n, L in cells]
    model = CostModel.fit([m.point() for m in same])
    print(f"MiniLM, padding none, {ex.precision.chosen}, {ex.num_threads} threads, {args.rounds} rounds")
    print("   n     L  distinct lengths  same ms  distinct ms  distinct/same  fit on same: distinct error")
    ratios = []
    for n, L in cells:
        a, b = shapes[(n, L, "same")].measurement(), shapes[(n, L, "distinct")].measurement()
        pred = model.latency(b.features)
        ratios.append(b.latency_s / a.latency_s)
        print(f"{n:4d}  {L:4d}  {len(set(b.lengths)):16d}  {a.latency_s * 1e3:7.2f}  "
              f"{b.latency_s * 1e3:11.2f}  {b.latency_s / a.latency_s:13.3f}  "
              f"{(pred - b.latency_s) / b.latency_s:+27.1%}")
    print(f"median distinct/same: {statistics.median(ratios):.3f}; for n >= 8: "
          f"{statistics.median(r for (n, _), r in zip(cells, ratios, strict=True) if n >= 8):.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
