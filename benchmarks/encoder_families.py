"""Parity of each encoder family with sentence-transformers: the table in docs/models.md.

    .venv/bin/python benchmarks/encoder_families.py [--seed 0]

Builds each family's tiny seeded checkpoint (``batchpilot.models.seeded_families``) in a temporary
folder and embeds the accuracy guard's 20 probe texts (8 to 512 tokens, cut at the model's limit as
sentence-transformers cuts them; the checkpoint's default prompt applies) in one mixed-length batch, on
every path the family has (padded; padding-free where there is one), in float32 and bfloat16. Prints the
minimum cosine of each to ``SentenceTransformer(folder).encode`` in float32, each text alone.
"""

from __future__ import annotations

import argparse
import os
import platform
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import torch
from sentence_transformers import SentenceTransformer

from batchpilot.models.encoder import EncoderConfig, EncoderExecutor, make_batch
from batchpilot.models.precision import min_cosine, probe_texts
from batchpilot.models.seeded_families import FAMILIES, build_family


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, {platform.processor() or platform.machine()}, seed {args.seed}\n")
    print("| family | path | forward | fp32 min cosine | bf16 min cosine |")
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as root:
        for family in FAMILIES:
            folder = build_family(family, Path(root) / family, seed=args.seed)
            ex = {d: EncoderExecutor(EncoderConfig(model_path=folder, device="cpu", dtype=d))
                  for d in ("float32", "bfloat16")}  # type: ignore[arg-type]
            texts = probe_texts(ex["float32"].tokenizer)
            st = SentenceTransformer(folder, device="cpu")
            ref = np.stack([st.encode(t) for t in texts])
            paths = ["dynamic"] + (["none"] if ex["float32"].supports_padding_free() else [])
            for padding in paths:
                cos = {}
                for dtype, e in ex.items():
                    ids = e.tokenize(texts, truncate=True)
                    got = np.stack(e.run(e.prepare(make_batch(ids, padding, e.max_length))))
                    cos[dtype] = min_cosine(got, ref)
                path = "padding-free" if padding == "none" else "padded"
                print(f"| {family} | {path} | {ex['float32'].forward_impl} | {cos['float32']:.7f} | "
                      f"{cos['bfloat16']:.5f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
