"""How much faster the rows after a measured slice arrive than the slice's own rows (why ``bench fidelity``
slows its calibration traffic to the measured rows' rate: ``bench.capacity.rate_matched``).

    python benchmarks/calibration_rates.py conv-llm 200 0.206 0.329      # --requests, rate scales
    python benchmarks/calibration_rates.py conv-embed 1500 1.079 1.726

For each rate scale: the measured rows (the slice's first ``--max-live-s`` seconds at that scale) and
the ``--calibration-s`` seconds of rows after them, sped up alike (the old calibration) and rate-matched
(the new one): their mean rates and the ratio. Pure trace arithmetic, no server.
"""

from __future__ import annotations

import argparse

from batchpilot.bench.capacity import probe_workload, rate_matched
from batchpilot.sim.workloads import load_workload


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("workload")
    ap.add_argument("requests", type=int)
    ap.add_argument("rate_scales", type=float, nargs="+")
    ap.add_argument("--max-live-s", type=float, default=120.0)
    ap.add_argument("--calibration-s", type=float, default=45.0)
    args = ap.parse_args()
    wl = load_workload(args.workload, 1.0, 0, args.requests)

    def rate(w) -> float:  # type: ignore[no-untyped-def]
        return (len(w) - 1) / float(w.arrival_s[-1] - w.arrival_s[0])

    for k in args.rate_scales:
        measured = probe_workload(wl, k, args.max_live_s)
        n = len(measured)
        rest = wl.slice(n, len(wl) - n)
        old = probe_workload(rest, k, args.calibration_s)
        new = rate_matched(rest, wl.slice(0, n), k, args.calibration_s)
        print(f"x{k:g}: measured {n} rows at {rate(measured):.2f} req/s; rows after them, sped up alike: "
              f"{rate(old):.2f} req/s ({rate(old) / rate(measured):.2f}x); rate-matched: "
              f"{rate(new):.2f} req/s")


if __name__ == "__main__":
    main()
