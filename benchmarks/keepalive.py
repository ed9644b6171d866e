"""What reconnecting clients cost a bursty load: the same fidelity point measured with the load generator
dropping idle connections after 2 s and keeping them while the server does.

    .venv/bin/python benchmarks/keepalive.py [--rounds 2] [--requests 2000] [--cpus 1] [--out DIR]

One ``batchpilot profile`` (pinned like the server), then ``batchpilot bench fidelity`` on mmpp (the
matrix's: ``mmpp:rate_on=8,rate_off=1,on_s=10,off_s=20``, lognormal lengths) with that profile, in
rounds, the order of the two settings alternating: ``--keepalive-s 2`` (the load generator's default
against a ``--url``: each burst after an off period opens its connections again) and the default of
``bench fidelity`` (the server's keep-alive less 5 s: a burst reuses the connections of the last
one). Both predictions are the same (the same profile and rows); each live run is printed with its
P50 and P99 at 50% and 80% of the predicted capacity, the error against the prediction and the run's
speed against the profile (its own batches), so that a difference in speed is not read as the
connections' doing.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

WORKLOAD = ["--workload", "mmpp:rate_on=8,rate_off=1,on_s=10,off_s=20",
            "--lengths", "lognormal:median=128,sigma=0.8"]
SETTINGS = {"2 s": ["--keepalive-s", "2"], "server's less 5 s": []}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--cpus", default="1", help="server and profiler cores ('none': unpinned)")
    ap.add_argument("--out", default="bench-out/keepalive")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cli = [sys.executable, "-m", "batchpilot.cli"]
    pin = [] if args.cpus == "none" else ["--cpus", args.cpus]
    taskset = [] if args.cpus == "none" else ["taskset", "-c", args.cpus]
    profile = out / "profile.json"
    subprocess.run([*taskset, *cli, "profile", "--padding", "none", "-o", str(profile)], check=True,
                   stdout=subprocess.DEVNULL)
    names = list(SETTINGS)
    print(f"{'round':>5}  {'client keep-alive':<18} {'load':>5} {'P50 ms':>16} {'P99 ms':>18} "
          f"{'speed vs profile':>17}")
    for r in range(args.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            run = out / f"r{r + 1}-{name.split()[0]}"
            subprocess.run([*cli, "bench", "fidelity", *WORKLOAD, "--requests", str(args.requests),
                            "--profile", str(profile), *pin, "--no-progress", "--out", str(run),
                            *SETTINGS[name]], check=True, stdout=subprocess.DEVNULL)
            for point in json.loads((run / "fidelity.json").read_text())["points"]:
                pred, meas = point["predicted"]["latency"], point["measured"]["latency"]
                cells = [f"{meas[q] * 1e3:7.1f} ({(pred[q] - meas[q]) / meas[q]:+6.1%})"
                         for q in ("p50", "p99")]
                print(f"{r + 1:>5}  {name:<18} {point['load']:>5.0%} {cells[0]:>16} {cells[1]:>18} "
                      f"{point['speed_vs_profile']:>+17.1%}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
