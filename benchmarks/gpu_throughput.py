"""Throughput on a GPU (or, with ``--device cpu``, a dry run here): padding-free vs padded encoder, and
the LLM engine's output tokens per second. Seeded random models only (a GPU machine may have no
weights); torch, transformers, tokenizers and numpy only (no server stack).

    PYTHONPATH=src python benchmarks/gpu_throughput.py [--device cuda] [--dtype float16] [--texts 2048]

* Encoder: a MiniLM-shaped BERT (6 layers x 384, 12 heads) with seeded weights and a word-level
  vocabulary; ``--texts`` inputs with conv-embed's token lengths (median 128, 5% at 512), in batches of
  32 sorted by length, run padded (to each batch's longest) and padding-free (varlen attention), the
  two taking turns batch by batch; sequences per second and the useful share of the padded tokens.
* LLM: the default tiny Llama (6 x 512, seeded) in ``LLMEngine`` on the device, ``--llm-requests``
  conv-llm requests submitted at once; output tokens per second.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from batchpilot.models.seeded import build_word_encoder
from batchpilot.sim.traces import load_workload

WORDS = [f"w{i}" for i in range(3000)]


def encoder_throughput(device: str, dtype: str, n_texts: int) -> None:
    from batchpilot.models.encoder import EncoderConfig, EncoderExecutor, make_batch

    path = build_word_encoder(Path(tempfile.mkdtemp()) / "bert", words=len(WORDS), hidden=384, layers=6,
                              heads=12, max_positions=512, normalize=False)
    ex = EncoderExecutor(EncoderConfig(model_path=path, device=device, dtype=dtype))  # type: ignore[arg-type]
    lengths = sorted(min(512, max(3, int(x))) for x in load_workload("conv-embed").input_tokens[:n_texts])
    rng = np.random.default_rng(0)
    ids = [[2, *rng.integers(5, len(WORDS) + 5, n - 2).tolist(), 3] for n in lengths]
    batches = [ids[i:i + 32] for i in range(0, len(ids), 32)]
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    for padding in ("dynamic", "none"):  # warm-up: kernels for these shapes
        ex.run(ex.prepare(make_batch(batches[len(batches) // 2], padding, ex.max_length)))
    spent = {"dynamic": 0.0, "none": 0.0}
    for b in batches:
        for padding in spent:
            sync()
            t0 = time.perf_counter()
            ex.run(ex.prepare(make_batch(b, padding, ex.max_length)))
            sync()
            spent[padding] += time.perf_counter() - t0
    useful = sum(lengths) / sum(len(b) * max(len(x) for x in b) for b in batches)
    print(f"encoder ({device}, {dtype}, {ex.forward_impl}): {len(ids)} conv-embed-length inputs in batches "
          f"of 32 sorted by length; padded tokens {useful:.0%} useful")
    for padding, s in spent.items():
        print(f"  {'padded' if padding == 'dynamic' else 'padding-free':>12}: {len(ids) / s:8.0f} seq/s")
    print(f"  padding-free / padded: {spent['dynamic'] / spent['none']:.2f}x")


def llm_throughput(device: str, dtype: str, n_requests: int) -> None:
    if n_requests <= 0:
        return
    from batchpilot.runtime.llm.build import build_llm_engine

    engine = build_llm_engine(None, device=device, dtype=dtype, max_num_seqs=64, max_num_batched_tokens=2048,
                              num_kv_blocks=4096, block_size=16, max_model_len=2048)
    from batchpilot.core.llm.sequence import SamplingParams

    wl = load_workload("conv-llm", count=n_requests)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(7, 4096, int(n)).tolist() for n in wl.input_tokens]
    outs = [int(n) for n in wl.output_tokens]

    async def one(p: list[int], n: int) -> int:
        got = 0
        async for item in engine.generate(p, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)):
            got += len(item.token_ids)
        return got

    async def run(ps: list[list[int]], ns: list[int]) -> tuple[int, float]:
        t0 = time.perf_counter()
        got = await asyncio.gather(*(one(p, n) for p, n in zip(ps, ns, strict=True)))
        return sum(got), time.perf_counter() - t0

    try:
        asyncio.run(run(prompts[:4], [4] * 4))
        tokens, seconds = asyncio.run(run(prompts, outs))
    finally:
        engine.shutdown()
    print(f"llm engine ({device}, {dtype}): {n_requests} conv-llm requests at once, {tokens} output tokens "
          f"in {seconds:.1f} s = {tokens / seconds:.0f} tok/s")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--texts", type=int, default=2048)
    ap.add_argument("--llm-requests", type=int, default=64)
    args = ap.parse_args()
    name = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    print(f"torch {torch.__version__}; device {name}")
    encoder_throughput(args.device, args.dtype, args.texts)
    llm_throughput(args.device, args.dtype, args.llm_requests)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
