"""The LLM step model on step shapes it was not fitted on: the profile's grid and features against a
grid of powers of two without ``decode_ctx_sq``.

    taskset -c 1 .venv/bin/python benchmarks/llm_step_model.py [--repeats 5]

One process, one runner built as ``serve --llm`` builds it (``build_llm_engine``: the default tiny
Llama, fp32, one torch thread, its row plan measured). Timed in one round-robin (forward + argmax,
median of ``--repeats``, as ``profile_llm_steps`` times its grid):

* the profile's grid (``profile_llm_steps``'s defaults: decode counts between the powers of two,
  contexts 64/256/512/1024);
* held-out shapes no grid holds: decode steps of 1-16, 19, 20, 23, 24, 28, 31, 32, 40 and 48 sequences
  at contexts 128, 320, 480 and 700, and mixed steps (a prefill of 20/60/200 tokens beside 2/5/11
  decodes at context 300).

Two step models are fitted on the grid's timings (``CostModel.fit``): "profile" (the whole grid,
``LLM_FEATURES``) and "powers of two" (only its decode counts 1/2/4/8/16/32/64 at contexts
64/256/1024, the prefills and mixes, without ``decode_ctx_sq``), and each prices the held-out shapes.
Printed per model: the mean error (predicted / measured - 1) and mean and largest |error| over the
held-out decode steps, the mean over the mixed ones, and the decode errors per count of sequences.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from batchpilot.core.costmodel import LLM_FEATURES, CostModel, ProfilePoint
from batchpilot.models.llm.profile import _plan, profile_llm_steps
from batchpilot.runtime.llm_build import build_llm_engine

COUNTS = tuple(range(1, 17)) + (19, 20, 23, 24, 28, 31, 32, 40, 48)
CONTEXTS = (128, 320, 480, 700)
MIXED = tuple((p, b) for p in (20, 60, 200) for b in (2, 5, 11))
POWERS = {1, 2, 4, 8, 16, 32, 64}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    engine = build_llm_engine(None, threads=1, start=False)
    runner = engine.runner
    print(f"row plan (rows: padded to): {runner.row_plan.padded() or 'none'}")
    grid = profile_llm_steps(runner).meta["step_points"]
    held = [_plan(runner, [], b, c) for b in COUNTS for c in CONTEXTS]
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

    def points(powers_only: bool) -> list[ProfilePoint]:
        out = []
        for p in grid:
            if not powers_only or p["decodes"] == 0 or p["prefills"] or (
                    p["decodes"] in POWERS and p["context"] in (64, 256, 1024)):
                shape = _plan(runner, p["prefills"], p["decodes"], p["context"]).shape
                out.append(ProfilePoint(shape.features(), p["latency_s"]))
        return out

    models = {"profile": CostModel.fit(points(False), LLM_FEATURES),
              "powers of two": CostModel.fit(points(True), LLM_FEATURES[:-1])}
    nd = len(COUNTS) * len(CONTEXTS)
    print(f"{len(grid)} grid shapes; held out: {nd} decode steps, {len(MIXED)} mixed")
    for name, model in models.items():
        pred = np.array([model.latency(plan.shape) for plan in held])
        err = pred / measured - 1.0
        dec = err[:nd]
        print(f"\n{name} ({len(model.feature_names)} features): decode mean {dec.mean():+.1%}, mean |error| "
              f"{np.abs(dec).mean():.1%}, largest {np.abs(dec).max():.1%}; mixed mean {err[nd:].mean():+.1%}")
        by_count = dec.reshape(len(COUNTS), len(CONTEXTS)).mean(axis=1)
        print("  by sequences (mean over contexts): "
              + " ".join(f"{b}:{e:+.1%}" for b, e in zip(COUNTS, by_count, strict=True)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
