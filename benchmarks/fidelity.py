"""Simulator vs live server over a matrix: three workloads, unpinned and pinned, each run profiled first.

    .venv/bin/python benchmarks/fidelity.py [--requests 1000] [--workloads conv-embed mmpp bimodal]
                                            [--pinnings none 1] [--profile-once] [--out bench-out/fidelity]

For each pinning (``none``: server and load generator share both cores, torch on every core; ``1``:
the server and the profiler on core 1, the load generator on core 0) and each workload, ``batchpilot
profile`` runs first (``<workload>-<cpus>/profile.json``), then ``batchpilot bench fidelity`` runs
that workload with that profile at 50% and 80% of the predicted capacity (its own table: P50, P99,
throughput, rejected, mean batch size, with the machine's speed against the profile beside each
point). The prediction uses the profile file only; a profile made right before its run is the
freshest look at the machine's speed a prediction can have (on a shared VM that speed moves by
several percent within minutes). ``--profile-once``: one profile per pinning, first, for all its
workloads (``profile-<cpus>.json``).
This script prints every table and one summary of cells within target. Pass ``-- --live-repeats 2``
to replay each point a second time on the same server and see how far the live run agrees with itself,
``-- --speed-check`` to predict each point from a recheck of the profile made right before it (the
profile-alone errors beside, ``fidelity_summary.py`` counts both).

Workloads: ``conv-embed`` (the standard trace slice), ``mmpp`` (bursty on/off arrivals, lognormal
lengths) and ``bimodal`` (Poisson arrivals, 80% short and 20% long inputs).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

WORKLOADS = {
    "conv-embed": ["--workload", "conv-embed"],
    "mmpp": ["--workload", "mmpp:rate_on=8,rate_off=1,on_s=10,off_s=20",
             "--lengths", "lognormal:median=128,sigma=0.8"],
    "bimodal": ["--workload", "poisson:rate=4", "--lengths", "bimodal:short=24,long=400,p_long=0.2"],
}


def make_profile(cli: list[str], path: Path, label: str) -> Path:
    """``batchpilot profile`` (``cli``: the command, pinned or not) written to ``path``."""
    t0 = time.monotonic()
    path.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([*cli, "profile", "--padding", "none", "-o", str(path)], check=True,
                   stdout=subprocess.DEVNULL)
    print(f"profile ({label}): {path} in {time.monotonic() - t0:.0f} s", flush=True)
    return path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=1000, help="rows per load point")
    ap.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    ap.add_argument("--pinnings", nargs="+", default=["none", "1"], help="'none' or taskset cores")
    ap.add_argument("--out", default="bench-out/fidelity")
    ap.add_argument("--profile-once", action="store_true",
                    help="one profile per pinning for all its workloads, instead of one made right before "
                         "each workload's run")
    ap.add_argument("extra", nargs=argparse.REMAINDER, help="after --: more `bench fidelity` options")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cli = [sys.executable, "-m", "batchpilot.cli"]
    extra = [a for a in args.extra if a != "--"]
    summary = []
    for pin in args.pinnings:
        cpus = [] if pin == "none" else ["--cpus", pin]
        taskset = [] if pin == "none" else ["taskset", "-c", pin]
        shared = make_profile([*taskset, *cli], out / f"profile-{pin}.json", pin) if args.profile_once \
            else None
        for name in args.workloads:
            run_out = out / f"{name}-{pin}"
            profile = shared or make_profile([*taskset, *cli], run_out / "profile.json", f"{name}, {pin}")
            cmd = [*cli, "bench", "fidelity", *WORKLOADS[name], "--requests", str(args.requests),
                   "--profile", str(profile), *cpus, "--no-progress", "--out", str(run_out), *extra]
            print(f"\n$ {' '.join(cmd)}", flush=True)
            rc = subprocess.run(cmd).returncode
            if rc != 0:
                summary.append((name, pin, "failed", "", "", ""))
                continue
            res = json.loads((run_out / "fidelity.json").read_text())
            rows = res["table"]["rows"]
            scored = [r for r in rows if r[7] in ("yes", "no")]
            speeds = [f"{p['speed_vs_profile']:+.1%}" for p in res["points"]]
            repeat = res.get("repeat_table", {}).get("rows", [])
            again = [f"{r[4]}" for r in repeat if r[1] in ("P50 ms", "P99 ms")]
            summary.append((name, pin, f"{sum(r[7] == 'yes' for r in scored)}/{len(scored)}",
                            f"{res['capacity_rps']:.2f}", ", ".join(speeds), " ".join(again) or "-"))
    print("\nworkload     cpus  cells within target  predicted capacity req/s  speed vs profile (per load)"
          "  live again: P50 P99 (per load)")
    for name, pin, cells, cap, speed, again_cell in summary:
        print(f"{name:<12} {pin:<5} {cells:>19}  {cap:>24}  {speed:<27}  {again_cell}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
