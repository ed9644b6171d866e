"""Precision on this machine: parity with sentence-transformers fp32 per precision and padding mode,
and per-sequence cost curves per precision (a plot), in-process, one run.

    .venv/bin/python benchmarks/precision.py [--texts 256] [--batch-sizes 1 4 16 64]
                                             [--lengths 16 64 128 256 512]
                                             [--plot docs/img/precision_cost.png]

Variants: torch at float32, every precision ``models.precision.candidates`` finds on this CPU
(bfloat16 with AMX or AVX512-BF16) and int8 (dynamic int8 linear layers); and, where onnxruntime is
installed, the ONNX Runtime backend at float32 and int8 (``models/onnx_encoder.py``, its export cached
in a temporary folder). The auto choice the server would make is run first (``choose_precision(...,
"auto")``, its measurements printed as the log prints them).

1. Parity: ``--texts`` real texts of conv-embed lengths, embedded in batches of 16 with each padding
   mode the precision runs (``max``: padded to the model's 512; ``dynamic``: to the batch's longest;
   ``none``: padding-free), against sentence-transformers fp32 ``encode`` (normalised): the minimum
   and mean cosine. The accuracy guard's threshold is 0.999.
2. Cost: batch x length grid (uniform lengths, the median of 3 runs after a warm-up, ``prepare`` +
   ``run``), milliseconds per sequence; the precisions take turns shape by shape, so a drift of the
   machine's speed hits them alike.
"""

from __future__ import annotations

import argparse
import random
import tempfile
from pathlib import Path

import numpy as np
import torch

from batchpilot.bench.loadgen import load_tokenizer
from batchpilot.models.encoder import EncoderConfig, EncoderExecutor, default_model_path, make_batch
from batchpilot.models.precision import candidates, choose_precision, min_cosine
from batchpilot.models.profiler import measure
from batchpilot.models.texts import texts_for_lengths
from batchpilot.sim.traces import load_workload

BASE = "torch/float32"


def load(dtype: str) -> EncoderExecutor:
    return EncoderExecutor(EncoderConfig(device="cpu", dtype=dtype))  # type: ignore[arg-type]


def variants() -> dict[str, EncoderExecutor]:
    out = {f"torch/{d}": load(d) for d in [*candidates(torch.device("cpu")), "int8"]}
    try:
        from batchpilot.models.onnx_encoder import OnnxEncoderExecutor
    except ImportError:
        return out
    cache = tempfile.mkdtemp()
    for d in ("float32", "int8"):
        out[f"onnx/{d}"] = OnnxEncoderExecutor(EncoderConfig(device="cpu", dtype=d), cache)  # type: ignore[arg-type]
    return out


def embed(ex: EncoderExecutor, texts: list[str], padding: str, batch: int = 16) -> np.ndarray:
    ids = ex.tokenize(texts, truncate=True)
    out = [np.stack(ex.run(ex.prepare(make_batch(ids[i:i + batch], padding, ex.max_length))))
           for i in range(0, len(ids), batch)]
    return np.concatenate(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--texts", type=int, default=256)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--lengths", type=int, nargs="+", default=[16, 64, 128, 256, 512])
    ap.add_argument("--plot", default="docs/img/precision_cost.png")
    args = ap.parse_args()
    from sentence_transformers import SentenceTransformer

    _, report = choose_precision(load, "auto", torch.device("cpu"))
    print(f"auto: {report.describe()}")
    execs = variants()
    lengths = [max(3, int(x) - 2) for x in load_workload("conv-embed").input_tokens[: args.texts]]
    texts = texts_for_lengths(load_tokenizer(), lengths, seed=3)
    st = SentenceTransformer(default_model_path(), device="cpu")
    st.max_seq_length = 512  # the model's limit, what the server runs (its folder says 256)
    ref = np.asarray(st.encode(texts, normalize_embeddings=True), dtype=np.float32)
    print(f"\nparity vs sentence-transformers fp32: {len(texts)} texts of conv-embed lengths, batches of 16")
    print("| variant | forward | padding | min cosine | mean cosine |")
    print("|---|---|---|---|---|")
    for d, ex in execs.items():
        for padding in ("max", "dynamic", "none"):
            if padding == "none" and not ex.supports_padding_free():
                continue
            got = embed(ex, texts, padding)
            cos = (got * ref).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(ref, axis=1)
            print(f"| {d} | {ex.forward_impl} | {padding} | {min_cosine(got, ref):.6f} | {cos.mean():.6f} |")

    rng = random.Random(0)
    cost: dict[str, dict[tuple[int, int], float]] = {d: {} for d in execs}
    for n in args.batch_sizes:
        for length in args.lengths:
            for d, ex in execs.items():
                cost[d][n, length] = measure(ex, [length] * n, "dynamic", 3, rng, memory=False).latency_s / n
    print("\nms per sequence (batch x tokens, padded, uniform lengths; median of 3):")
    print("| batch x tokens | " + " | ".join(execs) + " | " + " | ".join(
        f"fp32/{d}" for d in execs if d != BASE) + " |")
    print("|---|" + "---|" * (2 * len(execs) - 1))
    for n in args.batch_sizes:
        for length in args.lengths:
            row = [f"{cost[d][n, length] * 1e3:.2f}" for d in execs]
            ratios = [f"{cost[BASE][n, length] / cost[d][n, length]:.2f}x" for d in execs if d != BASE]
            print(f"| {n} x {length} | " + " | ".join(row + ratios) + " |")
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, len(args.lengths), figsize=(3.2 * len(args.lengths), 3.2), sharey=False)
        for ax, length in zip(np.atleast_1d(axes), args.lengths, strict=True):
            for d in execs:
                ax.plot(args.batch_sizes, [cost[d][n, length] * 1e3 for n in args.batch_sizes], "o-", label=d)
            ax.set_xscale("log", base=2)
            ax.set_title(f"{length} tokens")
            ax.set_xlabel("batch size")
        np.atleast_1d(axes)[0].set_ylabel("ms per sequence")
        np.atleast_1d(axes)[0].legend()
        fig.suptitle("all-MiniLM-L6-v2, per-sequence cost by backend/precision (benchmarks/precision.py)")
        fig.tight_layout()
        Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(args.plot, dpi=110)
        print(f"\nwrote {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
