"""The LLM memory plan against what the engine really holds: a memory-share sweep.

The device is a budget of ``--device-memory`` bytes (default 1 GiB) that the plan is given as its free
memory; the model is the default tiny Llama (seeded weights, float32), every sequence is
``--prompt`` + ``--output`` tokens (``max_model_len`` is exactly that). For each share ``s``:

* **planned**: ``core.llm.config.plan_kv`` with ``memory_utilization = s`` over the memory profile measured
  here first, as ``batchpilot profile --llm`` measures it (``runtime/llm/build.profile_engine_memory``
  on a default engine, not on the sequences below); the largest batch ``B_plan`` is the most sequences
  whose KV the plan's pool holds at once, with ``max_num_seqs = B`` (the activation peak depends on it);
* **observed**: a fresh process per batch size ``B`` (``B_plan``, then up by ``--step`` until one does
  not fit) builds the engine with a pool of exactly ``B`` sequences and ``max_num_seqs = B``, runs ``B``
  requests at once to their full length (greedy, EOS ignored) and reports its peak resident memory
  (``VmHWM``) above what it held when the builder read the free memory, before the model loaded (the
  instant the plan's budget is a share of). It *fits* if that is at most ``s x device``; ``B_obs`` is
  the largest ``B`` tried that fits and ran with no preemption.

"OOM when the plan says it fits" counts the batch sizes ``B <= B_plan`` whose observed peak passed the
budget: the target is zero.

    .venv/bin/python benchmarks/llm_memory.py [--shares 0.25 0.5 0.75] [--device-memory 1GiB]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from typing import Any

MIB = 1 << 20


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def child(batch: int, prompt: int, output: int, block_size: int) -> None:
    """Run ``batch`` sequences at once on a pool that holds exactly them; print the peak as JSON."""
    import asyncio

    from batchpilot.core.llm.sequence import SamplingParams
    from batchpilot.runtime.llm.build import build_llm_engine

    length = prompt + output
    blocks = batch * -(-length // block_size)
    engine = build_llm_engine(num_kv_blocks=blocks, block_size=block_size, max_num_seqs=batch,
                              max_model_len=length, max_num_batched_tokens=512, threads=1)
    params = SamplingParams(max_tokens=output, temperature=0.0, ignore_eos=True)

    async def run() -> list[int]:
        async def one(i: int) -> int:
            n = 0
            async for item in engine.generate([7 + (i * 31 + j) % 4000 for j in range(prompt)], params):
                n += len(item.token_ids)
            return n
        return list(await asyncio.gather(*(one(i) for i in range(batch))))

    try:
        outs = asyncio.run(run())
        stats = engine.stats()
    finally:
        engine.shutdown()
    base = engine.memory_held_before  # what the process held when the builder read the free memory
    print(json.dumps({"batch": batch, "peak_bytes": _status("VmHWM") - base,
                      "tokens_ok": outs == [output] * batch, "preemptions": stats.num_preemptions}))


def observe(batch: int, args: argparse.Namespace) -> dict[str, float]:
    cmd = [sys.executable, __file__, "--child", str(batch), "--prompt", str(args.prompt), "--output",
           str(args.output), "--block-size", str(args.block_size)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])  # type: ignore[no-any-return]


def planned_batch(share: float, device: float, memory: Any, args: argparse.Namespace) -> tuple[int, Any]:
    from batchpilot.core.llm.config import KVPlanError, LLMSchedulerConfig, plan_kv

    length = args.prompt + args.output
    per_seq = -(-length // args.block_size)
    best, best_plan = 0, None
    for b in range(1, 4096):
        cfg = LLMSchedulerConfig(memory_utilization=share, max_num_seqs=b, max_model_len=length,
                                 block_size=args.block_size, max_num_batched_tokens=512)
        try:
            plan = plan_kv(cfg, memory, device)
        except KVPlanError:
            break
        if plan.num_kv_blocks // per_seq < b:
            break
        best, best_plan = b, plan
    return best, best_plan


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shares", type=float, nargs="+", default=[0.25, 0.5, 0.75])
    ap.add_argument("--device-memory", default="1GiB")
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--output", type=int, default=32)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--step", type=float, default=0.04,
                    help="observed batch sizes: B_plan, then up by this share until one does not fit")
    ap.add_argument("--max-steps", type=int, default=8)
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        child(args.child, args.prompt, args.output, args.block_size)
        return
    import torch

    from batchpilot.core.config import parse_bytes
    from batchpilot.runtime.llm.build import build_llm_engine, profile_engine_memory

    torch.set_num_threads(1)
    device = float(parse_bytes(args.device_memory))
    engine = build_llm_engine(start=False, num_kv_blocks=512, threads=1)
    memory, _ = profile_engine_memory(engine)  # what `batchpilot profile --llm` records
    del engine
    print(f"memory profile (measured): weights {memory.weights_bytes / MIB:.1f} MiB, overhead "
          f"{memory.overhead_bytes / MIB:.1f} MiB, KV {memory.kv_bytes_per_token} B/token, activation "
          f"{memory.activation_fixed_bytes / MIB:.2f} MiB + {memory.activation_bytes_per_token:.0f} B/batch "
          f"token + {memory.activation_bytes_per_read_token:.0f} B/gathered token; device {device / MIB:.0f} "
          f"MiB; sequences {args.prompt}+{args.output} tokens", flush=True)
    print(f"\n{'share':>6}{'budget MiB':>11}{'B_plan':>7}{'planned MiB':>12}{'B':>6}{'observed MiB':>13}"
          f"{'fits':>6}{'preempt':>8}{'tokens':>7}")
    summary = []
    for share in args.shares:
        b_plan, plan = planned_batch(share, device, memory, args)
        budget = share * device
        oom_at_plan, b_obs = 0, 0
        b, step = max(1, b_plan), 0
        while step < args.max_steps:  # from B_plan up by --step until a batch does not fit
            r = observe(b, args)
            fits = r["peak_bytes"] <= budget and r["preemptions"] == 0
            if b <= b_plan and r["peak_bytes"] > budget:
                oom_at_plan += 1
            planned = plan.planned_bytes / MIB if plan is not None and b == b_plan else float("nan")
            print(f"{share:>6.2f}{budget / MIB:>11.0f}{b_plan:>7}{planned:>12.1f}{b:>6}"
                  f"{r['peak_bytes'] / MIB:>13.1f}{'yes' if fits else 'NO':>6}{r['preemptions']:>8}"
                  f"{'ok' if r['tokens_ok'] else 'BAD':>7}", flush=True)
            if not fits:
                break
            b_obs = b
            b, step = max(b + 1, round(b * (1 + args.step))), step + 1
        summary.append((share, b_plan, b_obs, oom_at_plan))
    print("\nshare: largest batch planned / observed, over-budget runs the plan said fit")
    for share, b_plan, b_obs, oom in summary:
        print(f"  {share:.2f}: {b_plan} / {b_obs}, {oom} over budget")
    print(f"over budget where the plan said it fits: {sum(s[3] for s in summary)} (target 0)")


if __name__ == "__main__":
    main()
