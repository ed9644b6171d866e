"""Per-call fixed cost and per-token cost: HF forward vs lean padded vs padding-free; CPU attention choice.

    .venv/bin/python benchmarks/fixed_cost.py [--rounds 12] [--threads 1] [--torch-profile]

Section 1 (fixed cost): batch-1 forwards of all-MiniLM-L6-v2 at lengths 1..128 through
  * ``hf``      the HF ``BertModel`` call (mask construction, 3 Q/K/V GEMMs, pooler, module dispatch),
    then mean pooling + L2 normalisation,
  * ``lean``    ``LeanEncoder.forward_padded`` (models/lean.py): same weights, fused QKV, no pooler,
  * ``ragged``  ``RaggedEncoder.forward`` (models/ragged.py) on the token-id list.
  Each (implementation, length) runs once per round, rounds in a seeded shuffled order; the median
  over rounds is fitted by least squares to ``t = a + b * L``: ``a`` is the per-call cost, ``b`` the
  per-token cost. Also printed: aten operators per call (torch.profiler), which does not depend on noise.
Section 2 (attention): padding-free forwards of conv-embed batches (first rows of the trace, 32 per
  batch) with each CPU attention strategy of models/ragged.py, against the lean forward padded to the
  batch's longest input. Median over rounds, interleaved the same way.

Section 3 (weights): one token through a 384x1536 linear with its weights hot in cache vs cycling
  through 40 weight matrices (94 MB), and the lean 32x128 forward with the token-wise blocks chunked
  by 512 / 1024 rows or not at all.

Both clocks are recorded for every call: process CPU time (robust when other jobs share the cores)
and wall time. Compare only inside one run.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from collections.abc import Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import torch
from transformers import AutoModel

from batchpilot.models.encoder import default_model_path
from batchpilot.models.ragged import RaggedEncoder
from batchpilot.sim.traces import conv_embed

LENGTHS = (1, 4, 16, 32, 64, 128)


Jobs = dict[str, Callable[[], object]]


def timed_rounds(jobs: Jobs, rounds: int, seed: int) -> dict[str, dict[str, float]]:
    """Median CPU and wall seconds of each job over ``rounds`` shuffled passes (after one warm-up)."""
    for f in jobs.values():
        f()
    cpu: dict[str, list[float]] = {k: [] for k in jobs}
    wall: dict[str, list[float]] = {k: [] for k in jobs}
    rng = random.Random(seed)
    names = list(jobs)
    for _ in range(rounds):
        rng.shuffle(names)
        for k in names:
            c0, w0 = time.process_time(), time.perf_counter()
            jobs[k]()
            cpu[k].append(time.process_time() - c0)
            wall[k].append(time.perf_counter() - w0)
    return {k: {"cpu": statistics.median(cpu[k]), "wall": statistics.median(wall[k])} for k in jobs}


def ops_per_call(f: Callable[[], object]) -> int:
    from torch.profiler import profile

    with profile() as prof:
        f()
    return sum(1 for e in prof.events() if e.name.startswith("aten::"))


def hf_pooled(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        h = model(input_ids=ids, attention_mask=mask).last_hidden_state
        m = mask[..., None].to(h.dtype)
        return torch.nn.functional.normalize((h * m).sum(1) / m.sum(1), dim=-1)


def fixed_cost(model: torch.nn.Module, enc: RaggedEncoder, rounds: int, seed: int, show_profile: bool
               ) -> None:
    g = torch.Generator().manual_seed(seed)
    impls: dict[str, Callable[[torch.Tensor, torch.Tensor, list[list[int]]], object]] = {
        "hf": lambda i, m, lst: hf_pooled(model, i, m),
        "lean": lambda i, m, lst: enc.forward_padded(i, m),
        "ragged": lambda i, m, lst: enc.forward(lst),
    }
    jobs: dict[str, Callable[[], object]] = {}
    for n in LENGTHS:
        ids = torch.randint(1000, 20000, (1, n), generator=g)
        mask = torch.ones_like(ids)
        for name, f in impls.items():
            jobs[f"{name}@{n}"] = lambda f=f, ids=ids, mask=mask: f(ids, mask, ids.tolist())
    res = timed_rounds(jobs, rounds, seed)
    threads = torch.get_num_threads()
    print(f"== fixed cost: batch 1, median of {rounds} interleaved rounds, {threads} thread(s)")
    print(f"{'impl':8} " + " ".join(f"{'L=' + str(n):>8}" for n in LENGTHS) +
          f" {'per-call':>9} {'per-token':>9} {'aten ops':>8}   (ms, CPU clock | wall clock)")
    x = np.array(LENGTHS, dtype=float)
    ops = {name: ops_per_call(jobs[f"{name}@16"]) for name in impls}
    for clock in ("cpu", "wall"):
        fits = {}
        for name in impls:
            y = np.array([res[f"{name}@{n}"][clock] for n in LENGTHS]) * 1e3
            b, a = np.polyfit(x, y, 1)
            fits[name] = (a, b)
            print(f"{name:8} " + " ".join(f"{v:8.2f}" for v in y)
                  + f" {a:9.2f} {b:9.4f} {ops[name]:8d}   [{clock}]")
        a0, b0 = fits["hf"]
        print(f"   vs hf [{clock}]: " + ", ".join(
            f"{name} per-call {fits[name][0] / a0:.2f}x per-token {fits[name][1] / b0:.2f}x" for name in impls
            if name != "hf"))
    if show_profile:
        from torch.profiler import profile

        for name in ("hf", "lean"):
            with profile() as prof:
                for _ in range(10):
                    jobs[f"{name}@16"]()
            print(f"-- torch.profiler, {name}, 10 calls at L=16")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


def attention(model: torch.nn.Module, rounds: int, seed: int, batches: int) -> None:
    lengths = [int(v) for v in conv_embed().input_tokens[: 32 * batches]]
    g = torch.Generator().manual_seed(seed)
    data = [[torch.randint(1000, 20000, (n,), generator=g).tolist() for n in lengths[i * 32:(i + 1) * 32]]
            for i in range(batches)]
    variants = {"loop": ("loop", 0.0), "group exact": ("group", 0.0), "group slack .25": ("group", 0.25),
                "group slack 1": ("group", 1.0), "nested (jagged)": ("nested", 0.0)}
    encs = {k: RaggedEncoder.from_hf(model, attention=a, group_slack=s) for k, (a, s) in variants.items()}
    jobs: dict[str, Callable[[], object]] = {}
    for bi, batch in enumerate(data):
        for k, e in encs.items():
            jobs[f"{k}#{bi}"] = lambda e=e, batch=batch: e.forward(batch)
        width = max(len(s) for s in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, s in enumerate(batch):
            ids[i, : len(s)] = torch.tensor(s)
            mask[i, : len(s)] = 1
        jobs[f"padded to longest#{bi}"] = lambda ids=ids, mask=mask: encs["loop"].forward_padded(ids, mask)
    res = timed_rounds(jobs, rounds, seed)
    print(f"== attention: conv-embed batches of 32 ({batches} batches, {sum(lengths)} tokens), "
          f"median of {rounds} rounds; total ms and ratio to 'loop'")
    names = [*variants, "padded to longest"]
    for clock in ("cpu", "wall"):
        tot = {k: sum(res[f"{k}#{bi}"][clock] for bi in range(batches)) * 1e3 for k in names}
        print(f"  [{clock}] " + "  ".join(f"{k}: {v:.0f} ({v / tot['loop']:.2f})" for k, v in tot.items()))


def weights_and_chunks(enc: RaggedEncoder, rounds: int, seed: int) -> None:
    """Why the batch-1 floor is weight traffic, and what chunking the token-wise blocks buys."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, 384, generator=g)
    ws = [torch.randn(1536, 384, generator=g) for _ in range(40)]  # 94 MB: more than the cache
    b = torch.zeros(1536)
    f = torch.nn.functional.linear
    jobs: Jobs = {"hot": lambda: [f(x, ws[0], b) for _ in range(40)],
                  "cold": lambda: [f(x, w, b) for w in ws]}
    ids = torch.randint(1000, 20000, (32, 128), generator=g)
    for c in (512, 1024, 1 << 20):
        jobs[f"chunk {c}"] = lambda c=c: (setattr(enc, "chunk_tokens", c), enc.forward_padded(ids, None))
    res = timed_rounds(jobs, rounds, seed)
    enc.chunk_tokens = 1024
    print("== weights: one token through a 384x1536 linear, ms per call (CPU | wall): "
          + "  ".join(f"{k} {res[k]['cpu'] * 1e3 / 40:.3f} | {res[k]['wall'] * 1e3 / 40:.3f}"
                      for k in ("hot", "cold")))
    print("== chunking: lean forward 32x128, ms (CPU | wall): " + "  ".join(
        f"{k.replace(str(1 << 20), 'off')} {res[k]['cpu'] * 1e3:.0f} | {res[k]['wall'] * 1e3:.0f}"
        for k in jobs if k.startswith("chunk")))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--attention-batches", type=int, default=2)
    p.add_argument("--sections", default="fixed,attention,weights")
    p.add_argument("--torch-profile", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = AutoModel.from_pretrained(default_model_path()).eval()
    enc = RaggedEncoder.from_hf(model, pooling="mean", normalize=True)
    if "fixed" in args.sections:
        fixed_cost(model, enc, args.rounds, args.seed, args.torch_profile)
    if "weights" in args.sections:
        weights_and_chunks(enc, args.rounds, args.seed)
    if "attention" in args.sections:
        attention(model, max(3, args.rounds // 3), args.seed, args.attention_batches)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
