"""Intra-op threads per batch: the embedded encoder's forward at each thread count, and the plan.

    .venv/bin/python benchmarks/threads.py [--dtype bfloat16] [--repeats 7]

One process, the embedded all-MiniLM-L6-v2 (``load_model`` as ``serve`` loads it, padding-free
forward). For each batch shape (n inputs x tokens), ``EncoderExecutor.run`` is timed at 1, 2, ...
threads, the counts interleaved round by round (the first round a warm-up); the median ms per count
and the ratio of the fewest threads to the most. Then the per-batch plan ``models/encoder.py``
measures on its own probe (what ``serve`` runs without ``--threads``), and the ms of each shape on
that plan, interleaved with the fixed counts again: the plan is worth having where its column is
the lowest in a row. Nothing here is asserted; it prints what this machine does.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from batchpilot.models.device import available_cores
from batchpilot.models.encoder import candidate_counts, make_batch, plan_for
from batchpilot.models.tasks import load_model

SHAPES = ((1, 13), (1, 64), (1, 160), (1, 300), (4, 64), (8, 128), (16, 200), (32, 256))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    cores = available_cores()
    ex = load_model(None, dtype=args.dtype, num_threads=cores)  # a fixed pool while timing the counts
    ex.warmup()
    plan = plan_for(ex, None)  # the plan `serve` would measure at start-up
    counts = candidate_counts(cores)
    print(f"{ex.model_name}, {args.dtype}, {cores} cores; plan: {plan.describe()}")
    print("| batch | " + " | ".join(f"{c} thread{'s' if c > 1 else ''} ms" for c in counts)
          + " | plan ms (count) | fewest / most |")
    print("|---|" + "---|" * (len(counts) + 2))
    for n, length in SHAPES:
        ids = [[1000 + i for i in range(length)]] * n
        runs = {c: [] for c in [*counts, "plan"]}
        for r in range(args.repeats + 1):
            for c in runs:
                ex.threads = plan if c == "plan" else None
                if c != "plan":
                    torch.set_num_threads(c)
                t0 = time.perf_counter()
                ex.run(ex.prepare(make_batch(ids, "none", ex.max_length)))
                if r:
                    runs[c].append((time.perf_counter() - t0) * 1e3)
        ms = {c: statistics.median(v) for c, v in runs.items()}
        cells = " | ".join(f"{ms[c]:.2f}" for c in counts)
        print(f"| {n} x {length} | {cells} | {ms['plan']:.2f} ({plan.threads_for(n * length)}) "
              f"| {ms[counts[0]] / ms[counts[-1]]:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
