"""How the LLM runner lays out a step: its row plan and its decode runs, against the layout before them.

    taskset -c 1 .venv/bin/python benchmarks/llm_step_layout.py [--rounds 4] [--num-requests 48]

One process, one runner (the default tiny Llama: 6 x 512, GQA 8:4, seeded random weights, fp32, one
torch thread), its row plan measured once (``LLMModelRunner.plan_rows``). Three arms differ only in
the runner's layout of a step:

* ``previous`` (the baseline): exact row counts, and decodes in runs of equal count, at least 8 each and
  at most 4 runs, each padded to its longest context (the rule this replaced, re-created here);
* ``rows``: the measured row plan (``models/llm/runner.py``), decode runs as ``previous``;
* ``current``: the row plan and decode runs of at most ``DECODE_RUN_TOKENS`` padded keys
  (``core.llm.scheduler.decode_groups``): what ``serve --llm`` runs.

1. **Steps**: decode-only steps of 1-48 sequences at contexts 256 and 700 and at contexts drawn from
   50-900, forward + argmax as the engine runs them, the arms round-robin, median of ``--step-repeats``;
   printed per step with each arm over ``previous``.
2. **Engine**: ``LLMEngine`` (paged KV, chunked prefill, fcfs, ``max_num_batched_tokens`` 512,
   ``max_num_seqs`` 64) on a conv-llm slice submitted at t=0 (prompts of seeded random ids, outputs
   from the trace, EOS ignored), ``--rounds`` rounds, the arms' order rotated each round, a warm-up
   batch before each run. Printed: output tok/s and TPOT P50 per run, each arm's median tok/s over
   ``previous``'s, and whether every arm produced the same tokens (greedy decoding).

``--bounds N [N ...]``: instead, decode steps only (contexts 100, 250, 500, 1000 and drawn from 50-900,
4-48 sequences), the row plan with decode runs bounded at each ``N`` padded keys, beside
``previous``; printed per step and the sum over every step, each bound's over ``previous``'s: how the
default bound (``DECODE_RUN_TOKENS``) was chosen.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from batchpilot.core.llm.config import LLMSchedulerConfig
from batchpilot.core.llm.scheduler import decode_groups
from batchpilot.core.llm.sequence import SamplingParams
from batchpilot.models.llm.runner import LLMModelRunner, RowPlan, step_plan
from batchpilot.models.llm.sampler import Sampler
from batchpilot.models.llm.tokenizer import build_tokenizer
from batchpilot.models.llm.weights import LlamaWeights, load_hf_llama
from batchpilot.models.seeded import LLMModelConfig
from batchpilot.runtime.llm.engine import LLMEngine
from batchpilot.sim.traces import load_workload

COUNTS = (1, 2, 3, 4, 5, 7, 8, 11, 12, 15, 16, 23, 24, 32, 48)
CONTEXTS: tuple[int | str, ...] = (256, 700, "50-900")
ARMS = ("previous", "rows", "current")


def count_runs(ctx_sorted: list[int]) -> list[tuple[int, int]]:
    """The rule ``current`` replaced: runs of equal count, at least 8 each, at most 4."""
    n = len(ctx_sorted)
    if n <= 0:
        return []
    k = max(1, min(4, n // 8))
    bounds = [round(i * n / k) for i in range(k + 1)]
    return [(a, b) for a, b in zip(bounds, bounds[1:], strict=False) if b > a]


def layouts(runner: LLMModelRunner) -> dict[str, Callable[[], None]]:
    plan, runs = runner.row_plan, runner._decode_groups

    def setter(rows: RowPlan, groups: Any) -> Callable[[], None]:
        def apply() -> None:
            runner.row_plan = rows
            runner._decode_groups = groups  # type: ignore[method-assign]
        return apply

    return {"previous": setter(RowPlan(), count_runs), "rows": setter(plan, count_runs),
            "current": setter(plan, runs)}


def time_steps(runner: LLMModelRunner, arms: dict[str, Callable[[], None]], repeats: int,
               counts: tuple[int, ...] = COUNTS,
               contexts: tuple[int | str, ...] = CONTEXTS) -> dict[tuple[str, int, int | str], float]:
    rng = np.random.default_rng(3)
    steps = {(n, c): step_plan(runner, [], [c] * n if isinstance(c, int)
                               else rng.integers(50, 901, n).tolist())
             for c in contexts for n in counts}
    times: dict[tuple[str, int, int | str], list[float]] = {(a, *k): [] for a in arms for k in steps}
    with torch.inference_mode():
        for r in range(repeats + 1):  # the first round warms every shape up, untimed
            for key, step in steps.items():
                order = list(arms)[r % len(arms):] + list(arms)[: r % len(arms)]
                for arm in order:
                    arms[arm]()
                    t0 = time.perf_counter()
                    runner.forward(step.chunks).argmax(-1).tolist()
                    if r:
                        times[(arm, *key)].append(time.perf_counter() - t0)
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


def sweep_bounds(runner: LLMModelRunner, bounds: list[int], repeats: int) -> None:
    base = layouts(runner)["previous"]
    plan = runner.row_plan

    def bounded(n: int) -> Callable[[], None]:
        def apply() -> None:
            runner.row_plan = plan
            runner._decode_groups = lambda ctx: decode_groups(ctx, n)  # type: ignore[method-assign]
        return apply

    arms = {"previous": base, **{f"<={n}": bounded(n) for n in bounds}}
    counts, contexts = (4, 8, 12, 16, 24, 32, 48), (100, 250, 500, 1000, "50-900")
    med = time_steps(runner, arms, repeats, counts, contexts)
    print(f"\ndecode steps, median of {repeats} (ms), decode runs bounded at each count of padded keys:")
    print(f"{'seqs':>5} {'context':>8}" + "".join(f"{a:>10}" for a in arms))
    for c in contexts:
        for n in counts:
            print(f"{n:>5} {c!s:>8}" + "".join(f"{med[(a, n, c)] * 1e3:10.2f}" for a in arms))
    total = {a: sum(med[(a, n, c)] for n in counts for c in contexts) for a in arms}
    print("sum over every step (ms): " + ", ".join(f"{a} {t * 1e3:.1f}" for a, t in total.items()))
    print("over previous: " + ", ".join(f"{a} {total[a] / total['previous']:.3f}" for a in list(arms)[1:]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--num-requests", type=int, default=48)
    ap.add_argument("--start", type=int, default=0, help="first conv-llm row of the slice")
    ap.add_argument("--step-repeats", type=int, default=7)
    ap.add_argument("--bounds", type=int, nargs="+", default=None,
                    help="time decode steps with runs bounded at each of these padded keys instead")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    hf = load_hf_llama(None, LLMModelConfig(), dtype=torch.float32)
    config = LLMSchedulerConfig(max_num_seqs=64, max_num_batched_tokens=512, num_kv_blocks=2048,
                                block_size=16, max_model_len=2048)
    runner = LLMModelRunner(LlamaWeights.from_hf(hf), config.num_kv_blocks, config.block_size)
    measured = runner.plan_rows()
    print(f"torch threads {torch.get_num_threads()}; row plan (rows: padded to): "
          f"{measured.padded() or 'none'}")
    if args.bounds:
        sweep_bounds(runner, args.bounds, args.step_repeats)
        return 0
    arms = layouts(runner)

    med = time_steps(runner, arms, args.step_repeats)
    print(f"\ndecode steps, median of {args.step_repeats} (ms), and each arm over previous:")
    for c in CONTEXTS:
        print(f"context {c}:")
        print(f"{'seqs':>6}" + "".join(f"{a:>10}" for a in ARMS) + f"{'rows/prev':>11}{'current/prev':>14}")
        for n in COUNTS:
            t = [med[(a, n, c)] for a in ARMS]
            print(f"{n:>6}" + "".join(f"{x * 1e3:10.2f}" for x in t)
                  + f"{t[1] / t[0]:11.3f}{t[2] / t[0]:14.3f}")
    for a in ARMS[1:]:
        total = sum(med[(a, n, c)] for n in COUNTS for c in CONTEXTS)
        base = sum(med[("previous", n, c)] for n in COUNTS for c in CONTEXTS)
        print(f"every step above alike: {a}/previous {total / base:.3f}")

    wl = load_workload("conv-llm", start=args.start, count=args.num_requests)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(7, hf.config.vocab_size, int(n)).tolist() for n in wl.input_tokens]
    outs = [int(n) for n in wl.output_tokens]
    warm = [rng.integers(7, hf.config.vocab_size, n).tolist() for n in (8, 32, 128, 512)]
    engine = LLMEngine(runner, build_tokenizer(hf.config.vocab_size), config, sampler=Sampler(0)).start()
    tok_s: dict[str, list[float]] = {a: [] for a in ARMS}
    tokens: dict[str, list[list[int]]] = {}
    print(f"\nengine, conv-llm rows [{args.start}, {args.start + len(outs)}), {sum(outs)} output tokens:")
    try:
        for r in range(args.rounds):
            for arm in ARMS[r % len(ARMS):] + ARMS[: r % len(ARMS)]:
                arms[arm]()
                run_engine(engine, warm, [4] * len(warm))
                rate, tpot, ids = run_engine(engine, prompts, outs)
                tok_s[arm].append(rate)
                tokens.setdefault(arm, ids)
                print(f"  round {r} {arm:>8}: {rate:7.1f} tok/s, TPOT P50 {tpot * 1e3:6.2f} ms")
    finally:
        engine.shutdown()
    base = statistics.median(tok_s["previous"])
    medians = {a: statistics.median(tok_s[a]) for a in ARMS}
    print("output tok/s, median: " + ", ".join(f"{a} {medians[a]:.1f}" for a in ARMS)
          + "; over previous: " + ", ".join(f"{a} {medians[a] / base:.3f}" for a in ARMS[1:]))
    same = [sum(x == y for x, y in zip(tokens[a], tokens["previous"], strict=True)) for a in ARMS[1:]]
    print("greedy outputs identical to previous's: " + ", ".join(
        f"{a} {k} of {len(outs)}" for a, k in zip(ARMS[1:], same, strict=True)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
