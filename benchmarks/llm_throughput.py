"""Offline LLM throughput on a conv-llm slice: batchpilot vs HF static batching vs HF continuous batching.

One process, one model (the default tiny Llama: 6 x 512, GQA 8:4, vocab 4096, seeded random weights,
fp32, sdpa attention for HF), the same requests for every run: a contiguous slice of the conv-llm
workload (docs/design.md: prompt ``clip(round(ctx/8), 4, 1024)`` tokens, output ``clip(gen, 1, 256)``
tokens, EOS ignored), all submitted at t=0 (an offline batch). Prompts are seeded random token ids
(the model is random: only lengths matter).

Fairness: ``--rounds`` rounds (default 3); each round runs every system on every point of its grid,
on the same requests, the systems' order rotated by one each round and each grid walked in the
opposite direction every other round (the CPU's speed moves by tens of percent over minutes here).
Every config gets a short warm-up run (4 other prompts of 8-512 tokens, 4 tokens each) right before
its timed run. A round's ratio is batchpilot's best-of-grid tok/s over each baseline's best-of-grid.

* batchpilot: ``LLMEngine`` (engine thread, paged KV, chunked prefill, fcfs, float32 like the
  baselines, the runner's packed matrices and row plan measured as ``serve`` measures them:
  ``models/llm/dense.py``, ``models/llm/runner.py``) through its async API.
  Limits: ``max_num_batched_tokens`` in the grid (``--grid-tokens``, default 128/256/512/1024),
  ``max_num_seqs`` 64, ``num_kv_blocks`` 2048 x ``block_size`` 16, ``max_model_len`` 2048, no prefix
  caching. Token times are taken as each streamed item reaches the client's event loop.
* HF continuous batching: transformers' ``ContinuousBatchingManager`` (what ``generate_batch`` wraps,
  used directly so every request gets its own ``max_new_tokens``), EOS disabled, given the same
  limits through a ``ContinuousBatchingConfig``: ``max_batch_tokens`` = the grid point,
  ``max_requests_per_batch`` = 64, ``num_blocks`` 2048 x ``page_size`` 16 (its block is
  ``page_size`` tokens of K and V for every layer, as batchpilot's is; the script checks the cache
  it built has exactly that many blocks and that token budget), ``allow_block_sharing=False`` (prefix
  caching off, as for batchpilot), scheduler ``fifo`` (decoding requests first, prefills split to the
  token budget). Left at its defaults: ``safety_margin`` 0.15 (no new prefill while < 15% of the
  blocks are free) where batchpilot has none, and no ``max_model_len``; the default slice's prompts
  and outputs together are under 10k of the 32k token slots, so neither binds. On CPU it runs
  without CUDA graphs, async batching or the flash decode path (they need CUDA): sdpa over the whole
  step packed as one sequence, with a block mask of shape (step tokens, KV of the step's requests).
  ``record_timestamps=True`` stamps each token (``time.perf_counter``) on the generation thread as it
  is appended after its forward step (``RequestState.update_and_check_completion``), so these are
  true per-token times (they match streamed arrival times to ~1 ms); a request soft-reset by the
  offloading manager would restart its stamps, which the token-count check would show.
* HF static: ``model.generate`` on fixed-size left-padded batches (``--batch-sizes``, default
  8/16/32/48; 48 = all the default requests at once) in arrival order, one after another, each
  running until its longest member is done; a request's tokens count only up to its own length. A
  token's time is when its step's logits are ready (a logits processor stamps each step), so a
  request's first token is when its batch's prefill finishes (later batches wait for earlier ones).

Per run: output tok/s (tokens counted as produced / makespan), TTFT (t=0 to the request's first
token) and TPOT ((last - first token time) / (n - 1)) P50/P99, and produced == requested tokens.

    .venv/bin/python benchmarks/llm_throughput.py [--threads 1] [--rounds 3] [--num-requests 48]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import statistics
import time
from typing import Any

import numpy as np
import torch

from batchpilot.core.llm.config import LLMSchedulerConfig
from batchpilot.core.llm.sequence import SamplingParams
from batchpilot.models.llm.dense import packing_pays
from batchpilot.models.llm.runner import LLMModelRunner, keep_freed_memory
from batchpilot.models.llm.sampler import Sampler
from batchpilot.models.llm.tokenizer import build_tokenizer
from batchpilot.models.llm.weights import LlamaWeights, load_hf_llama
from batchpilot.models.seeded import LLMModelConfig
from batchpilot.runtime.llm.engine import LLMEngine
from batchpilot.sim.traces import load_workload

SYSTEMS = ("batchpilot", "HF static", "HF CB")
TARGETS = {"HF static": 3.0, "HF CB": 1.5}  # batchpilot tok/s over the baseline's, both best-of-grid
BLOCK_SIZE = 16
WARMUP_LENS = (8, 32, 128, 512)
Requests = tuple[list[list[int]], list[int]]


# -- requests and statistics (pure) -------------------------------------------------------------
def make_requests(num: int, start: int, seed: int, vocab: int) -> Requests:
    wl = load_workload("conv-llm", start=start, count=num)
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(7, vocab, int(n)).tolist() for n in wl.input_tokens]
    return prompts, [int(n) for n in wl.output_tokens]


def warmup_requests(seed: int, vocab: int) -> Requests:
    """Prompts no timed request shares a prefix with (another seed), 4 output tokens each."""
    rng = np.random.default_rng(seed + 1_000_003)
    return [rng.integers(7, vocab, n).tolist() for n in WARMUP_LENS], [4] * len(WARMUP_LENS)


def pct(xs: list[float], p: float) -> float:
    return float(np.percentile(xs, p)) if xs else float("nan")


def summarize(times: list[list[float]], outs: list[int], makespan: float) -> dict[str, Any]:
    """``times[i]``: request i's token times in seconds since t=0 (submission), one per produced token."""
    ttft = [t[0] for t in times if t]
    tpot = [(t[-1] - t[0]) / (len(t) - 1) for t in times if len(t) > 1]
    produced = sum(len(t) for t in times)
    return {"tok_s": produced / makespan, "makespan_s": makespan, "produced": produced,
            "tokens_ok": [len(t) for t in times] == list(outs),
            "ttft_p50": pct(ttft, 50), "ttft_p99": pct(ttft, 99),
            "tpot_p50": pct(tpot, 50), "tpot_p99": pct(tpot, 99)}


def round_order(systems: list[str], r: int) -> list[str]:
    """Round r's system order: rotated by r, so each system goes first, middle and last in turn."""
    k = r % len(systems) if systems else 0
    return systems[k:] + systems[:k]


def grid_order(grid: list[int], r: int) -> list[int]:
    """Round r's walk through a grid: forward on even rounds, backward on odd ones."""
    return list(grid) if r % 2 == 0 else list(reversed(grid))


def best_of(rows: list[dict[str, Any]]) -> dict[str, Any]:
    return max(rows, key=lambda row: row["tok_s"])


def median_spread(xs: list[float]) -> tuple[float, float, float]:
    return statistics.median(xs), min(xs), max(xs)


def best_config(rows: list[dict[str, Any]]) -> tuple[int, float]:
    """The grid point with the highest median tok/s over rounds, and that median."""
    by_cfg: dict[int, list[float]] = {}
    for row in rows:
        by_cfg.setdefault(row["config"], []).append(row["tok_s"])
    cfg = max(by_cfg, key=lambda c: statistics.median(by_cfg[c]))
    return cfg, statistics.median(by_cfg[cfg])


# -- batchpilot ---------------------------------------------------------------------------------
def run_batchpilot(hf: Any, reqs: Requests, warm: Requests, max_tokens: int,
                   args: argparse.Namespace) -> dict[str, Any]:
    config = LLMSchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=max_tokens,
                                num_kv_blocks=args.kv_blocks, block_size=BLOCK_SIZE, max_model_len=2048)
    weights = LlamaWeights.from_hf(hf)
    runner = LLMModelRunner(weights, config.num_kv_blocks, config.block_size)
    # as build_llm_engine (serve at float32) does: the row counts where packed matrices are faster, then
    # the row counts the matmuls run fastest at
    runner.pack(packing_pays(weights.dense_matrices(), runner.device, runner.dtype).packed)
    runner.plan_rows()
    engine = LLMEngine(runner, build_tokenizer(hf.config.vocab_size), config, sampler=Sampler(0)).start()

    async def one(prompt: list[int], n: int, t0: float) -> list[float]:
        times: list[float] = []
        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        async for item in engine.generate(prompt, params):
            times.extend([time.perf_counter() - t0] * len(item.token_ids))
        return times

    async def batch(ps: list[list[int]], ns: list[int]) -> tuple[float, list[list[float]]]:
        t0 = time.perf_counter()
        res = await asyncio.gather(*(one(p, n, t0) for p, n in zip(ps, ns, strict=True)))
        return time.perf_counter() - t0, list(res)

    try:
        asyncio.run(batch(*warm))
        before = engine.stats()
        makespan, times = asyncio.run(batch(*reqs))
        after = engine.stats()
    finally:
        engine.shutdown()
    row = summarize(times, reqs[1], makespan)
    row["note"] = (f"{after.num_steps - before.num_steps} steps, "
                   f"{after.num_preemptions - before.num_preemptions} preemptions")
    return row


# -- HF static batching -------------------------------------------------------------------------
class _StepClock:
    """A logits processor that only records when each decoding step's logits are ready."""

    def __init__(self, t0: float) -> None:
        self.t0 = t0
        self.times: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.times.append(time.perf_counter() - self.t0)
        return scores


def _static_batch(hf: Any, ps: list[list[int]], ns: list[int], t0: float) -> list[list[float]]:
    from transformers import LogitsProcessorList

    width = max(len(p) for p in ps)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in ps])  # left padding
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ps])
    clock = _StepClock(t0)
    with torch.inference_mode():
        out = hf.generate(ids, attention_mask=mask, max_new_tokens=max(ns), min_new_tokens=max(ns),
                          do_sample=False, pad_token_id=0, eos_token_id=None,
                          logits_processor=LogitsProcessorList([clock]))
    made = min(out.shape[1] - width, len(clock.times))  # tokens every row of the batch got
    return [clock.times[: min(n, made)] for n in ns]


def run_hf_static(hf: Any, reqs: Requests, warm: Requests, batch_size: int) -> dict[str, Any]:
    _static_batch(hf, *warm, time.perf_counter())
    prompts, outs = reqs
    t0 = time.perf_counter()
    times: list[list[float]] = []
    for i in range(0, len(prompts), batch_size):
        times += _static_batch(hf, prompts[i : i + batch_size], outs[i : i + batch_size], t0)
    row = summarize(times, outs, time.perf_counter() - t0)
    row["note"] = f"{-(-len(prompts) // batch_size)} batches"
    return row


# -- HF continuous batching ---------------------------------------------------------------------
def _cb_batch(mgr: Any, ps: list[list[int]], ns: list[int], tag: str) -> tuple[float, float, list[Any]]:
    results: dict[str, Any] = {}
    t0 = time.perf_counter()
    for i, (p, n) in enumerate(zip(ps, ns, strict=True)):
        mgr.add_request(p, request_id=f"{tag}{i}", max_new_tokens=n, record_timestamps=True, eos_token_id=-1)
    while len(results) < len(ps):
        r = mgr.get_result(timeout=1)
        if r is not None and r.is_finished():
            if r.error is not None:
                raise RuntimeError(f"HF continuous batching failed {r.request_id}: {r.error}")
            results[r.request_id] = r
        elif r is None and not mgr.is_running():
            raise RuntimeError("HF continuous batching stopped early")
    return t0, time.perf_counter(), [results[f"{tag}{i}"] for i in range(len(ps))]


def run_hf_cb(hf: Any, reqs: Requests, warm: Requests, max_tokens: int,
              args: argparse.Namespace) -> dict[str, Any]:
    from transformers import ContinuousBatchingConfig, GenerationConfig

    gen_cfg = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=0, max_new_tokens=max(reqs[1]))
    cb_cfg = ContinuousBatchingConfig(page_size=BLOCK_SIZE, num_blocks=args.kv_blocks,
                                      max_batch_tokens=max_tokens, max_requests_per_batch=args.max_num_seqs,
                                      allow_block_sharing=False, scheduler_type="fifo")
    with hf.continuous_batching_context_manager(generation_config=gen_cfg, continuous_batching_config=cb_cfg,
                                                block=True, timeout=30) as mgr:
        _cb_batch(mgr, *warm, "w")
        steps0 = mgr.current_batch
        t0, t1, results = _cb_batch(mgr, *reqs, "r")
        steps = mgr.current_batch - steps0
        cache, got = mgr.batch_processor.cache, mgr.continuous_batching_config
        limits = (cache.num_blocks, got.page_size, cache.max_batch_tokens, got.max_requests_per_batch)
    if limits != (args.kv_blocks, BLOCK_SIZE, max_tokens, args.max_num_seqs):
        raise RuntimeError(f"HF CB did not take the limits (blocks, page, tokens, seqs): {limits}")
    # one stamp per generated token; a count mismatch shows in tokens_ok
    times = [[t - t0 for t in (r.timestamps or [])][: len(r.generated_tokens)] for r in results]
    row = summarize(times, reqs[1], t1 - t0)
    row["tokens_ok"] &= [len(r.generated_tokens) for r in results] == reqs[1]
    row["note"] = f"{steps} steps"
    gc.collect()
    return row


# -- driver -------------------------------------------------------------------------------------
def run_one(system: str, cfg: int, hf: Any, reqs: Requests, warm: Requests,
            args: argparse.Namespace) -> dict[str, Any]:
    if system == "batchpilot":
        return run_batchpilot(hf, reqs, warm, cfg, args)
    if system == "HF static":
        return run_hf_static(hf, reqs, warm, cfg)
    return run_hf_cb(hf, reqs, warm, cfg, args)


def label(system: str, cfg: int) -> str:
    return f"{system} (batch {cfg})" if system == "HF static" else f"{system} ({cfg} tok)"


def fmt_row(row: dict[str, Any]) -> str:
    return (f"{row['round']:>5}  {label(row['system'], row['config']):<24}{row['tok_s']:>9.1f}"
            f"{row['makespan_s']:>10.1f}{row['ttft_p50']:>9.2f}{row['ttft_p99']:>9.2f}"
            f"{row['tpot_p50'] * 1e3:>8.1f}ms{row['tpot_p99'] * 1e3:>8.1f}ms"
            f"  {'yes' if row['tokens_ok'] else 'NO'}  {row['note']}")


HEADER = (f"{'round':>5}  {'system (config)':<24}{'tok/s':>9}{'makespan':>10}{'TTFT p50':>9}{'TTFT p99':>9}"
          f"{'TPOT p50':>10}{'TPOT p99':>10}  tokens ok")


def report(rows: list[dict[str, Any]], systems: list[str], rounds: int) -> None:
    print("\nbest of grid per round (the config with the highest tok/s that round):")
    print(HEADER)
    best = {(s, r): best_of([x for x in rows if x["system"] == s and x["round"] == r])
            for r in range(rounds) for s in systems}
    for r in range(rounds):
        for s in systems:
            print(fmt_row(best[s, r]))
    print("\nbest config per system (highest median tok/s over rounds):")
    for s in systems:
        cfg, med = best_config([x for x in rows if x["system"] == s])
        print(f"  {label(s, cfg)}: {med:.1f} tok/s")
    if "batchpilot" not in systems:
        return
    for s in [x for x in systems if x != "batchpilot"]:
        ratios = [best["batchpilot", r]["tok_s"] / best[s, r]["tok_s"] for r in range(rounds)]
        med, lo, hi = median_spread(ratios)
        verdict = "met" if med >= TARGETS[s] else "MISSED"
        print(f"batchpilot / {s}: median {med:.2f}x over {rounds} rounds (min {lo:.2f}x, max {hi:.2f}x; "
              f"per round {', '.join(f'{x:.2f}' for x in ratios)}); target >= {TARGETS[s]}x: {verdict}")
    ok = all(x["tokens_ok"] for x in rows)
    print(f"tokens produced == tokens requested in every run: {'yes' if ok else 'NO'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=48, help="48 keeps the default run near 20 "
                    "minutes on 2 cores")
    ap.add_argument("--start", type=int, default=0, help="first trace row of the slice")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--grid-tokens", type=int, nargs="+", default=[128, 256, 512, 1024],
                    help="max batched tokens per step, for batchpilot and HF continuous batching alike")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[8, 16, 32, 48],
                    help="HF static batch sizes")
    ap.add_argument("--max-num-seqs", type=int, default=64, help="max sequences per step, both CB systems")
    ap.add_argument("--kv-blocks", type=int, default=2048, help=f"KV blocks of {BLOCK_SIZE} tokens, both")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads for all systems (0 = "
                    "torch's default); 1 is steadier when other jobs share the cores")
    ap.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    args = ap.parse_args()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.CRITICAL)  # psutil notices on CPU
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    if args.threads:
        torch.set_num_threads(args.threads)
    # process-wide (every system runs with it): glibc keeps freed memory instead of unmapping it, as
    # build_llm_engine does for a CPU engine
    keep_freed_memory()
    cfg = LLMModelConfig(seed=args.seed)
    hf = load_hf_llama(None, cfg)
    reqs = make_requests(args.num_requests, args.start, args.seed, cfg.vocab_size)
    warm = warmup_requests(args.seed, cfg.vocab_size)
    prompts, outs = reqs
    print(f"conv-llm rows [{args.start}, {args.start + args.num_requests}): {len(prompts)} requests, "
          f"{sum(len(p) for p in prompts)} prompt tokens, {sum(outs)} output tokens; torch threads "
          f"{torch.get_num_threads()}; model {cfg.num_hidden_layers}x{cfg.hidden_size} "
          f"vocab {cfg.vocab_size}; "
          f"CB limits: max_num_seqs {args.max_num_seqs}, {args.kv_blocks} KV blocks x {BLOCK_SIZE} tokens")
    grids = {"batchpilot": args.grid_tokens, "HF static": args.batch_sizes, "HF CB": args.grid_tokens}
    systems = [s for s in SYSTEMS if s in args.systems]
    rows: list[dict[str, Any]] = []
    print(HEADER, flush=True)
    t_start = time.perf_counter()
    for r in range(args.rounds):
        for s in round_order(systems, r):
            for c in grid_order(grids[s], r):
                rows.append({"round": r, "system": s, "config": c, **run_one(s, c, hf, reqs, warm, args)})
                print(fmt_row(rows[-1]), flush=True)
    print(f"total {time.perf_counter() - t_start:.0f} s")
    report(rows, systems, args.rounds)


if __name__ == "__main__":
    main()
