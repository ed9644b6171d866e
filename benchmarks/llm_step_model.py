"""The LLM step model on step shapes it was not fitted on.

    taskset -c 1 .venv/bin/python benchmarks/llm_step_model.py [--repeats 5]

One process, one runner built as ``serve --llm`` builds it (``build_llm_engine``: the default tiny
Llama, fp32, one torch thread, its row plan measured). Timed in one round-robin (forward + argmax,
median of ``--repeats``, as ``profile_llm_steps`` times its grid):

* the profile's grid (``profile_llm_steps``'s defaults: decode counts between the powers of two,
  contexts 64/256/512/1024);
* held-out shapes no grid holds: decode steps of 1-16, 19, 20, 23, 24, 28, 31, 32, 40 and 48 sequences
  at contexts 128, 320, 480 and 700 and at contexts drawn from 50-900 (seeded; the grid's decodes
  share one context, a live step's do not), and mixed steps (a prefill of 20/60/200 tokens beside
  2/5/11 decodes at context 300).

The step model ``profile_llm_steps`` fits on the grid's timings prices the held-out shapes. Printed: the
mean error (predicted / measured - 1) and the mean and largest |error| over the held-out decode steps,
the mean over the mixed ones, and the decode errors per count of sequences and per context.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from batchpilot.models.llm.runner import step_plan
from batchpilot.profile.llm import _plan, profile_llm_steps
from batchpilot.runtime.llm.build import build_llm_engine

COUNTS = tuple(range(1, 17)) + (19, 20, 23, 24, 28, 31, 32, 40, 48)
CONTEXTS: tuple[int | str, ...] = (128, 320, 480, 700, "50-900")
MIXED = tuple((p, b) for p in (20, 60, 200) for b in (2, 5, 11))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    engine = build_llm_engine(None, threads=1, start=False)
    runner = engine.runner
    print(f"row plan (rows: padded to): {runner.row_plan.padded() or 'none'}")
    profile = profile_llm_steps(runner)
    grid = profile.meta["step_points"]
    rng = np.random.default_rng(5)
    held = [_plan(runner, [], b, c) if isinstance(c, int)
            else step_plan(runner, [], rng.integers(50, 901, b).tolist()) for b in COUNTS for c in CONTEXTS]
    held += [_plan(runner, [p], b, 300) for p, b in MIXED]
    times: list[list[float]] = [[] for _ in held]
    with torch.inference_mode():
        for plan in held:
            runner.forward(plan.chunks).argmax(-1).tolist()
        for _ in range(args.repeats):
            for plan, t in zip(held, times, strict=True):
                t0 = time.perf_counter()
                runner.forward(plan.chunks).argmax(-1).tolist()
                t.append(time.perf_counter() - t0)
    measured = np.array([sorted(t)[len(t) // 2] for t in times])

    nd = len(COUNTS) * len(CONTEXTS)
    print(f"{len(grid)} grid shapes; held out: {nd} decode steps, {len(MIXED)} mixed")
    err = np.array([profile.latency(plan.shape) for plan in held]) / measured - 1.0
    dec = err[:nd]
    print(f"the step model: decode mean {dec.mean():+.1%}, mean |error| {np.abs(dec).mean():.1%}, largest "
          f"{np.abs(dec).max():.1%}; mixed mean {err[nd:].mean():+.1%}")
    by = dec.reshape(len(COUNTS), len(CONTEXTS))
    print("  by sequences (mean over contexts): "
          + " ".join(f"{b}:{e:+.1%}" for b, e in zip(COUNTS, by.mean(axis=1), strict=True)))
    print("  by context (mean over counts): "
          + " ".join(f"{c}:{e:+.1%}" for c, e in zip(CONTEXTS, by.mean(axis=0), strict=True)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
