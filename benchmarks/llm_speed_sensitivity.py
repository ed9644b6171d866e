"""How far a live conv-llm run's latencies move with the speed of its steps: the run predicted from its
profile as it is, and with every step's forward priced that much slower or faster.

    .venv/bin/batchpilot bench fidelity --workload conv-llm --requests 1000 --sla 2.0 \\
        --warmup-requests 2 --out OUT
    .venv/bin/python benchmarks/llm_speed_sensitivity.py OUT [PROFILE]

Reads what ``benchmarks/llm_seq_factors.py`` reads. For each forward scale in ``SCALES`` (1.00 is the
profile's own prediction, what ``bench fidelity`` reports), every load point is simulated with the
profile's forward factors times that scale (the overhead line unchanged) and each latency's error
against the live run is printed. It answers one question: how much of a TTFT or TPOT error a given
error in the steps' speed accounts for (queueing makes the second larger than the first). It is not a
prediction: the scales other than 1.00 are what-ifs, and none of them is fitted on the run.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from llm_seq_factors import METRICS, errors, load_run

SCALES = (0.95, 1.0, 1.05, 1.1)


def main(argv: list[str]) -> int:
    if len(argv) not in (1, 2):
        print(__doc__)
        return 2
    out = Path(argv[0])
    profile = Path(argv[1]) if len(argv) == 2 else out / "llm_profile.json"
    result, config, rows, cost_model, frontend = load_run(out, profile)
    print(f"{'load':>5}  {'forward x':>9}" + "".join(f"{m:>10}" for m in METRICS) + "  within 10%")
    for point in result["points"]:
        for scale in SCALES:
            fe = dataclasses.replace(frontend, step_alpha=frontend.step_alpha * scale)
            e = errors(point, rows, config, cost_model, fe, result["sla_s"])
            print(f"{point['load']:>5.0%}  {scale:>9.2f}" + "".join(f"{x:>+10.1%}" for x in e)
                  + f"  {sum(abs(x) <= 0.10 for x in e)}/4")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
