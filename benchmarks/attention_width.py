"""Attention width on CPU: exact sequence lengths against lengths rounded up to a multiple of 16.

    .venv/bin/python benchmarks/attention_width.py [--threads 1] [--rounds 5] [--batches 40] [--padding none]

Two parts, both in one process, every pair of arms interleaved call by call:

* ``kernel``: ``F.scaled_dot_product_attention`` (torch's fused CPU kernel) on ``[8, 12, L, 32]`` at
  L = 127 and 128 (bfloat16), then on ``[n, 12, L, 32]``
  (MiniLM's heads) for L = 5, 23, ..., 509 and n = 1 and 8, in bfloat16 and float32: at the exact
  width against the width rounded up to ``CPU_ATTENTION_MULTIPLE`` with the padded keys masked.
  Printed: the sum over all L of each arm's median time, and their ratio.
* ``model``: the MiniLM forward (``serve``'s executor, ``--dtype auto``; padding-free, or padded to
  the longest input with ``--padding dynamic``) on batches of 1, 4 and 16 neighbouring conv-embed
  rows, the same batches with the attention width rounded (the default, ``models/lean.py``) and
  exact (multiple 1). Printed: µs per token of each, their ratio,
  and how well a cost model fitted on the profile grid's batches prices the live-like ones in each arm
  (mean signed error; negative = priced low).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import numpy as np
import torch
import torch.nn.functional as F

import batchpilot.models.lean as lean
from batchpilot.core.costmodel import CostModel
from batchpilot.models.profiler import STANDARD_BATCH_SIZES, STANDARD_LENGTHS, _Shape, grid_lengths
from batchpilot.models.tasks import load_model
from batchpilot.sim.traces import load_workload


def _median_ms(fn: object, k: int) -> float:
    fn()  # type: ignore[operator]
    ts = []
    for _ in range(k):
        t0 = time.perf_counter()
        fn()  # type: ignore[operator]
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3


def kernel(rounds: int) -> None:
    m = lean.CPU_ATTENTION_MULTIPLE
    for L in (127, 128):  # one partial tile against none, both at their exact width
        q = torch.randn(8, 12, L, 32, dtype=torch.bfloat16)
        ms = _median_ms(lambda q=q: F.scaled_dot_product_attention(q, q, q), 4 * rounds)
        print(f"kernel bfloat16 n= 8 L={L}: {ms:.2f} ms", flush=True)
    for dtype in (torch.bfloat16, torch.float32):
        for n in (1, 8):
            exact = rounded = 0.0
            for L in range(5, 513, 18):
                q = torch.randn(n, 12, L, 32, dtype=dtype)
                w = lean.attention_width(L, m)
                qw = torch.randn(n, 12, w, 32, dtype=dtype)
                mask = torch.arange(w)[None, None, None, :] < L if w > L else None
                exact += _median_ms(lambda q=q: F.scaled_dot_product_attention(q, q, q), rounds)
                rounded += _median_ms(lambda qw=qw, mask=mask: F.scaled_dot_product_attention(
                    qw, qw, qw, attn_mask=mask), rounds)
            print(f"kernel {str(dtype)[6:]:8s} n={n:2d}: exact {exact:8.2f} ms, width to {m}: "
                  f"{rounded:8.2f} ms  rounded/exact {rounded / exact:.3f}", flush=True)


def model(args: argparse.Namespace) -> None:
    ex = load_model(None, task="embed", num_threads=args.threads, dtype=args.dtype)  # as `serve` loads it
    ex.warmup()
    limit = int(ex.max_length)
    rng = random.Random(args.seed)
    rows = load_workload("conv-embed", start=0, count=5000).input_tokens
    trace = [min(max(int(x), 3), limit) for x in rows]
    live = {}
    for n in (1, 4, 16):
        out = []
        for _ in range(args.batches):
            pool = sorted(rng.sample(trace, 64))
            at = rng.randrange(len(pool) - n + 1)
            lens = pool[at:at + n]
            while sum(lens) > 4096:
                lens = lens[:-1]
            out.append(_Shape(ex, lens, args.padding, rng, False))
        live[n] = out
    grid = [_Shape(ex, grid_lengths(b, min(L, limit), limit, rng), args.padding, rng, False)
            for b in STANDARD_BATCH_SIZES for L in STANDARD_LENGTHS if b * L <= 4096]
    shapes = grid + [s for v in live.values() for s in v]
    arms = {"rounded": lean.CPU_ATTENTION_MULTIPLE, "exact": 1}
    times: dict[str, dict[int, list[float]]] = {a: {id(s): [] for s in shapes} for a in arms}
    order = list(shapes)
    for r in range(args.rounds):
        rng.shuffle(order)
        for s in order:
            for a in (list(arms) if r % 2 == 0 else list(arms)[::-1]):
                lean.CPU_ATTENTION_MULTIPLE = arms[a]
                t0 = time.perf_counter()
                ex.run(ex.prepare(s.batch))
                times[a][id(s)].append(time.perf_counter() - t0)
        print(f"model: round {r + 1}/{args.rounds}", flush=True)
    lean.CPU_ATTENTION_MULTIPLE = arms["rounded"]
    med = {a: {k: statistics.median(v) for k, v in t.items()} for a, t in times.items()}
    for n, batch in live.items():
        tok = sum(sum(s.lengths) for s in batch)
        us = {a: 1e6 * sum(med[a][id(s)] for s in batch) / tok for a in arms}
        print(f"model: batches of {n:2d} ({len(batch)}): rounded {us['rounded']:6.1f} µs/token, exact "
              f"{us['exact']:6.1f}  rounded/exact {us['rounded'] / us['exact']:.3f}")
    for a in arms:
        fit = CostModel.fit([_point(s, med[a][id(s)]) for s in grid])
        err = np.array([fit.latency(s.batch.shape.features()) / med[a][id(s)] - 1.0
                        for v in live.values() for s in v])
        print(f"model: {a:7s} grid fit on live-like batches: mean signed {np.mean(err):+.1%}, "
              f"median |error| {np.median(np.abs(err)):.1%}")


def _point(s: _Shape, latency: float) -> object:
    from batchpilot.core.costmodel import ProfilePoint

    return ProfilePoint(s.batch.shape.features(), latency)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--batches", type=int, default=40, help="live-like batches per batch size")
    ap.add_argument("--seed", type=int, default=3)
    ap.add_argument("--padding", choices=("none", "dynamic"), default="none")
    ap.add_argument("--part", choices=("kernel", "model", "both"), default="both")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.part in ("kernel", "both"):
        kernel(args.rounds)
    if args.part in ("model", "both"):
        model(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
