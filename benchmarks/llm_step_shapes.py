"""Where a linear step model of the tiny Llama breaks, measured: the one-row jump and padded KV reads.

    taskset -c 1 python benchmarks/llm_step_shapes.py [--repeats 9]

Times single engine steps (``models.llm.profile.time_step``: forward + greedy sampling) on the runner
``serve --llm`` builds, one torch thread, and prints each beside the step model fitted by
``profile_llm_steps`` on the same runner a moment earlier:

* decode batches of 1, 2, 3, 4, 8, 16 sequences at 256 tokens of context: one decode alone runs every
  matmul as matrix x vector, two rows or more the matrix x matrix path (the ``multi_row`` feature);
* three and six decodes at one context against the same number at mixed contexts: the runner pads each
  decode group to its longest context, which ``StepPlan.shape``'s ``kv_tokens`` now counts.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def plan_for(runner, contexts: list[int], prefill: int = 0):  # type: ignore[no-untyped-def]
    from batchpilot.core.llm_scheduler import ScheduledChunk, StepPlan

    bs, nb, chunks = runner.block_size, 0, []
    for i, ctx in enumerate(contexts):
        n = -(-ctx // bs)
        chunks.append(ScheduledChunk(i, ctx - 1, [5], [(nb + j) % runner.num_kv_blocks for j in range(n)],
                                     True, True))
        nb += n
    if prefill:
        n = -(-prefill // bs)
        chunks.append(ScheduledChunk(len(contexts), 0, [7] * prefill,
                                     [(nb + j) % runner.num_kv_blocks for j in range(n)], True, False))
    return StepPlan(step_id=0, chunks=chunks)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=9, help="timed calls per step (median)")
    args = ap.parse_args()
    import torch

    from batchpilot.models.llm.profile import profile_llm_steps, time_step
    from batchpilot.runtime.llm_engine import build_llm_engine

    runner = build_llm_engine(None, start=False, threads=1).runner
    model = profile_llm_steps(runner)
    print("step model:", ", ".join(f"{n}={c:.3g}" for n, c in zip(model.feature_names, model.latency_coef,
                                                                  strict=True)))
    rows = [(f"{b} decode(s) at 256", [256] * b, 0) for b in (1, 2, 3, 4, 8, 16)]
    rows += [("3 decodes at 250", [250] * 3, 0), ("3 decodes at 120/250/380", [120, 250, 380], 0),
             ("6 decodes at 250", [250] * 6, 0), ("6 decodes at 100..400", [100, 160, 220, 280, 340, 400], 0),
             ("3 decodes at 250 + 100-token prefill", [250] * 3, 100),
             ("3 decodes at 120/250/380 + 100-token prefill", [120, 250, 380], 100)]
    print(f"{'step':46s} {'measured ms':>12s} {'model ms':>9s} {'error':>7s}")
    with torch.inference_mode():
        for name, ctxs, prefill in rows:
            plan = plan_for(runner, ctxs, prefill)
            measured = time_step(runner, plan, args.repeats)
            predicted = model.latency(plan.shape)
            err = predicted / measured - 1
            print(f"{name:46s} {measured * 1e3:12.1f} {predicted * 1e3:9.1f} {err:+7.1%}")


if __name__ == "__main__":
    main()
