"""The same live conv-llm run predicted twice from its one profile: with the forward priced per count of
sequences per step (``frontend.step_seq_factors``) and with one ``step_alpha`` for every count.

    .venv/bin/batchpilot bench fidelity --workload conv-llm --requests 1000 --cpus 1 --sla 2.0 \\
        --warmup-requests 2 --out OUT
    .venv/bin/python benchmarks/llm_seq_factors.py OUT

Reads OUT's ``fidelity.json`` (the rows, rate scales, engine config and live measurements) and
``llm_profile.json`` (the profile the command made before its server started; with ``--profile P``,
pass P as the second argument), simulates every point both ways as the command did
(``bench.llm_fidelity.simulate``) and prints each latency's error
against the live run. Both predictions use the profile only; the live numbers are the command's own.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

from batchpilot.bench.llm_fidelity import simulate
from batchpilot.core.costmodel import CostModel
from batchpilot.core.llm_scheduler import LLMSchedulerConfig
from batchpilot.sim.llm_frontend import LLMFrontEnd
from batchpilot.sim.workloads import load_workload

METRICS = ("TTFT P50", "TTFT P99", "TPOT P50", "TPOT P99")


def main(argv: list[str]) -> int:
    if len(argv) not in (1, 2):
        print(__doc__)
        return 2
    out = Path(argv[0])
    profile = Path(argv[1]) if len(argv) == 2 else out / "llm_profile.json"
    result = json.loads((out / "fidelity.json").read_text())
    config = LLMSchedulerConfig(**{k: tuple(v) if isinstance(v, list) else v
                                   for k, v in result["config"].items()})
    rows = load_workload("conv-llm", 1.0, int(result["start"]), int(result["requests"]))
    cost_model, frontend = CostModel.load(profile), LLMFrontEnd.from_profile(profile)
    alone = dataclasses.replace(frontend, step_seq_factors=())
    print(f"{profile}: forward factors by sequences per step "
          + ", ".join(f"x{f:.3f} from {lo}" for lo, f in frontend.step_seq_factors))
    print(f"{'load':>5}  {'forward priced':<22}" + "".join(f"{m:>10}" for m in METRICS) + "  within 10%")
    for point in result["points"]:
        m = point["measured"]
        measured = (m["ttft"]["p50"], m["ttft"]["p99"], m["tpot"]["p50"], m["tpot"]["p99"])
        for name, fe in (("per count of sequences", frontend), ("one step_alpha", alone)):
            s, _ = simulate(rows.scale_rate(point["rate_scale"]), config, cost_model, result["sla_s"], fe)
            predicted = (s.ttft["p50"], s.ttft["p99"], s.tpot["p50"], s.tpot["p99"])
            errors = [(p - q) / q for p, q in zip(predicted, measured, strict=True)]
            print(f"{point['load']:>5.0%}  {name:<22}" + "".join(f"{e:>+10.1%}" for e in errors)
                  + f"  {sum(abs(e) <= 0.10 for e in errors)}/4")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
