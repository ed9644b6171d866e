"""Why an LLM fidelity P99 missed: the spread of identical big steps, and whether step noise explains it.

    python benchmarks/llm_tail_check.py OUT [--seeds 20]

``OUT`` is the output folder of ``bench fidelity --workload conv-llm`` (its ``steps.jsonl``,
``llm_fidelity.json`` and ``records-llm-*.csv``), run with the default engine config. Prints:

1. every logged step with a prefill of 256 tokens or more, grouped by its prefill length: how many,
   and the min / median / max of its wall time. A P99 over a few dozen requests is decided by one or
   two such steps, so their spread is the spread of that P99.
2. for every measured attempt: the measured TTFT and TPOT P50/P99, the deterministic simulation (what
   the fidelity table predicts) and ``--seeds`` simulations with each step's time scaled by a residual
   drawn from the live fit's own (``CostModel.sample_latency``): their median and 10-90% band. If the
   measured value lies outside the band, i.i.d. step noise of the calibrated size does not explain it.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import numpy as np

from batchpilot.bench.llm_steps import read_steps
from batchpilot.bench.records import read_csv
from batchpilot.core.costmodel import CostModel
from batchpilot.core.llm_scheduler import LLMSchedulerConfig
from batchpilot.sim.llm import simulate_llm
from batchpilot.sim.traces import Workload

METRICS = ("TTFT P50", "TTFT P99", "TPOT P50", "TPOT P99")


def big_steps(out: Path) -> None:
    groups: dict[int, list[float]] = defaultdict(list)
    for s in read_steps(out / "steps.jsonl")[0]:
        if s.features.get("prefill_tokens", 0.0) >= 256:
            groups[int(s.features["prefill_tokens"])].append(s.wall_s * 1e3)
    print("steps with a prefill >= 256 tokens (wall ms; any decodes riding along included):")
    for n, walls in sorted(groups.items()):
        print(f"  prefill {n:5d}: {len(walls):3d} steps, min {min(walls):6.1f}  "
              f"median {np.median(walls):6.1f}  max {max(walls):6.1f}")


def measured(records: list) -> tuple[float, ...]:  # type: ignore[type-arg]
    ok = [r for r in records if r.ok]
    ttft = [r.ttft_s for r in ok]
    tpot = [(r.latency_s - r.ttft_s) / (r.tokens_received - 1) for r in ok if r.tokens_received > 1]
    return (*np.percentile(ttft, [50, 99]), *np.percentile(tpot, [50, 99]))


def simulated(wl: Workload, model: CostModel, delay: float, noise: bool, seed: int) -> tuple[float, ...]:
    rep = simulate_llm(wl, LLMSchedulerConfig(), model, noise=noise, seed=seed).report()
    return rep.ttft_p50 + delay, rep.ttft_p99 + delay, rep.tpot_p50, rep.tpot_p99


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--seeds", type=int, default=20)
    args = ap.parse_args()
    big_steps(args.out)
    result = json.loads((args.out / "llm_fidelity.json").read_text())
    calibrations: dict[str, list] = defaultdict(list)  # type: ignore[type-arg]
    for m in result["live_step_models"]:
        calibrations[m["label"]].append(m)
    for point in result["points"]:
        label, attempt = f"{point['load']:.0%}", point["attempt"]
        cal = calibrations[label][attempt - 1]  # each attempt is predicted from the calibration before it
        model, delay = CostModel.from_dict(cal["cost_model"]), cal["first_token_delay_s"]
        records = read_csv(args.out / f"records-llm-{int(round(point['load'] * 100))}-{attempt}.csv")
        wl = Workload.from_columns("measured", np.array([r.scheduled_s for r in records]),
                                   np.array([r.input_tokens for r in records]),
                                   np.array([r.output_tokens for r in records]))
        live = measured(records)
        det = simulated(wl, model, delay, False, 0)
        noisy = np.array([simulated(wl, model, delay, True, s) for s in range(args.seeds)])
        print(f"\n{label} attempt {attempt} ({len(records)} requests; ms):")
        for j, name in enumerate(METRICS):
            lo, med, hi = np.percentile(noisy[:, j], [10, 50, 90])
            inside = "inside" if lo <= live[j] <= hi else "OUTSIDE"
            print(f"  {name}: measured {live[j] * 1e3:7.1f}  predicted {det[j] * 1e3:7.1f} "
                  f"({det[j] / live[j] - 1:+6.1%})  with step noise: median {med * 1e3:7.1f} "
                  f"({med / live[j] - 1:+6.1%}), 10-90% {lo * 1e3:.0f}-{hi * 1e3:.0f} ({inside})")


if __name__ == "__main__":
    main()
