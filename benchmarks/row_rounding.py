"""Padding-free bfloat16 on CPU: rounded row counts (``models.ragged.padded_rows``) vs exact ones.

    .venv/bin/python benchmarks/row_rounding.py [--dtype bfloat16] [--batches 120]

One process, one MiniLM executor, conv-embed lengths (random rows of the trace, seeded). For each
batch size, the same batches run twice through both arms, the arms alternating batch by batch:
"cold" is the first pass, where a row count may be new to oneDNN's kernel cache (what most batches
of a live server meet without rounding: a padding-free batch's row count is its total tokens), and
"warm" the second pass over the same batches. Printed: microseconds per real token, each arm.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import batchpilot.models.ragged as ragged
from batchpilot.models.encoder import EncoderConfig, EncoderExecutor
from batchpilot.sim.traces import load_workload


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batches", type=int, default=120, help="inputs per batch size (split into batches)")
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args()
    lens = np.asarray(load_workload("conv-embed", start=0, count=20000).input_tokens)
    ex = EncoderExecutor(EncoderConfig(dtype=args.dtype))
    rounded = ragged.RaggedEncoder._pads_rows
    arms = {"rounded": rounded, "exact": lambda self: False}
    rng = np.random.default_rng(args.seed)
    print(f"{args.dtype}, {ex.num_threads} threads; us per real token (lower is better)")
    for bs in (1, 4, 16):
        batches = [[[1000 + (j % 500) for j in range(int(min(max(n, 2), 512)))]
                    for n in rng.choice(lens, bs)] for _ in range(max(30, args.batches // bs))]
        took: dict[str, list[float]] = {a: [0.0, 0.0] for a in arms}
        for p in range(2):
            for i, b in enumerate(batches):
                for arm in (list(arms) if i % 2 else list(arms)[::-1]):
                    ragged.RaggedEncoder._pads_rows = arms[arm]  # type: ignore[method-assign]
                    t = time.perf_counter()
                    ex.encode(b, padding="none")
                    took[arm][p] += time.perf_counter() - t
        ragged.RaggedEncoder._pads_rows = rounded  # type: ignore[method-assign]
        tok = sum(sum(map(len, b)) for b in batches)
        cells = [f"{a} cold {v[0] / tok * 1e6:.0f} warm {v[1] / tok * 1e6:.0f}" for a, v in took.items()]
        ratio = took["exact"][0] / took["rounded"][0]
        print(f"batch {bs:2d} ({len(batches)} batches): " + " | ".join(cells)
              + f" | cold exact/rounded {ratio:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
