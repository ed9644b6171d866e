"""How often an embedding batch runs far over its prediction, per batch log (``serve --batch-log``).

    python benchmarks/batch_outliers.py OUT1/batches.jsonl OUT2/batches.jsonl ... [--over-ms 40]

Each batch's expected time is the server's own prediction for it (``predicted_s``, the profile)
scaled by the log's median measured/predicted ratio (the CPU's speed over the log). A batch more than
``--over-ms`` over that is an outlier: something stopped the model thread (a garbage collection
stops every thread; another process on the core). Prints, per log, the batches, the outliers per
thousand batches and the worst excess. Compare logs written before and after a change to the server.
"""

from __future__ import annotations

import argparse

import numpy as np

from batchpilot.bench.llm_steps import read_json_lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("logs", nargs="+")
    ap.add_argument("--over-ms", type=float, default=40.0)
    args = ap.parse_args()
    for path in args.logs:
        rows = [d for d in read_json_lines(path)[0] if d.get("predicted_s", 0) > 0]
        if not rows:
            print(f"{path}: no batches with a prediction")
            continue
        slot = np.array([d["slot_s"] for d in rows])
        pred = np.array([d["predicted_s"] for d in rows])
        excess = (slot - pred * float(np.median(slot / pred))) * 1e3
        over = excess > args.over_ms
        print(f"{path}: {len(rows)} batches, {over.sum()} over by > {args.over_ms:g} ms "
              f"({over.sum() / len(rows) * 1e3:.1f} per 1000), worst +{excess.max():.0f} ms")


if __name__ == "__main__":
    main()
