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
from collections.abc import Callable
from pathlib import Path
from typing import Any

from batchpilot.bench.llm_fidelity import simulate
from batchpilot.core.costmodel import CostModel
from batchpilot.core.llm.config import LLMSchedulerConfig
from batchpilot.sim.llm import LLMFrontEnd
from batchpilot.sim.traces import load_workload

METRICS = ("TTFT P50", "TTFT P99", "TPOT P50", "TPOT P99")


def load_run(out: Path, profile: Path
             ) -> tuple[dict[str, Any], LLMSchedulerConfig, Any, CostModel, LLMFrontEnd]:
    """OUT's ``fidelity.json``, its engine config and rows, and ``profile``'s step model and serving path."""
    result = json.loads((out / "fidelity.json").read_text())
    config = LLMSchedulerConfig(**{k: tuple(v) if isinstance(v, list) else v
                                   for k, v in result["config"].items()})
    rows = load_workload("conv-llm", 1.0, int(result["start"]), int(result["requests"]))
    return result, config, rows, CostModel.load(profile), LLMFrontEnd.from_profile(profile)


def errors(point: dict[str, Any], rows: Any, config: LLMSchedulerConfig, cost_model: CostModel,
           frontend: LLMFrontEnd, sla_s: float) -> list[float]:
    """The simulated ``METRICS`` of ``point``'s rows (as ``bench fidelity`` simulates them) against the
    point's live measurement: (predicted - measured) / measured each."""
    m = point["measured"]
    measured = (m["ttft"]["p50"], m["ttft"]["p99"], m["tpot"]["p50"], m["tpot"]["p99"])
    s, _ = simulate(rows.scale_rate(point["rate_scale"]), config, cost_model, sla_s, frontend)
    predicted = (s.ttft["p50"], s.ttft["p99"], s.tpot["p50"], s.tpot["p99"])
    return [(p - q) / q for p, q in zip(predicted, measured, strict=True)]


def table(argv: list[str], usage: str, head: str,
          variants: Callable[[LLMFrontEnd], list[tuple[str, LLMFrontEnd]]], intro: bool = False) -> int:
    """For ``argv`` (OUT [PROFILE]), each load point simulated once per ``variants(frontend)`` entry, a
    row of its ``METRICS`` errors against the live run under the column ``head``."""
    if len(argv) not in (1, 2):
        print(usage)
        return 2
    out = Path(argv[0])
    profile = Path(argv[1]) if len(argv) == 2 else out / "llm_profile.json"
    result, config, rows, cost_model, frontend = load_run(out, profile)
    if intro:
        print(f"{profile}: forward factors by sequences per step "
              + ", ".join(f"x{f:.3f} from {lo}" for lo, f in frontend.step_seq_factors))
    width = max(len(head), *(len(name) for name, _ in variants(frontend)))
    print(f"{'load':>5}  {head:<{width}}" + "".join(f"{m:>10}" for m in METRICS) + "  within 10%")
    for point in result["points"]:
        for name, fe in variants(frontend):
            e = errors(point, rows, config, cost_model, fe, result["sla_s"])
            print(f"{point['load']:>5.0%}  {name:<{width}}" + "".join(f"{x:>+10.1%}" for x in e)
                  + f"  {sum(abs(x) <= 0.10 for x in e)}/4")
    return 0


def main(argv: list[str]) -> int:
    return table(argv, __doc__ or "", "forward priced",
                 lambda fe: [("per count of sequences", fe),
                             ("one step_alpha", dataclasses.replace(fe, step_seq_factors=()))], intro=True)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
