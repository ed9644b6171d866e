"""Simulator vs live server over the encoder matrix: three workloads, each at 50% and 80% of the
predicted capacity, each point replayed three times, scored against the replays' spread.

    .venv/bin/python benchmarks/fidelity.py [--requests 1000] [--workloads conv-embed mmpp bimodal]
                                            [--pinnings none] [--out bench-out/fidelity]
    .venv/bin/python benchmarks/fidelity.py --rescore [--out bench-out/fidelity]   # no server: ablation

For each pinning (``none``: server and load generator share both cores; ``1``: the server and the
profiler on core 1, the load generator on core 0) one ``batchpilot profile`` runs first
(``profile-<cpus>.json``), before any measured traffic; then ``batchpilot bench fidelity`` runs each
workload with that profile (``--live-repeats 3`` by default). The script prints each run's tables and
the matrix score over all its points: the bias (mean signed error against the replays' median) of P50,
P99 and throughput, and the latency cells inside the replays' range widened by 10%.

``--rescore`` runs no server: it predicts every point of the folders again (``bench fidelity --rescore
--ablate``) with each term of the service model removed in turn, and prints the matrix score per
variant — the ablation table of docs/simulator.md.

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
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from batchpilot.bench.fidelity import (  # noqa: E402
    SPREAD_METRICS,
    ablation_table,
    combine_results,
    format_matrix,
    text_table,
)

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
    ap.add_argument("--pinnings", nargs="+", default=["none"], help="'none' or taskset cores")
    ap.add_argument("--out", default="bench-out/fidelity")
    ap.add_argument("--rescore", action="store_true",
                    help="no server: predict the folders' points again with each service-model term removed")
    ap.add_argument("extra", nargs=argparse.REMAINDER, help="after --: more `bench fidelity` options")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cli = [sys.executable, "-m", "batchpilot.cli"]
    extra = [a for a in args.extra if a != "--"]
    for pin in args.pinnings:
        cpus = [] if pin == "none" else ["--cpus", pin]
        taskset = [] if pin == "none" else ["taskset", "-c", pin]
        profile = out / f"profile-{pin}.json"
        if not args.rescore:
            make_profile([*taskset, *cli], profile, pin)
        folders = []
        for name in args.workloads:
            run_out = out / f"{name}-{pin}"
            what = ["--rescore", str(run_out), "--ablate"] if args.rescore else \
                ["--profile", str(profile), *cpus, "--no-progress", "--out", str(run_out)]
            cmd = [*cli, "bench", "fidelity", *WORKLOADS[name], "--requests", str(args.requests), *what,
                   *extra]
            print(f"\n$ {' '.join(cmd)}", flush=True)
            if subprocess.run(cmd).returncode == 0:
                folders.append(run_out)
        print(f"\nThe matrix, pinning {pin}: {', '.join(f.name for f in folders)}")
        if args.rescore:
            print(text_table(*ablation_table(combined_variants(folders), SPREAD_METRICS[:3])))
        else:
            print(format_matrix(combine_results(folders)))
    return 0


def combined_variants(folders: list[Path]) -> dict[str, list[dict[str, Any]]]:
    """Every folder's rescore.json, the cells of each service-model variant put together."""
    out: dict[str, list[dict[str, Any]]] = {}
    for f in folders:
        for name, cells in json.loads((f / "rescore.json").read_text())["variants"].items():
            out.setdefault(name, []).extend(cells)
    return out


if __name__ == "__main__":
    raise SystemExit(main())
