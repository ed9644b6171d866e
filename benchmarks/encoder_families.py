"""Each encoder family: parity with sentence-transformers, and throughput against a one-at-a-time server.

    .venv/bin/python benchmarks/encoder_families.py [--part parity|throughput|all] [--seed 0]

Builds each family's tiny seeded checkpoint (``batchpilot.models.seeded_families``) in a temporary
folder and embeds the accuracy guard's 20 probe texts (8 to 512 tokens, cut at the model's limit as
sentence-transformers cuts them; the checkpoint's default prompt applies) in one mixed-length batch, on
every path the family has (padded; padding-free where there is one), in float32 and bfloat16. Prints the
minimum cosine of each to ``SentenceTransformer(folder).encode`` in float32, each text alone.

``throughput``: each family's folder served by ``batchpilot serve --model FOLDER`` (float32, its default
batching, ``--threads`` torch threads) and by the baseline, sentence-transformers inside an async FastAPI
route that embeds one request at a time (``naive_server``: the same folder, float32, the same threads);
conv-embed rows' texts (``bench.loadgen.build_plan``) sent by ``--clients`` concurrent clients for
``--seconds`` to each, the two taking turns for ``--rounds`` rounds (the order flipped each round).
Prints answered requests per second, median (min-max), and the ratio per round.
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
from pydantic import BaseModel
from sentence_transformers import SentenceTransformer

from batchpilot.models.encoder import EncoderConfig, EncoderExecutor, make_batch
from batchpilot.models.precision import min_cosine, probe_texts
from batchpilot.models.seeded_families import FAMILIES, build_family


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=("parity", "throughput", "all"), default="parity")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=15.0)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--naive-server", metavar="FOLDER", help=argparse.SUPPRESS)  # the baseline's process
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.naive_server:
        naive_server(args.naive_server, args.port, args.threads)
        return 0
    if args.part in ("parity", "all"):
        parity(args)
    if args.part in ("throughput", "all"):
        throughput(args)
    return 0


def parity(args: argparse.Namespace) -> None:
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


# -- throughput ------------------------------------------------------------------------------------
class Body(BaseModel):
    input: str | list[str]
    model: str | None = None


def naive_server(folder: str, port: int, threads: int) -> None:
    """The baseline: sentence-transformers in an async FastAPI route, one request at a time."""
    import uvicorn
    from fastapi import FastAPI

    torch.set_num_threads(threads)
    model = SentenceTransformer(folder, device="cpu")
    app = FastAPI()

    @app.post("/v1/embeddings")
    async def embed(body: Body) -> dict[str, object]:
        texts = [body.input] if isinstance(body.input, str) else body.input
        vecs = model.encode(texts)
        data = [{"object": "embedding", "embedding": v.tolist(), "index": i} for i, v in enumerate(vecs)]
        return {"object": "list", "model": "naive", "data": data}

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


async def closed_loop(url: str, bodies: list[dict[str, object]], clients: int, seconds: float) -> float:
    """Answered requests per second from ``clients`` clients each sending the next body as soon as its
    last one is answered, for ``seconds``."""
    import asyncio

    import httpx

    done, t_end = 0, 0.0
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        async def client(k: int) -> None:
            nonlocal done
            i = k
            while asyncio.get_running_loop().time() < t_end:
                r = await http.post("/v1/embeddings", json=bodies[i % len(bodies)])
                done += r.status_code == 200
                i += clients

        t0 = asyncio.get_running_loop().time()
        t_end = t0 + seconds
        await asyncio.gather(*(client(k) for k in range(clients)))
        return done / (asyncio.get_running_loop().time() - t0)


def throughput(args: argparse.Namespace) -> None:
    import asyncio
    import subprocess
    import sys

    from batchpilot.bench.loadgen import build_plan
    from batchpilot.bench.serverproc import free_port, serve, wait_ready
    from batchpilot.sim.traces import load_workload

    print(f"conv-embed, {args.clients} clients for {args.seconds:g} s each, {args.threads} torch threads; "
          "requests/s answered\n")
    print("| family | batchpilot serve | one-at-a-time sentence-transformers | ratio per round |")
    print("|---|---|---|---|")
    with tempfile.TemporaryDirectory() as root:
        for family in FAMILIES:
            folder = build_family(family, Path(root) / family, seed=args.seed)
            tok = EncoderExecutor(EncoderConfig(model_path=folder, device="cpu")).tokenizer
            bodies = [r.body for r in build_plan(load_workload("conv-embed", count=2000), "embeddings",
                                                 tokenizer=tok)]
            rates: dict[str, list[float]] = {"batchpilot": [], "naive": []}
            for r in range(args.rounds):
                for name in ("batchpilot", "naive") if r % 2 == 0 else ("naive", "batchpilot"):
                    if name == "batchpilot":
                        with serve(["--model", folder, "--no-startup-profile", "--dtype", "float32",
                                    "--threads", str(args.threads)]) as url:
                            rate = asyncio.run(closed_loop(url, bodies, args.clients, args.seconds))
                        rates[name].append(rate)
                        continue
                    port = free_port()
                    proc = subprocess.Popen([sys.executable, __file__, "--naive-server", folder, "--port",
                                             str(port), "--threads", str(args.threads)])
                    try:
                        url = f"http://127.0.0.1:{port}"
                        wait_ready(url, 120.0, proc)
                        rate = asyncio.run(closed_loop(url, bodies, args.clients, args.seconds))
                        rates[name].append(rate)
                    finally:
                        proc.terminate()
                        proc.wait(timeout=30)
            cell = {k: f"{np.median(v):.0f} ({min(v):.0f}-{max(v):.0f})" for k, v in rates.items()}
            pairs = zip(rates["batchpilot"], rates["naive"], strict=True)
            ratios = ", ".join(f"{a / b:.2f}" for a, b in pairs)
            print(f"| {family} | {cell['batchpilot']} | {cell['naive']} | {ratios} |", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
