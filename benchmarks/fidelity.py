"""Simulator vs live server on conv-embed: predicted vs measured P50, P99, throughput and mean batch size
at 50% and 80% of the simulated capacity, where the time goes, and (with --tune or --tuned-config) the
tuner's config against the default, both live.

    python benchmarks/fidelity.py                                  # profiles first (a few minutes)
    python benchmarks/fidelity.py --profile profile.json --requests 400 --tune
    python benchmarks/fidelity.py --config tuned.yaml --profile profile.json

Every option of ``batchpilot bench fidelity`` is accepted; output goes to --out (default
bench-out/fidelity): fidelity.json, records-*.csv, report.html, serve logs. The machine is shared:
compare only the predicted/measured pairs printed by one run.
"""

from __future__ import annotations

import sys

from batchpilot.cli import main

if __name__ == "__main__":
    argv = sys.argv[1:]
    if "--out" not in argv:
        argv += ["--out", "bench-out/fidelity"]
    raise SystemExit(main(["bench", "fidelity", *argv]))
