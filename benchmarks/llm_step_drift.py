"""How much one fixed LLM step's time moves on this machine over minutes, with nothing else changing.

    taskset -c 1 python benchmarks/llm_step_drift.py [--minutes 7] [--window-s 15]

The runner ``serve --llm`` builds (one torch thread) times three fixed steps round-robin — one decode
at 256 tokens of context, four decodes at 256, one 100-token prefill — and prints each one's median per
window, then the spread of the window medians (max / min - 1). A step model or calibration measured at
one moment cannot be closer than this to a run a few minutes later; ``bench fidelity --workload
conv-llm`` re-fits on live steps right before each load point for that reason. Run it with the machine
otherwise idle: any other job on the core shows up as drift.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=7.0)
    ap.add_argument("--window-s", type=float, default=15.0)
    args = ap.parse_args()
    import torch
    from drift_windows import window_medians
    from llm_step_shapes import plan_for

    from batchpilot.models.llm.profile import time_step
    from batchpilot.runtime.llm_engine import build_llm_engine

    runner = build_llm_engine(None, start=False, threads=1).runner
    plans = {"1 decode @256": plan_for(runner, [256]), "4 decodes @256": plan_for(runner, [256] * 4),
             "100-token prefill": plan_for(runner, [], 100)}
    with torch.inference_mode():
        window_medians({k: (lambda p=plan: time_step(runner, p, 1)) for k, plan in plans.items()},
                       args.minutes, args.window_s, width=18)

if __name__ == "__main__":
    main()
