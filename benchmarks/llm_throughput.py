"""Offline LLM throughput on a conv-llm slice: batchpilot vs HF static batching vs HF continuous batching.

All in one run, on one model (the default tiny Llama: 6 x 512, GQA 8:4, vocab 4096, seeded random
weights), on the same requests: a contiguous slice of the conv-llm workload (docs/design.md: prompt
``clip(round(ctx/8), 4, 1024)`` tokens, output ``clip(gen, 1, 256)`` tokens, EOS ignored). Every
request is submitted at t=0 (an offline batch); prompts are seeded random token ids (the model is
random, so content does not matter, only lengths do).

* batchpilot: ``LLMEngine`` (engine thread, paged KV, chunked prefill) through its async API.
* HF static: ``model.generate`` on fixed-size left-padded batches (default 16) in arrival order, each
  running until its longest member is done; a request's tokens count only up to its own length.
* HF continuous batching: transformers' ``generate_batch`` engine (the ``ContinuousBatchingManager``
  it wraps, used directly so every request gets its own ``max_new_tokens``), EOS disabled.

Reported per system: output tokens/s (sum of requested outputs / makespan), TTFT (submission to
first token) and TPOT ((last - first token) / (n - 1)) P50/P99, and batchpilot's speed-up ratios.

    .venv/bin/python benchmarks/llm_throughput.py [--num-requests 64] [--start 0] [--batch-size 16]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import time
from typing import Any

import numpy as np
import torch

from batchpilot.core.llm_scheduler import LLMSchedulerConfig
from batchpilot.core.sequence import SamplingParams
from batchpilot.models.llm.config import LLMModelConfig
from batchpilot.models.llm.model_runner import LLMModelRunner, keep_freed_memory
from batchpilot.models.llm.sampler import Sampler
from batchpilot.models.llm.tokenizer import build_tokenizer
from batchpilot.models.llm.weights import LlamaWeights, load_hf_llama
from batchpilot.runtime.llm_engine import LLMEngine
from batchpilot.sim.workloads import load_workload


def make_requests(num: int, start: int, seed: int, vocab: int) -> tuple[list[list[int]], list[int]]:
    wl = load_workload("conv-llm", start=start, count=num)
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(7, vocab, int(n)).tolist() for n in wl.input_tokens]
    return prompts, [int(n) for n in wl.output_tokens]


def summarize(
    name: str, out_tokens: int, makespan: float, ttft: list[float], tpot: list[float]
) -> dict[str, Any]:
    def q(xs: list[float], p: float) -> float:
        return float(np.percentile(xs, p)) if xs else float("nan")

    return {
        "system": name,
        "tok_s": out_tokens / makespan,
        "makespan_s": makespan,
        "ttft_p50": q(ttft, 50),
        "ttft_p99": q(ttft, 99),
        "tpot_p50": q(tpot, 50),
        "tpot_p99": q(tpot, 99),
    }


def _tpot(times: list[float]) -> float | None:
    return (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None


# -- batchpilot ---------------------------------------------------------------------------------
def run_batchpilot(
    hf: Any, prompts: list[list[int]], outs: list[int], args: argparse.Namespace
) -> dict[str, Any]:
    config = LLMSchedulerConfig(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_batched_tokens,
        num_kv_blocks=args.kv_blocks,
        block_size=16,
        max_model_len=2048,
    )
    runner = LLMModelRunner(LlamaWeights.from_hf(hf), config.num_kv_blocks, config.block_size)
    engine = LLMEngine(runner, build_tokenizer(hf.config.vocab_size), config, sampler=Sampler(0)).start()

    async def one(prompt: list[int], n: int, t0: float) -> list[float]:
        times = []
        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        async for item in engine.generate(prompt, params):
            times.extend([time.perf_counter() - t0] * len(item.token_ids))
        return times

    async def all_requests(ps: list[list[int]], ns: list[int]) -> tuple[float, list[list[float]]]:
        t0 = time.perf_counter()
        res = await asyncio.gather(*(one(p, n, t0) for p, n in zip(ps, ns, strict=True)))
        return time.perf_counter() - t0, list(res)

    try:
        asyncio.run(all_requests(prompts[:4], [4] * 4))  # warm-up
        makespan, times = asyncio.run(all_requests(prompts, outs))
        stats = engine.stats()
    finally:
        engine.shutdown()
    assert [len(t) for t in times] == outs
    res = summarize(
        "batchpilot",
        sum(outs),
        makespan,
        [t[0] for t in times],
        [x for t in times if (x := _tpot(t)) is not None],
    )
    res["preemptions"] = stats.num_preemptions
    res["steps"] = stats.num_steps
    return res


# -- HF static batching -------------------------------------------------------------------------
class _StepClock:
    """A logits processor that only records when each decoding step's logits are ready."""

    def __init__(self, t0: float) -> None:
        self.t0 = t0
        self.times: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.times.append(time.perf_counter() - self.t0)
        return scores


def run_hf_static(hf: Any, prompts: list[list[int]], outs: list[int], batch_size: int) -> dict[str, Any]:
    from transformers import LogitsProcessorList

    def batch_generate(ps: list[list[int]], ns: list[int], t0: float) -> list[list[float]]:
        width = max(len(p) for p in ps)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in ps])  # left padding
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ps])
        clock = _StepClock(t0)
        with torch.inference_mode():
            hf.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=max(ns),
                min_new_tokens=max(ns),
                do_sample=False,
                pad_token_id=0,
                eos_token_id=None,
                logits_processor=LogitsProcessorList([clock]),
            )
        return [clock.times[:n] for n in ns]

    batch_generate(prompts[:2], [2, 2], time.perf_counter())  # warm-up
    t0 = time.perf_counter()
    times: list[list[float]] = []
    for i in range(0, len(prompts), batch_size):
        times += batch_generate(prompts[i : i + batch_size], outs[i : i + batch_size], t0)
    makespan = time.perf_counter() - t0
    return summarize(
        f"HF static (batch {batch_size})",
        sum(outs),
        makespan,
        [t[0] for t in times],
        [x for t in times if (x := _tpot(t)) is not None],
    )


# -- HF continuous batching ---------------------------------------------------------------------
def run_hf_cb(hf: Any, prompts: list[list[int]], outs: list[int]) -> dict[str, Any]:
    from transformers import GenerationConfig

    gen_cfg = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=0, max_new_tokens=max(outs))

    def run(ps: list[list[int]], ns: list[int]) -> tuple[float, float, dict[str, Any]]:
        results: dict[str, Any] = {}
        with hf.continuous_batching_context_manager(generation_config=gen_cfg, block=True, timeout=30) as mgr:
            t0 = time.perf_counter()
            for i, (p, n) in enumerate(zip(ps, ns, strict=True)):
                mgr.add_request(
                    p, request_id=f"r{i}", max_new_tokens=n, record_timestamps=True, eos_token_id=-1
                )
            while len(results) < len(ps):
                r = mgr.get_result(timeout=1)
                if r is not None and r.is_finished():
                    results[r.request_id] = r
                elif r is None and not mgr.is_running():
                    raise RuntimeError("HF continuous batching stopped early")
            t1 = time.perf_counter()
        return t0, t1, results

    run(prompts[:4], [4] * 4)  # warm-up
    t0, t1, results = run(prompts, outs)
    ttft, tpot = [], []
    produced = 0
    for i in range(len(prompts)):
        r = results[f"r{i}"]
        produced += len(r.generated_tokens)
        ts = [t - t0 for t in (r.timestamps or [])]
        if ts:
            ttft.append(ts[0])
            if (x := _tpot(ts)) is not None:
                tpot.append(x)
    res = summarize("HF generate_batch (CB)", produced, t1 - t0, ttft, tpot)
    res["tokens_ok"] = produced == sum(outs)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--start", type=int, default=0, help="first trace row of the slice")
    ap.add_argument("--batch-size", type=int, default=16, help="HF static batch size")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-batched-tokens", type=int, default=512)
    ap.add_argument("--kv-blocks", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch intra-op threads for all systems (0 = torch's "
        "default); 1 is steadier when other jobs share the cores",
    )
    ap.add_argument("--skip", nargs="*", default=[], choices=["static", "cb"], help="baselines to skip")
    args = ap.parse_args()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    if args.threads:
        torch.set_num_threads(args.threads)
    # process-wide (all three systems below run with it): glibc keeps freed memory instead of
    # unmapping it, as build_llm_engine does for a CPU engine
    keep_freed_memory()
    cfg = LLMModelConfig(seed=args.seed)
    hf = load_hf_llama(None, cfg)
    prompts, outs = make_requests(args.num_requests, args.start, args.seed, cfg.vocab_size)
    print(
        f"conv-llm rows [{args.start}, {args.start + args.num_requests}): {len(prompts)} requests, "
        f"{sum(len(p) for p in prompts)} prompt tokens, {sum(outs)} output tokens; torch threads "
        f"{torch.get_num_threads()}; model {cfg.num_hidden_layers}x{cfg.hidden_size} vocab {cfg.vocab_size}"
    )
    rows = [run_batchpilot(hf, prompts, outs, args)]
    print(rows[-1], flush=True)
    if "static" not in args.skip:
        rows.append(run_hf_static(hf, prompts, outs, args.batch_size))
        print(rows[-1], flush=True)
    if "cb" not in args.skip:
        rows.append(run_hf_cb(hf, prompts, outs))
        print(rows[-1], flush=True)

    print(
        f"\n{'system':<26}{'out tok/s':>10}{'makespan s':>11}{'TTFT p50':>10}{'TTFT p99':>10}"
        f"{'TPOT p50':>10}{'TPOT p99':>10}"
    )
    for r in rows:
        print(
            f"{r['system']:<26}{r['tok_s']:>10.1f}{r['makespan_s']:>11.1f}{r['ttft_p50']:>10.2f}"
            f"{r['ttft_p99']:>10.2f}{r['tpot_p50'] * 1e3:>8.1f}ms{r['tpot_p99'] * 1e3:>8.1f}ms"
        )
    ours = rows[0]["tok_s"]
    for r in rows[1:]:
        target = 2.5 if r["system"].startswith("HF static") else 1.3
        print(f"batchpilot / {r['system']}: {ours / r['tok_s']:.2f}x (target >= {target}x)")


if __name__ == "__main__":
    main()
