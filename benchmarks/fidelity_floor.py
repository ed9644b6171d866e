"""How often can a prediction meet the 10% latency targets at a matrix's points? The noise at each point.

    .venv/bin/python benchmarks/fidelity_floor.py DIR [--draws 40] [--requests N]

DIR is a `benchmarks/fidelity.py --out DIR -- --live-repeats 2` run. A 10% target on P50 and P99 is
checked against one live replay, and a replay is one draw of what the server does with those rows: its
batches' times spread, the machine's speed wanders, and a P99 is set by the requests of a few seconds.
Two measures of that draw's spread per point, beside the prediction's own score:

* **the simulator's draws**: the point predicted again, as `bench fidelity` predicts it (its profile,
  deployment and rate), with ``--draws`` seeds of the batch-time spread and speed wander the profile
  measured (`sim.draws`); per metric, the share of the draws that their median is within 10% of. It is
  the chance that a prediction whose only error is that spread meets the target against a replay that
  varies as the draws do. Summed over the points: the cells such an error-free model meets on average;
  multiplied: the chance that it meets every one.
  The profile's spread and wander are the model's, measured in a minute of its loaded phase; a live
  run also drifts over its minutes, so the live replays spread at least this much;
* **the live run against itself**: the second replay against the first, under the same target.

The sums bound the score a prediction made before the run can be expected to reach at these points.
``--requests N`` predicts N rows per point instead of the run's (the live columns stay the run's):
how many rows a point would need for the draws to agree within the targets.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fidelity import WORKLOADS  # noqa: E402

from batchpilot.bench.cli import fidelity_workload
from batchpilot.bench.fidelity import simulate, within_target
from batchpilot.cli import build_parser  # noqa: E402
from batchpilot.core.costmodel import CostModel  # noqa: E402
from batchpilot.settings import spec_from_args
from batchpilot.sim.cli import resolve  # noqa: E402
from batchpilot.sim.service import FrontEnd  # noqa: E402

METRICS = (("P50", "p50"), ("P99", "p99"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--draws", type=int, default=40)
    ap.add_argument("--requests", type=int, default=0,
                    help="rows per point to predict (default: the run's); more rows, at the point's rate, "
                         "show how long a point must run for the draws to agree within the targets")
    args = ap.parse_args()
    print("| workload | cpus | load | P50: draws within 10% of their median | P99: the same | P99 draws, "
          "5-95% over their median | live again vs first, P50 / P99 | prediction vs first, P50 / P99 |")
    print("|---|---|---|---|---|---|---|---|")
    sums = {"draws": np.zeros(2), "all": np.ones(2), "again": np.zeros(2), "pred": np.zeros(2), "points": 0}
    for run in sorted(p for p in args.out.iterdir() if (p / "fidelity.json").exists()):
        fj = json.loads((run / "fidelity.json").read_text())
        workload, cpus = run.name.rsplit("-", 1)
        ns = build_parser().parse_args(["bench", "fidelity", *WORKLOADS[workload],
                                        "--requests", str(args.requests or fj["requests"])])
        spec = spec_from_args(ns)
        cost_model = CostModel.load(run / "profile.json")
        served = FrontEnd.from_profile(run / "profile.json").serving(spec.server.tokenizer_workers)
        deployment, wl = resolve(spec, cost_model), fidelity_workload(ns)
        for point in fj["points"]:
            scaled = wl.scale_rate(point["rate_scale"])
            drawn = simulate(scaled, deployment.scheduler, cost_model, 1.0, served, 0.0, args.draws).drawn
            first = point["measured"]["latency"]
            again = (point.get("repeats") or [{}])[0].get("measured", {}).get("latency")
            pred = point["predicted"]["latency"]
            shares, agree, hits = [], [], []
            for i, (name, key) in enumerate(METRICS):
                def within(pred: float, meas: float, name: str = name) -> bool:
                    return bool(within_target(name, pred, meas))

                values = drawn.values(key)
                median = float(np.median(values))
                shares.append(float(np.mean([within(median, v) for v in values])))
                agree.append(within(again[key], first[key]) if again else False)
                hits.append(within(pred[key], first[key]))
                sums["draws"][i] += shares[-1]
                sums["all"][i] *= shares[-1]
                sums["again"][i] += agree[-1]
                sums["pred"][i] += hits[-1]
            sums["points"] += 1
            p99 = drawn.values("p99")
            lo, hi = np.percentile(p99, [5, 95]) / np.median(p99) - 1.0
            mark = {True: "yes", False: "no"}
            print(f"| {workload} | {cpus} | {point['load']:.0%} | {shares[0]:.0%} | {shares[1]:.0%} | "
                  f"{lo:+.0%} .. {hi:+.0%} | {mark[agree[0]]} / {mark[agree[1]]} | "
                  f"{mark[hits[0]]} / {mark[hits[1]]} |", flush=True)
    n = sums["points"]
    print(f"\nover {n} points, P50 / P99 cells within 10%:")
    print(f"  expected of a prediction whose only error is the draws' spread ({args.draws} draws): "
          f"{sums['draws'][0]:.1f} / {sums['draws'][1]:.1f}; the chance it meets every one: "
          f"{sums['all'][0]:.1%} / {sums['all'][1]:.1%}")
    again, pred = sums["again"], sums["pred"]
    print(f"  the live run's second replay against its first: {again[0]:.0f} / {again[1]:.0f}")
    print(f"  the prediction against the first replay (the score): {pred[0]:.0f} / {pred[1]:.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
