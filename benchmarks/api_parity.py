"""Parity of the encoder API over HTTP against references computed here, on one real server.

    .venv/bin/python benchmarks/api_parity.py [--texts 64] [--documents 50]

``batchpilot serve --dtype float32`` with three models: the embedded all-MiniLM-L6-v2
(``embedder``), a MiniLM-sized seeded cross-encoder (``reranker``) and a seeded 3-label classifier
(``classifier``), both built offline by ``batchpilot.models.seeded``. The inputs are real text of
conv-embed lengths (mixed, up to the 512-token limit). The references:

* embeddings at each ``dimensions``: sentence-transformers fp32 ``encode`` of the full vector, cut to
  the first ``dimensions`` coordinates and re-normalised with NumPy;
* each ``embedding_type``: that reference quantised with NumPy here (``rint(clip(x,-1,1)*127)``,
  ``rint((clip(x,-1,1)+1)*127.5)``, ``packbits(x > 0)`` and ``- 128``), counted in quantisation steps;
* rerank and score: sentence-transformers ``CrossEncoder.predict`` on the same pairs;
* classify: HF ``AutoModelForSequenceClassification`` logits, softmax, one text at a time.
"""

from __future__ import annotations

import argparse
import base64
import os
import sys
import tempfile
from pathlib import Path

import httpx
import numpy as np
import torch
from light_load import subprocess_server

from batchpilot.bench.loadgen import load_tokenizer
from batchpilot.bench.serverproc import free_port
from batchpilot.models.encoder import default_model_path
from batchpilot.models.seeded import build_classifier, build_cross_encoder
from batchpilot.models.texts import texts_for_lengths
from batchpilot.sim.traces import load_workload

DIMS = (384, 256, 128, 64, 32)
TYPES = {"int8": np.int8, "uint8": np.uint8, "binary": np.int8, "ubinary": np.uint8}


def quantise(x: np.ndarray, etype: str) -> np.ndarray:
    if etype == "int8":
        return np.rint(np.clip(x, -1, 1) * 127).astype(np.int64)
    if etype == "uint8":
        return np.rint((np.clip(x, -1, 1) + 1) * 127.5).astype(np.int64)
    bits = np.packbits(x > 0, axis=-1).astype(np.int64)
    return bits - 128 if etype == "binary" else bits


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--texts", type=int, default=64)
    ap.add_argument("--documents", type=int, default=50)
    args = ap.parse_args()
    from sentence_transformers import CrossEncoder, SentenceTransformer
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    cache = Path(os.environ.get("TMPDIR", tempfile.gettempdir())) / "batchpilot-bench-models"
    reranker = build_cross_encoder(cache / "reranker-minilm-l6", seed=0)
    classifier = build_classifier(cache / "classifier-minilm-l6", seed=1)
    lengths = [max(3, int(x) - 2) for x in load_workload("conv-embed").input_tokens[: args.texts]]
    texts = texts_for_lengths(load_tokenizer(), lengths, seed=0)
    print(f"{len(texts)} texts of conv-embed lengths (tokens: min {min(lengths) + 2}, median "
          f"{int(np.median(lengths)) + 2}, max {max(lengths) + 2})")
    port = free_port()
    cmd = [sys.executable, "-m", "batchpilot.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--model", default_model_path(), "--model-name", "embedder", "--model", reranker,
           "--model-name", "reranker", "--model", classifier, "--model-name", "classifier",
           "--no-startup-profile", "--dtype", "float32"]
    with subprocess_server(cmd, port, "api-parity") as url, httpx.Client(base_url=url, timeout=300) as c:
        st = SentenceTransformer(default_model_path(), device="cpu")
        st.max_seq_length = 512  # the model's limit, what the server runs (its folder says 256)
        full = np.asarray(st.encode(texts, normalize_embeddings=True), dtype=np.float32)
        print("\nembeddings at each `dimensions` vs sentence-transformers fp32, cut and re-normalised:")
        print("| dimensions | max abs diff | min cosine |")
        print("|---|---|---|")
        for d in DIMS:
            got = np.array([x["embedding"] for x in c.post("/v1/embeddings", json={
                "model": "embedder", "input": texts, "dimensions": d}).json()["data"]], dtype=np.float32)
            want = full[:, :d] / np.linalg.norm(full[:, :d], axis=1, keepdims=True)
            cos = (got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
            print(f"| {d} | {np.abs(got - want).max():.2e} | {cos.min():.7f} |")

        print("\neach `embedding_type` (384 dimensions) vs the NumPy quantisation of the reference; "
              "JSON and base64 bodies compared too:")
        print("| embedding_type | values per vector | values equal | max diff (steps) | base64 = JSON |")
        print("|---|---|---|---|---|")
        for etype, dtype in TYPES.items():
            js = c.post("/v1/embeddings", json={"model": "embedder", "input": texts,
                                                "embedding_type": etype}).json()["data"]
            b64 = c.post("/v1/embeddings", json={"model": "embedder", "input": texts, "embedding_type": etype,
                                                 "encoding_format": "base64"}).json()["data"]
            got = np.array([x["embedding"] for x in js], dtype=np.int64)
            dec = np.stack([np.frombuffer(base64.b64decode(x["embedding"]), dtype=dtype) for x in b64])
            want = quantise(full, etype)
            diff = np.abs(got - want)
            if etype in ("binary", "ubinary"):  # count bits, not bytes
                diff = np.unpackbits((got ^ want).astype(np.uint8)[..., None], axis=-1).sum(-1)
            print(f"| {etype} | {got.shape[1]} | {(diff == 0).mean() * 100:.2f}% | {diff.max()}"
                  f"{' bit' if etype.endswith('binary') else ''} | {np.array_equal(got, dec)} |")

        ce = CrossEncoder(reranker, device="cpu")
        query = texts[0][:60]
        docs = texts[: args.documents]
        res = c.post("/v1/rerank", json={"model": "reranker", "query": query, "documents": docs,
                                         "truncate": True}).json()["results"]
        got = np.zeros(len(docs))
        for x in res:
            got[x["index"]] = x["relevance_score"]
        want = ce.predict([(query, d) for d in docs])
        order_ok = [x["index"] for x in res] == list(np.argsort(-got, kind="stable"))
        half = args.documents // 2
        pairs = list(zip(texts[:half], texts[half : 2 * half], strict=True))
        sc = c.post("/v1/score", json={"model": "reranker", "text_1": [p[0] for p in pairs],
                                       "text_2": [p[1] for p in pairs], "truncate": True}).json()["data"]
        sc_want = ce.predict(pairs)
        tok = AutoTokenizer.from_pretrained(classifier)
        hf = AutoModelForSequenceClassification.from_pretrained(classifier).eval()
        cl = c.post("/v1/classify", json={"model": "classifier", "input": texts}).json()["data"]
        with torch.inference_mode():
            cl_want = np.stack([torch.softmax(hf(**tok(t, return_tensors="pt")).logits[0], -1).numpy()
                                for t in texts])
        cl_got = np.array([x["probs"] for x in cl])
        labels_ok = all(x["label"] == hf.config.id2label[int(np.argmax(w))]
                        for x, w in zip(cl, cl_want, strict=True))
        print("\nrerank, score and classify vs the references:")
        print("| route | inputs | max abs diff | order / labels |")
        print("|---|---|---|---|")
        print(f"| /v1/rerank vs CrossEncoder.predict | 1 query x {len(docs)} | "
              f"{np.abs(got - want).max():.2e} | sorted by score: {order_ok} |")
        print(f"| /v1/score vs CrossEncoder.predict | {len(pairs)} pairs | "
              f"{np.abs(np.array([x['score'] for x in sc]) - sc_want).max():.2e} | input order |")
        print(f"| /v1/classify vs HF softmax | {len(texts)} texts | {np.abs(cl_got - cl_want).max():.2e} | "
              f"argmax labels equal: {labels_ok} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
