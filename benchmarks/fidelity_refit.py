"""The same live runs, predicted again from their profiles refitted by this checkout's code.

    .venv/bin/python benchmarks/fidelity_refit.py DIR [--linear] [--no-wander] [--no-rate-slope]
        [--at-profile] [--draws 10]

For each run of `benchmarks/fidelity.py --out DIR`, its profile (DIR/<workload>-<cpus>/profile.json) is
fitted again from what the profile measured itself (``rate_slope.priced_by``): the grid points
(``CostModel.fit`` on ``models.profiler.fitted_features``, or the four linear features with
``--linear``) and the loaded batches it kept (``profile.serving.fit_loaded``; ``--no-wander`` sets the
speed wander to 0 and leaves the residuals whole; ``--no-rate-slope`` fits the line without the
accounted CPU per request, the level in ``loaded_alpha``). Every point is then predicted again at its
run's own speed (the run's batches against the refitted profile, as `bench fidelity` measures it):
hindsight on the speed, nothing else taken from the live run; ``--at-profile``: at the profile's
speed, the prediction itself. Printed per point: the P50 and P99 errors, the bands of the draws (5-95%)
and whether the live P50 and P99 fell in them; then the counts. Variants of the model are scored on
the same live runs, so the live P99's spread from run to run does not enter the comparison.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fidelity import WORKLOADS  # noqa: E402
from rate_slope import by_point, priced_by  # noqa: E402

from batchpilot.bench.cli import fidelity_workload
from batchpilot.bench.fidelity import simulate
from batchpilot.cli import build_parser  # noqa: E402
from batchpilot.settings import spec_from_args
from batchpilot.sim.cli import resolve  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--linear", action="store_true", help="fit the four linear features only")
    ap.add_argument("--no-wander", action="store_true", help="no speed wander: residuals drawn whole")
    ap.add_argument("--no-rate-slope", action="store_true", help="the loaded line without the rate term")
    ap.add_argument("--at-profile", action="store_true", help="predict at the profile's speed")
    ap.add_argument("--draws", type=int, default=10)
    args = ap.parse_args()
    tally: list[tuple[bool, bool, bool]] = []
    for run in sorted(p for p in args.out.iterdir() if (p / "fidelity.json").exists()):
        fj = json.loads((run / "fidelity.json").read_text())
        cost_model, frontend = priced_by(run / "profile.json", True, linear=args.linear,
                                         wander=not args.no_wander, slope=not args.no_rate_slope)
        speeds = [r for _, r, _ in by_point(run, run / "profile.json", False, models=(cost_model, frontend))]
        workload = run.name.rsplit("-", 1)[0]
        ns = build_parser().parse_args(["bench", "fidelity", *WORKLOADS[workload],
                                        "--requests", str(fj["requests"])])
        spec = spec_from_args(ns)
        served = frontend.serving(spec.server.tokenizer_workers)
        deployment, wl = resolve(spec, cost_model), fidelity_workload(ns)
        for point, speed in zip(fj["points"], speeds, strict=True):
            pred = simulate(wl.scale_rate(point["rate_scale"]), deployment.scheduler, cost_model, 1.0, served,
                            0.0 if args.at_profile else speed - 1.0, args.draws)
            live, got = point["measured"]["latency"], pred.summary.latency
            lo, hi = pred.drawn.band("p99")
            lo50, hi50 = pred.drawn.band("p50")
            e50, e99 = got["p50"] / live["p50"] - 1.0, got["p99"] / live["p99"] - 1.0
            inside, inside50 = lo <= live["p99"] <= hi, lo50 <= live["p50"] <= hi50
            tally.append((abs(e50) <= 0.1, abs(e99) <= 0.1, inside, inside50))
            print(f"{run.name:16s} {point['load']:.0%}  speed {speed - 1:+.1%}  "
                  f"wander {frontend.loaded_wander:.3f}  "
                  f"P50 {e50:+.1%} band {lo50 * 1e3:.0f}..{hi50 * 1e3:.0f} {'in' if inside50 else 'out'}  "
                  f"P99 {got['p99'] * 1e3:6.1f} / {live['p99'] * 1e3:6.1f} ms {e99:+.1%}  "
                  f"band {lo * 1e3:.0f}..{hi * 1e3:.0f} {'in' if inside else 'out'}", flush=True)
    n = len(tally)
    print(f"within 10%: P50 {sum(t[0] for t in tally)}/{n}, P99 {sum(t[1] for t in tally)}/{n}; "
          f"live P50 in the draws' band {sum(t[3] for t in tally)}/{n}, "
          f"live P99 in the draws' band {sum(t[2] for t in tally)}/{n}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
