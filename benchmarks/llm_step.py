"""Where a decode step of the LLM runner spends its time, by part, at each precision.

The default tiny Llama (6 x 512, GQA 8:4, vocab 4096, seeded random weights), one runner per precision
(weights/KV cache: float32/float32, float32/float16, bfloat16/bfloat16), its dense matrices packed where
that measured faster (``models/llm/dense.packing_pays``, as ``serve`` does). Synthetic
decode steps (``runner.step_plan``): 1, 8 and 64 sequences at a context of 200 tokens.

Per step, the calling thread's CPU time (``time.thread_time``: what another process on the same cores
does not add to; one torch thread) split by wrapping the runner's parts: ``dense`` (every matmul,
the LM head's included), ``attention`` (gathers and SDPA), ``norm`` (RMSNorms), ``layout`` (the step's
index tensors), ``logits`` (final norm, head, cast; its matmul also counted in ``dense``) and ``other``
(the rest: RoPE, cache writes, residual adds, the MLP's activation, Python), each exclusive of the
others. Then ``dense alone``: the same matmuls back to back, without the ops between them (the
difference is what the ops after a matmul pay for the caches it emptied, and the other way round).
The median of ``--steps`` steps after a warm-up, ``--rounds`` rounds with the precisions interleaved.

Then the dense matrices alone by layout (``dense.py``), per weight precision, at 1, 2, 4, 16 and 64
rows: ``plain`` (``x @ w.T`` on the stored ``[out, in]`` weight), ``packed`` (oneDNN's copy laid out
for any row count: what the runner multiplies by when packing pays) and ``packed for one row`` (the
same reorder given a batch-size hint of one). Milliseconds for all 25 matrices (the LM head's
included), the median of ``--steps`` passes, the layouts interleaved over ``--rounds`` rounds.

    .venv/bin/python benchmarks/llm_step.py [--rounds 3] [--steps 40]
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from batchpilot.models.llm import dense as dense_mod
from batchpilot.models.llm.dense import packing_pays
from batchpilot.models.llm.precision import cast_weights
from batchpilot.models.llm.runner import LLMModelRunner, keep_freed_memory, step_plan
from batchpilot.models.llm.weights import LlamaWeights, load_hf_llama
from batchpilot.models.seeded import LLMModelConfig

PRECISIONS = {"f32/f32": (torch.float32, torch.float32), "f32/f16": (torch.float32, torch.float16),
              "bf16/bf16": (torch.bfloat16, torch.bfloat16)}
BATCHES = (1, 8, 64)
CONTEXT = 200
PARTS = ("dense", "attention", "norm", "layout", "logits")


def build(weights: LlamaWeights, name: str) -> LLMModelRunner:
    dtype, kv = PRECISIONS[name]
    runner = LLMModelRunner(cast_weights(weights, dtype), 2048, 16, dtype=dtype, kv_dtype=kv)
    runner.pack(packing_pays(runner.w.dense_matrices(), runner.device, dtype).packed)
    return runner


def split(runner: LLMModelRunner, batch: int, steps: int) -> dict[str, float]:
    """Milliseconds of CPU per step: the whole step and each part of it, exclusive (a part called inside
    another, the head's matmul inside ``logits``, counts for itself only)."""
    plan = step_plan(runner, [], [CONTEXT] * batch)
    spent: collections.Counter[str] = collections.Counter()
    active: list[str] = []

    def timed(key: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any) -> Any:
            active.append(key)
            t0 = time.thread_time()
            try:
                return fn(*args)
            finally:
                took = time.thread_time() - t0
                active.pop()
                spent[key] += took
                if active:
                    spent[active[-1]] -= took
        return call

    plain_call = dense_mod.Dense.__call__
    saved = {name: getattr(runner, name) for name in ("_layout", "_attention", "_logits", "norm")}
    for name, key in (("_layout", "layout"), ("_attention", "attention"), ("_logits", "logits"),
                      ("norm", "norm")):
        setattr(runner, name, timed(key, saved[name]))
    dense_mod.Dense.__call__ = timed("dense", plain_call)  # type: ignore[method-assign]
    try:
        totals = []
        with torch.inference_mode():
            for _ in range(5):
                runner.forward(plan.chunks).argmax(-1).tolist()
            spent.clear()
            for _ in range(steps):
                t0 = time.thread_time()
                runner.forward(plan.chunks).argmax(-1).tolist()
                totals.append(time.thread_time() - t0)
    finally:
        dense_mod.Dense.__call__ = plain_call  # type: ignore[method-assign]
        for name, fn in saved.items():
            setattr(runner, name, fn)
    out = {k: spent[k] / steps * 1e3 for k in PARTS}
    out["other"] = sum(totals) / steps * 1e3 - sum(out.values())
    out["step"] = statistics.median(totals) * 1e3
    out["dense alone"] = dense_alone(runner, batch, steps)
    return out


def dense_alone(runner: LLMModelRunner, batch: int, steps: int) -> float:
    matrices = [d for layer in runner.dense for d in layer.all()] + [runner.head]
    xs = [torch.randn(batch, d.shape[1]).to(runner.dtype) for d in matrices]
    with torch.inference_mode():
        for d, x in zip(matrices, xs, strict=True):
            d(x)
        t0 = time.thread_time()
        for _ in range(steps):
            for d, x in zip(matrices, xs, strict=True):
                d(x)
    return (time.thread_time() - t0) / steps * 1e3


LAYOUT_ROWS = (1, 2, 4, 16, 64)


def _plain(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x @ w.T


def _packed(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")


def layouts(weights: LlamaWeights, rounds: int, steps: int) -> None:
    """The layouts table of the module docstring."""
    for name, dtype in (("f32", torch.float32), ("bf16", torch.bfloat16)):
        mats = [w.to(dtype) for w in weights.dense_matrices()]
        held = {"plain": mats, "packed": [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in mats],
                "packed for one row": [torch.ops.mkldnn._reorder_linear_weight(w, 1) for w in mats]}
        times: dict[tuple[str, int], list[float]] = collections.defaultdict(list)
        with torch.inference_mode():
            for r in range(rounds):
                for kind in (list(held) if r % 2 == 0 else list(reversed(held))):
                    fn, ws = (_plain if kind == "plain" else _packed), held[kind]
                    for rows in LAYOUT_ROWS:
                        xs = [torch.randn(rows, int(w.shape[1])).to(dtype) for w in mats]
                        for x, w in zip(xs, ws, strict=True):  # warm-up, and this copy into the caches
                            fn(x, w)
                        for _ in range(steps):
                            t0 = time.thread_time()
                            for x, w in zip(xs, ws, strict=True):
                                fn(x, w)
                            times[(kind, rows)].append((time.thread_time() - t0) * 1e3)
        print(f"\nms of CPU for the {len(mats)} dense matrices, {name} weights, by layout (median)")
        print(f"{'layout':20s} " + " ".join(f"{f'{r} rows':>9s}" for r in LAYOUT_ROWS))
        for kind in held:
            cells = (f"{statistics.median(times[(kind, r)]):9.2f}" for r in LAYOUT_ROWS)
            print(f"{kind:20s} " + " ".join(cells))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=40)
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(1)
    keep_freed_memory()
    weights = LlamaWeights.from_hf(load_hf_llama(None, LLMModelConfig()))
    runners = {name: build(weights, name) for name in PRECISIONS}
    rows: dict[tuple[str, int], list[dict[str, float]]] = collections.defaultdict(list)
    for r in range(args.rounds):
        names = list(PRECISIONS) if r % 2 == 0 else list(reversed(PRECISIONS))
        for name in names:
            for batch in BATCHES:
                rows[(name, batch)].append(split(runners[name], batch, args.steps))
        print(f"round {r} done, load average {os.getloadavg()[0]:.2f}", flush=True)
    cols = ("step", "dense", "attention", "norm", "layout", "logits", "other", "dense alone")
    print(f"\nms of CPU per decode step (context {CONTEXT}, 1 thread), median of {args.rounds} rounds")
    print(f"{'precision':10s} {'seqs':>4s} " + " ".join(f"{c:>11s}" for c in cols))
    for (name, batch), runs in rows.items():
        med = {c: statistics.median(run[c] for run in runs) for c in cols}
        print(f"{name:10s} {batch:4d} " + " ".join(f"{med[c]:11.2f}" for c in cols))
    for name, runner in runners.items():
        print(f"{name}: dense matrices {'packed' if runner.packed else 'plain'}")
    layouts(weights, args.rounds, args.steps)


if __name__ == "__main__":
    main()
