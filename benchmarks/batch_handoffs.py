"""The embedding server's time between batches, read from its batch log (``serve --batch-log``).

    python benchmarks/batch_handoffs.py OUT/batches.jsonl      # e.g. what `bench fidelity` wrote

For a one-slot server: back to back (the next batch was formed before this one ended, so it could
start right away) the gap from this batch's end to the next one's start — what the slot idles between
batches, which the simulator does not model — and for a batch formed while the slot was idle, its
formation to its start (the prepare stage and the thread hand-offs). If both are small beside the
batches, the simulator's "a batch starts when formed or when the slot frees" holds.
"""

from __future__ import annotations

import argparse

import numpy as np

from batchpilot.bench.batch_fit import read_batches


def stats(ms: np.ndarray) -> str:
    if not ms.size:
        return "none"
    p50, p90, p99 = np.percentile(ms, [50, 90, 99])
    return f"n {ms.size}, mean {ms.mean():.2f} ms, P50 {p50:.2f}, P90 {p90:.2f}, P99 {p99:.2f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("batch_log")
    args = ap.parse_args()
    batches = read_batches(args.batch_log)[0]
    if not batches or not np.isfinite(batches[0].formed):
        raise SystemExit("no batches, or a log written before batches carried their formation time")
    back, idle = [], []
    for prev, b in zip(batches, batches[1:], strict=False):
        end = prev.start + prev.slot_s
        if b.formed <= end:
            back.append(b.start - end)
        else:
            idle.append(b.start - b.formed)
    print(f"{len(batches)} batches, mean slot {np.mean([b.slot_s for b in batches]) * 1e3:.1f} ms")
    print(f"back to back, end -> next start: {stats(np.array(back) * 1e3)}")
    print(f"formed while idle, formed -> start: {stats(np.array(idle) * 1e3)}")


if __name__ == "__main__":
    main()
