"""The simulator against queueing theory, with the spread a fixed-seed test cannot show.

    .venv/bin/python benchmarks/sim_theory.py [--requests 200000] [--seeds 20] [--sim-seeds 3]

1. M/D/1 (batch size 1, Poisson, deterministic service D = 10 ms) at rho = 0.3, 0.5, 0.7: the mean
   wait over ``--seeds`` seeds from the Lindley recursion (which tests/test_sim_engine.py proves the
   simulator reproduces exactly) against Pollaczek-Khinchine ``Wq = lam D^2 / (2 (1 - rho))``: mean
   relative error and its spread (standard deviation across seeds), i.e. how tight a single seed is.
2. The simulator itself (real BatchScheduler, window policy, batch size 1) for ``--sim-seeds`` seeds
   at rho = 0.5: relative error to P-K and CPU seconds per run.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from batchpilot.core.config import PlannerConfig, PolicyConfig, SchedulerConfig
from batchpilot.core.costmodel import CostModel
from batchpilot.sim.synthetic import synthetic_workload
from batchpilot.sim.target import simulate_encoder

D = 0.01


def lindley_mean_wait(arrivals: np.ndarray, service: float) -> float:
    free, total = 0.0, 0.0
    for a in arrivals.tolist():
        start = a if a > free else free
        total += start - a
        free = start + service
    return total / len(arrivals)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=200_000)
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--sim-seeds", type=int, default=3)
    args = ap.parse_args()
    print(f"M/D/1, D = {D * 1e3:g} ms, {args.requests:,} requests per run")
    for rho in (0.3, 0.5, 0.7):
        lam = rho / D
        pk = lam * D * D / (2 * (1 - rho))
        errs = []
        for seed in range(args.seeds):
            wl = synthetic_workload(f"poisson:rate={lam}", args.requests, "constant:value=16", seed=seed)
            errs.append(lindley_mean_wait(wl.arrival_s, D) / pk - 1)
        e = np.asarray(errs)
        print(f"  rho {rho}: Lindley over {args.seeds} seeds: mean error {e.mean():+.2%}, spread (sd) "
              f"{e.std(ddof=1):.2%}, worst {np.abs(e).max():.2%}")
    rho = 0.5
    lam = rho / D
    pk = lam * D * D / (2 * (1 - rho))
    cfg = SchedulerConfig(policy=PolicyConfig(name="window", max_batch_size=1, max_wait_s=0.0),
                          planner=PlannerConfig(grouping="fifo", padding="dynamic"))
    cm = CostModel(latency_coef=(D, 0.0, 0.0, 0.0), memory_coef=(0.0, 0.0, 0.0, 0.0))
    for seed in range(args.sim_seeds):
        wl = synthetic_workload(f"poisson:rate={lam}", args.requests, "constant:value=16", seed=seed + 7)
        c0 = time.process_time()
        run = simulate_encoder(wl, cfg, cm)
        cpu = time.process_time() - c0
        wait = float(np.mean(np.asarray(run.record.dispatch_s) - wl.arrival_s))
        print(f"  simulator, rho {rho}, seed {seed + 7}: mean wait {wait * 1e3:.4f} ms vs P-K "
              f"{pk * 1e3:.4f} ms ({wait / pk - 1:+.2%}); {cpu:.1f} s CPU")


if __name__ == "__main__":
    main()
