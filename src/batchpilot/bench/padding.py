"""Offline padding benchmark: every padding strategy against the zero-padding limit, in one run.

    batchpilot bench padding [--requests 128] [--repeats 1] [--out bench-out/padding]
    .venv/bin/python benchmarks/padding.py ...   (the same)

A conv-embed slice (all requests available) is batched by the core planner (core/planner.py,
core/bucketing.py) in each mode — pad-to-512, FIFO dynamic, length-sorted, fixed/quantile/k-means/DP
buckets, DP partition, padding-free — and every batch runs through the real ``EncoderExecutor``
(lean padded forward, or models/ragged.py for padding-free). For each mode: useful tokens/s, padding
efficiency (useful / computed tokens) and the ratio to the zero-padding limit ``sum_i L_i * c*(L_i)``,
where ``c*(L)`` is the best seconds per token over batch sizes of equal-length batches (no padding),
measured in the same run and interpolated linearly in L between the grid lengths.

Timings on shared cores are noisy, so all batches of all modes and the c*(L) grid run interleaved in
one seeded random order: a load spike hits every mode alike. Compare only inside one run. The default
clock is this process's CPU time with one intra-op thread (``--clock process --threads 1``): on cores
shared with other jobs, wall time measures the neighbours (and OpenMP barriers waiting for a
descheduled thread), CPU time measures the work. On a quiet machine use ``--clock wall --threads 2``.
Prints the table; writes ``padding.json`` and ``padding.png`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from batchpilot.core.batch import Batch
from batchpilot.core.bucketing import Bucketer
from batchpilot.core.config import BucketingConfig, PlannerConfig
from batchpilot.core.costmodel import BatchShape, CostModel, ProfilePoint
from batchpilot.core.planner import BatchPlanner
from batchpilot.core.request import Request

MAX_LEN = 512
GRID_LENGTHS = (4, 8, 16, 32, 64, 128, 256, 384, 512)
GRID_SIZES = (1, 8, 32)  # plus the largest batch the token budget allows at each length
CLOCKS = {"process": time.process_time, "wall": time.perf_counter}
# (label, grouping, padding, bucket method or None)
MODES: tuple[tuple[str, str, str, str | None], ...] = (
    ("pad-to-512", "fifo", "max", None),
    ("dynamic FIFO", "fifo", "dynamic", None),
    ("length-sorted", "sorted", "dynamic", None),
    ("buckets 64/128/256/512", "bucket", "bucket", "fixed"),
    ("buckets quantile", "bucket", "bucket", "quantile"),
    ("buckets k-means", "bucket", "bucket", "kmeans"),
    ("buckets DP", "bucket", "bucket", "dp"),
    ("DP partition", "dp", "dynamic", None),
    ("padding-free", "fifo", "none", None),
)


@dataclass
class ModeResult:
    label: str
    batches: list[Batch]
    seconds: float = 0.0

    @property
    def useful(self) -> int:
        return sum(b.shape.useful_tokens for b in self.batches)

    @property
    def computed(self) -> int:
        return sum(b.shape.tokens for b in self.batches)


def plan_offline(lengths: list[int], payloads: list[list[int]], grouping: str, padding: str,
                 method: str | None, cost_model: CostModel, cap: int, max_tokens: int,
                 num_buckets: int = 8) -> list[Batch]:
    """Batches the core planner forms when every request is already waiting (queue order = arrival)."""
    cfg = PlannerConfig(grouping=grouping, padding=padding, max_len=MAX_LEN,  # type: ignore[arg-type]
                        max_batch_tokens=max_tokens)
    bucketer = None
    if method is not None:
        bcfg = BucketingConfig(method=method, num_buckets=num_buckets)  # type: ignore[arg-type]
        bucketer = Bucketer(bcfg, cost_model, MAX_LEN)
        for n in lengths:  # offline every length is known: fit the edges on the whole slice
            bucketer.observe(n, 0.0)
        if method != "fixed":
            bucketer.refit(0.0)
    planner = BatchPlanner(cfg, cost_model, bucketer)
    waiting = [Request(id=i, arrival=0.0, length=n, payload=p)
               for i, (n, p) in enumerate(zip(lengths, payloads, strict=True))]
    out: list[Batch] = []
    while waiting:
        plan = planner.plan(waiting, cap)
        out.append(Batch(len(out), plan.requests, plan.padded_len, plan.shape, padding, 0.0,
                         plan.predicted_s))
        taken = {r.id for r in plan.requests}
        waiting = [r for r in waiting if r.id not in taken]
    return out


def equal_batch(texts_ids: dict[int, list[list[int]]], length: int, n: int) -> Batch:
    reqs = [Request(id=i, arrival=0.0, length=length, payload=texts_ids[length][i]) for i in range(n)]
    return Batch(0, reqs, length, BatchShape.padded([length] * n, length), "dynamic", 0.0)


def run_jobs(jobs: list[tuple[Any, Batch]], executor: Any, seed: int, clock: Callable[[], float]
             ) -> list[float]:
    """Run every (key, batch) once in a seeded shuffled order; seconds of ``run`` (collation excluded)."""
    order = list(range(len(jobs)))
    random.Random(seed).shuffle(order)
    times = [0.0] * len(jobs)
    for i in order:
        prepared = executor.prepare(jobs[i][1])
        t0 = clock()
        executor.run(prepared)
        times[i] = clock() - t0
    return times


def grid_keys(max_tokens: int, cap: int, lengths: tuple[int, ...] = GRID_LENGTHS,
              sizes: tuple[int, ...] = GRID_SIZES) -> list[tuple[int, int]]:
    """(L, n) equal-length batches: the given sizes within budget, plus the largest that fits."""
    keys = []
    for L in lengths:
        most = max(1, min(cap, max_tokens // L))
        keys += [(L, n) for n in sorted({*(n for n in sizes if n <= most), most})]
    return keys


def c_star(grid: dict[tuple[int, int], float]) -> Callable[[np.ndarray], np.ndarray]:
    """Best seconds per token at each length (over batch sizes), linear in L between grid lengths."""
    xs = np.array(GRID_LENGTHS, dtype=float)
    ys = np.array([min(t / (n * L) for (L2, n), t in grid.items() if L2 == L) for L in GRID_LENGTHS])
    return lambda lengths: np.interp(np.asarray(lengths, dtype=float), xs, ys)


def fit_cost_model(grid: dict[tuple[int, int], float]) -> CostModel:
    pts = [ProfilePoint(BatchShape.padded([L] * n, L).features(), t) for (L, n), t in grid.items()]
    return CostModel.fit(pts, meta={"source": "bench padding profile grid"})


def padding_section(executor: Any, args: argparse.Namespace) -> dict[str, Any]:
    from batchpilot.models.texts import texts_for_lengths
    from batchpilot.sim.traces import load_workload

    wl = load_workload("conv-embed", start=args.start, count=args.requests)
    lengths = [int(x) for x in wl.input_tokens]
    tok = executor.tokenizer
    ids = executor.tokenize(texts_for_lengths(tok, lengths, seed=args.seed))
    assert [len(x) for x in ids] == lengths, "texts_for_lengths gave texts of the wrong token length"
    k = args.max_batch_size
    grid_ids = executor.tokenize(texts_for_lengths(tok, [L for L in GRID_LENGTHS for _ in range(k)], seed=1))
    ids_by_len = {L: grid_ids[i * k:(i + 1) * k] for i, L in enumerate(GRID_LENGTHS)}
    print(f"== padding: conv-embed rows {args.start}..{args.start + len(lengths)}, {len(lengths)} requests, "
          f"{sum(lengths)} tokens (mean {np.mean(lengths):.0f}); cap {args.max_batch_size} requests, "
          f"{args.max_batch_tokens} computed tokens per batch", flush=True)
    t0 = time.perf_counter()
    clock = CLOCKS[args.clock]
    # a small pre-pass fits the cost model the planner needs to choose batches (sorted, DP, DP buckets)
    pre = grid_keys(args.max_batch_tokens, args.max_batch_size, (16, 64, 256, 512), (1, 8))
    pre_jobs = [(k, equal_batch(ids_by_len, *k)) for k in pre]
    cm = fit_cost_model(dict(zip(pre, run_jobs(pre_jobs, executor, args.seed, clock), strict=True)))
    modes = [ModeResult(label, plan_offline(lengths, ids, g, p, m, cm, args.max_batch_size,
                                            args.max_batch_tokens, args.num_buckets))
             for label, g, p, m in MODES]
    keys = grid_keys(args.max_batch_tokens, args.max_batch_size)
    grid = {k: float("inf") for k in keys}
    jobs: list[tuple[Any, Batch]] = [(("mode", i), b) for i, m in enumerate(modes) for b in m.batches]
    # every grid batch twice: c*(L) is a best-of, so give each point more than one draw of the noise
    jobs += [(("grid", k), equal_batch(ids_by_len, *k)) for k in keys for _ in range(2)]
    for r in range(args.repeats):
        for (key, _), t in zip(jobs, run_jobs(jobs, executor, args.seed + 100 + r, clock), strict=True):
            if key[0] == "mode":
                modes[key[1]].seconds += t / args.repeats
            else:
                grid[key[1]] = min(grid[key[1]], t)
    cstar = c_star(grid)
    limit_s = float(np.sum(np.array(lengths) * cstar(lengths)))
    base = modes[0].useful / modes[0].seconds
    rows = []
    for m in modes:
        tput = m.useful / m.seconds
        rows.append({"mode": m.label, "batches": len(m.batches), "useful_tokens": m.useful,
                     "computed_tokens": m.computed, "seconds": m.seconds, "useful_tok_s": tput,
                     "efficiency": m.useful / m.computed, "of_limit": limit_s / m.seconds,
                     "vs_pad512": tput / base})
    unit = "tok/CPU-s" if args.clock == "process" else "tok/s"
    print(f"{'mode':24} {'batches':>7} {'useful ' + unit:>15} {'efficiency':>10} {'of limit':>8} "
          f"{'x pad-512':>9}")
    for r in rows:
        print(f"{r['mode']:24} {r['batches']:7d} {r['useful_tok_s']:15.0f} {r['efficiency']:10.3f} "
              f"{r['of_limit']:8.1%} {r['vs_pad512']:9.2f}")
    print(f"zero-padding limit: {sum(lengths) / limit_s:.0f} useful {unit} (sum L*c*(L) = {limit_s:.2f} s); "
          f"section took {time.perf_counter() - t0:.0f} s")
    cst = {L: float(cstar([L])[0]) for L in GRID_LENGTHS}
    print("c*(L) ms/token: " + "  ".join(f"{L}:{v * 1e3:.3f}" for L, v in cst.items()))
    return {"requests": len(lengths), "start": args.start, "rows": rows, "limit_s": limit_s,
            "limit_tok_s": sum(lengths) / limit_s, "c_star_s_per_token": cst,
            "cost_model": cm.to_dict(), "clock": args.clock, "grid_s": {f"{L}x{n}": t for (L, n), t in
                                                                         grid.items()}}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="batchpilot bench padding", description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=128, help="conv-embed rows in the slice")
    p.add_argument("--start", type=int, default=0, help="first row of the slice")
    p.add_argument("--max-batch-size", type=int, default=32)
    p.add_argument("--max-batch-tokens", type=int, default=8192, help="computed tokens per batch")
    p.add_argument("--repeats", type=int, default=1, help="interleaved passes over every batch (mean)")
    p.add_argument("--num-buckets", type=int, default=8, help="buckets for the quantile/k-means/DP methods")
    p.add_argument("--clock", choices=tuple(CLOCKS), default="process",
                   help="process: CPU seconds of this process (robust on shared cores); wall: elapsed")
    p.add_argument("--model", default=None, help="HF encoder folder (default: the embedded MiniLM)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (0: every core)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench-out/padding", help="folder for padding.json and padding.png")
    return p


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(13, 4.8), gridspec_kw={"width_ratios": [2, 1]})
    y = np.arange(len(rows))[::-1]
    ax.barh(y, [r["useful_tok_s"] for r in rows], color="tab:blue")
    ax.axvline(result["limit_tok_s"], color="tab:red", ls="--", label="zero-padding limit")
    for yi, r in zip(y, rows, strict=True):
        ax.text(r["useful_tok_s"], yi, f" eff {r['efficiency']:.2f} | {r['of_limit']:.0%} of limit",
                va="center", fontsize=8)
    ax.set_yticks(y, [r["mode"] for r in rows])
    ax.set_xlabel("useful tokens per CPU-second" if result["clock"] == "process" else "useful tokens / s")
    ax.set_xlim(0, result["limit_tok_s"] * 1.45)
    ax.legend(loc="lower right")
    ax.set_title(f"conv-embed, {result['requests']} requests, offline ({result['model']})")
    cs = result["c_star_s_per_token"]
    ax2.plot([int(k) for k in cs], [v * 1e3 for v in cs.values()], "o-")
    ax2.set_xscale("log", base=2)
    ax2.set_xlabel("sequence length L (tokens)")
    ax2.set_ylabel("c*(L): best ms per token")
    ax2.set_title("equal-length batches, best over batch sizes")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from batchpilot.models.encoder import EncoderConfig, EncoderExecutor

    executor = EncoderExecutor(EncoderConfig(model_path=args.model, num_threads=args.threads or None))
    executor.warmup()
    result = padding_section(executor, args)
    result["model"] = executor.model_name
    result["threads"] = executor.num_threads
    result["args"] = vars(args)
    folder = Path(args.out)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "padding.json").write_text(json.dumps(result, indent=2))
    plot(result, folder / "padding.png")
    print(f"wrote {folder / 'padding.json'} and {folder / 'padding.png'}")
    return 0
