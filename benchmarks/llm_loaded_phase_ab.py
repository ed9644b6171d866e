"""Two designs of the LLM profile's loaded phase, measured back to back on one step profile.

    .venv/bin/python benchmarks/llm_loaded_phase_ab.py OUT
    .venv/bin/batchpilot bench fidelity --workload conv-llm --requests 1000 --sla 2.0 \\
        --warmup-requests 2 --profile OUT/ab-new-1.json --loads 0.8 --out RUN
    .venv/bin/python benchmarks/llm_seq_factors.py RUN OUT/ab-old-1.json   # and the other three

Builds the engine ``bench fidelity --workload conv-llm`` builds (unpinned), times its step profile once,
then measures the serving path (``measure_llm_serving_path``) four times on fresh engines, in the
order old, new, new, old: ``old`` 90 streams in three segments at 1x, 3x and 10x the one-stream rate,
``new`` the module's own constants (240 streams in eight segments at 1x, 5x, 3x and 10x). Writes
``OUT/ab-{old,new}-{1,2}.json``, each the same step model with its own ``frontend``, and prints each
phase's decode-only steps per bin of ``step_seq_factors``. Two profiles of one phase show how far a
profile moves between two looks at the machine; the phases are compared against that.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import batchpilot.profile.llm as lsp
from batchpilot.profile.llm import profile_llm_steps, serving_path
from batchpilot.runtime.llm.build import build_llm_engine
from batchpilot.settings import spec_from_args

PHASES = {"old": (90, (1.0, 3.0, 10.0), 3),
          "new": (lsp.LOADED_REQUESTS, lsp.LOADED_SHARES, lsp.LOADED_SEGMENTS)}


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__)
        return 2
    out = Path(argv[0])
    out.mkdir(parents=True, exist_ok=True)
    spec = spec_from_args(argparse.Namespace())
    engine = build_llm_engine(None, spec, start=False, threads=0)
    cost_model = profile_llm_steps(engine.runner)
    cost_model.meta.update(model_path=None, device=str(engine.runner.device),
                           dtype=str(engine.runner.dtype).removeprefix("torch."))
    del engine
    for k, name in enumerate(("old", "new", "new", "old")):
        n, shares, segments = PHASES[name]
        lsp.LOADED_SHARES, lsp.LOADED_SEGMENTS = shares, segments  # loaded_workload reads them per call
        engine = build_llm_engine(None, spec, start=False, threads=0)
        entry, details = serving_path(engine, cost_model, loaded_requests=n)  # as `profile --llm` does
        path = out / f"ab-{name}-{1 if k < 2 else 2}.json"
        path.write_text(json.dumps({"kind": "llm", "cost_model": cost_model.to_dict(), "frontend": entry,
                                    "serving_path": details}, indent=2))
        steps = details["loaded"].get("seq_factor_steps")
        print(f"{name}: {path}, decode-only steps per bin {steps}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
