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

from llm_seq_factors import table

SCALES = (0.95, 1.0, 1.05, 1.1)


def main(argv: list[str]) -> int:
    return table(argv, __doc__ or "", "forward x",
                 lambda fe: [(f"{k:.2f}", dataclasses.replace(fe, step_alpha=fe.step_alpha * k))
                             for k in SCALES])


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
