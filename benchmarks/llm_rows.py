"""The LLM runner with its measured row plan against exact row counts (``models/llm/row_plan.py``).

    .venv/bin/python benchmarks/llm_rows.py [--threads 1] [--rounds 4] [--num-requests 48]

One process, one runner (the default tiny Llama: 6 x 512, GQA 8:4, seeded random weights, fp32), its
row plan measured once (``LLMModelRunner.plan_rows``); the two arms differ only in
``runner.row_plan``: the measured plan, or ``RowPlan()`` (no padding). The baseline is exact row counts.

1. **Steps**: decode-only steps of each count of sequences (1-48, context 256 each), forward + argmax
   as the engine runs them, both arms round-robin, median of ``--step-repeats``; printed per count with
   the ratio (plan / exact).
2. **Engine**: ``LLMEngine`` (paged KV, chunked prefill, fcfs, ``max_num_batched_tokens`` 512,
   ``max_num_seqs`` 64) on a conv-llm slice submitted at t=0 (prompts of seeded random ids, outputs
   from the trace, EOS ignored), ``--rounds`` rounds, the arms alternating and swapping first place
   each round, a warm-up batch before each run. Printed: output tok/s and TPOT P50 per run, the median
   ratio, and whether both arms produced the same tokens (greedy decoding).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import numpy as np
import torch

from batchpilot.core.llm_config import LLMSchedulerConfig
from batchpilot.core.sequence import SamplingParams
from batchpilot.models.llm.config import LLMModelConfig
from batchpilot.models.llm.model_runner import LLMModelRunner
from batchpilot.models.llm.profile import _plan
from batchpilot.models.llm.row_plan import RowPlan
from batchpilot.models.llm.sampler import Sampler
from batchpilot.models.llm.tokenizer import build_tokenizer
from batchpilot.models.llm.weights import LlamaWeights, load_hf_llama
from batchpilot.runtime.llm_engine import LLMEngine
from batchpilot.sim.workloads import load_workload

COUNTS = tuple(range(1, 17)) + (20, 23, 24, 31, 32, 40, 47, 48)
CONTEXT = 256


def time_steps(runner: LLMModelRunner, plans: dict[str, RowPlan],
               repeats: int) -> dict[tuple[str, int], float]:
    steps = {n: _plan(runner, [], n, CONTEXT) for n in COUNTS}
    times: dict[tuple[str, int], list[float]] = {(a, n): [] for a in plans for n in COUNTS}
    with torch.inference_mode():
        for plan in plans.values():
            runner.row_plan = plan
            for step in steps.values():
                runner.forward(step.chunks).argmax(-1).tolist()
        for r in range(repeats):
            for n, step in steps.items():
                for arm in (list(plans) if r % 2 == 0 else list(reversed(plans))):
                    runner.row_plan = plans[arm]
                    t0 = time.perf_counter()
                    runner.forward(step.chunks).argmax(-1).tolist()
                    times[(arm, n)].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def run_engine(engine: LLMEngine, prompts: list[list[int]],
               outs: list[int]) -> tuple[float, float, list[list[int]]]:
    async def one(prompt: list[int], n: int) -> tuple[list[float], list[int]]:
        times: list[float] = []
        ids: list[int] = []
        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        async for item in engine.generate(prompt, params):
            times.extend([time.perf_counter()] * len(item.token_ids))
            ids.extend(item.token_ids)
        return times, ids

    async def batch() -> tuple[float, list[tuple[list[float], list[int]]]]:
        t0 = time.perf_counter()
        res = await asyncio.gather(*(one(p, n) for p, n in zip(prompts, outs, strict=True)))
        return time.perf_counter() - t0, list(res)

    makespan, res = asyncio.run(batch())
    tpot = [(t[-1] - t[0]) / (len(t) - 1) for t, _ in res if len(t) > 1]
    return sum(len(t) for t, _ in res) / makespan, float(np.median(tpot)), [ids for _, ids in res]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--num-requests", type=int, default=48)
    ap.add_argument("--start", type=int, default=0, help="first conv-llm row of the slice")
    ap.add_argument("--step-repeats", type=int, default=9)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    hf = load_hf_llama(None, LLMModelConfig(), dtype=torch.float32)
    config = LLMSchedulerConfig(max_num_seqs=64, max_num_batched_tokens=512, num_kv_blocks=2048,
                                block_size=16, max_model_len=2048)
    runner = LLMModelRunner(LlamaWeights.from_hf(hf), config.num_kv_blocks, config.block_size)
    measured = runner.plan_rows()
    print(f"torch threads {torch.get_num_threads()}; row plan (rows: padded to): "
          f"{measured.padded() or 'none'}")
    plans = {"plan": measured, "exact": RowPlan()}

    med = time_steps(runner, plans, args.step_repeats)
    print(f"\ndecode steps at context {CONTEXT}, median of {args.step_repeats} (ms):")
    print(f"{'seqs':>5} {'exact':>8} {'plan':>8} {'plan/exact':>11}")
    for n in COUNTS:
        e, p = med[("exact", n)], med[("plan", n)]
        print(f"{n:>5} {e * 1e3:8.2f} {p * 1e3:8.2f} {p / e:11.3f}")
    total = sum(med[("plan", n)] for n in COUNTS) / sum(med[("exact", n)] for n in COUNTS)
    print(f"all counts alike: plan/exact {total:.3f}")

    wl = load_workload("conv-llm", start=args.start, count=args.num_requests)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(7, hf.config.vocab_size, int(n)).tolist() for n in wl.input_tokens]
    outs = [int(n) for n in wl.output_tokens]
    warm = [rng.integers(7, hf.config.vocab_size, n).tolist() for n in (8, 32, 128, 512)]
    engine = LLMEngine(runner, build_tokenizer(hf.config.vocab_size), config, sampler=Sampler(0)).start()
    tok_s: dict[str, list[float]] = {a: [] for a in plans}
    tokens: dict[str, list[list[int]]] = {}
    print(f"\nengine, conv-llm rows [{args.start}, {args.start + len(outs)}), {sum(outs)} output tokens:")
    try:
        for r in range(args.rounds):
            for arm in (list(plans) if r % 2 == 0 else list(reversed(plans))):
                runner.row_plan = plans[arm]
                run_engine(engine, warm, [4] * len(warm))
                rate, tpot, ids = run_engine(engine, prompts, outs)
                tok_s[arm].append(rate)
                tokens.setdefault(arm, ids)
                print(f"  round {r} {arm:>5}: {rate:7.1f} tok/s, TPOT P50 {tpot * 1e3:6.2f} ms")
    finally:
        engine.shutdown()
    ratios = [p / e for p, e in zip(tok_s["plan"], tok_s["exact"], strict=True)]
    print(f"output tok/s, median: plan {statistics.median(tok_s['plan']):.1f}, exact "
          f"{statistics.median(tok_s['exact']):.1f}; plan/exact per round "
          + ", ".join(f"{x:.3f}" for x in ratios) + f" (median {statistics.median(ratios):.3f})")
    same = sum(a == b for a, b in zip(tokens["plan"], tokens["exact"], strict=True))
    print(f"greedy outputs identical in {same} of {len(outs)} requests")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
