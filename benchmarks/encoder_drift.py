"""How much fixed encoder batches' times move on this machine over minutes, with nothing else changing.

    taskset -c 1 python benchmarks/encoder_drift.py [--minutes 8] [--window-s 15]

MiniLM (one torch thread, the server's lean forward) times three fixed batches round-robin — 8 inputs
of 128 tokens, one of 32, two of 64 — and prints each one's median per window, then the spread of the
window medians (max / min - 1) and how far each window's three medians moved together (the speed) or
apart (the shape). A profile taken at one moment cannot be closer than this to a run minutes later;
``bench fidelity`` fits the profile's speed on the live server's own batches right before each load
point for that reason (``bench/batch_fit.py``). Run it with the machine otherwise idle.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=8.0)
    ap.add_argument("--window-s", type=float, default=15.0)
    args = ap.parse_args()
    import torch
    from drift_windows import window_medians

    from batchpilot.models.encoder import EncoderExecutor, make_batch

    torch.set_num_threads(1)
    ex = EncoderExecutor()
    ex.warmup()

    def ids(n: int) -> list[int]:
        return ex.tokenize_ids([[2000 + i for i in range(n - ex.num_special_tokens)]])[0]

    shapes = {"8x128": [ids(128)] * 8, "1x32": [ids(32)], "2x64": [ids(64)] * 2}
    batches = {k: make_batch(v, "dynamic", ex.max_length) for k, v in shapes.items()}

    def timer(batch: object) -> float:
        prepared = ex.prepare(batch)
        s = time.perf_counter()
        ex.run(prepared)
        return time.perf_counter() - s

    medians = window_medians({k: (lambda b=b: timer(b)) for k, b in batches.items()}, args.minutes,
                             args.window_s)
    rel = [[m / v[0] for m in v] for v in medians.values()]  # each shape against its first window
    apart = max(max(r[i] for r in rel) / min(r[i] for r in rel) - 1 for i in range(len(rel[0])))
    print(f"largest gap between the shapes' moves in one window: {apart:+.1%} (a speed moves them together)")


if __name__ == "__main__":
    main()
