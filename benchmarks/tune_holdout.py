"""Does a tuned config keep its lead on rows it was not tuned on?

    .venv/bin/python benchmarks/tune_holdout.py best.yaml [more.yaml ...] [--start 0] [--requests N]
                                                [--sla-p99 1.0] [--profile p.json]

``batchpilot tune`` searches on a slice (default: the first 8000 rows of conv-embed). This measures the
simulated capacity (highest rate at which P99 incl. failures <= SLA, bisected to 2%) of the given
YAML configs, the batchpilot default and the tuner's baselines on another slice (default: the whole
trace, ~1 hour, with bursts the tuning slice never saw) and prints each one's gain over the
TorchServe/Ray Serve-style window baseline, all measured in this run.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from batchpilot.core.config import SchedulerConfig
from batchpilot.core.costmodel import CostModel
from batchpilot.settings import load_spec
from batchpilot.sim.traces import load_workload
from batchpilot.sim.tune import Candidate, TuneConfig, Tuner, baselines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("configs", nargs="+")
    ap.add_argument("--workload", default="conv-embed")
    ap.add_argument("--start", type=int, default=0)
    ap.add_argument("--requests", type=int, default=None)
    ap.add_argument("--sla-p99", type=float, default=1.0)
    ap.add_argument("--profile", default=None)
    args = ap.parse_args()
    wl = load_workload(args.workload, start=args.start, count=args.requests)
    cm = CostModel.load(args.profile) if args.profile else CostModel.default_cpu_minilm()
    tuner = Tuner(wl, cm, TuneConfig(sla_p99_s=args.sla_p99))
    cands = [Candidate(Path(p).name, load_spec(p).encoder) for p in args.configs]
    cands += [Candidate("batchpilot default", SchedulerConfig(), "default"), *baselines(SchedulerConfig())]
    print(f"{wl.name}: rows [{args.start}, {args.start + len(wl)}), {wl.mean_rate:.2f} req/s at scale 1, "
          f"P99 <= {args.sla_p99:g} s")
    for c in cands:
        tuner.capacity(c, wl, rel_tol=0.02, start=1.0)
    ref = next(c for c in cands if c.label.startswith("window bs10"))
    for c in cands:
        gain = c.rps / ref.rps if ref.rps else float("nan")
        print(f"  {c.label:36s} capacity x{c.capacity:6.3f} = {c.rps:6.2f} req/s  vs {ref.label}: "
              f"x{gain:.2f}")


if __name__ == "__main__":
    main()
