"""Rerank over HTTP: batchpilot serving a cross-encoder vs sentence-transformers' CrossEncoder called per
request in a FastAPI route, the same model and the same requests, in one run.

    .venv/bin/python benchmarks/rerank.py [--documents 50] [--closed-seconds 20] [--concurrency 4]
                                          [--fractions 0.5 0.8] [--seconds 30] [--rounds 2]

The model: a MiniLM-sized cross-encoder (6 layers x 384, the shape of ms-marco-MiniLM-L-6-v2) built
offline with seeded random weights (``python -m batchpilot.models.seeded cross-encoder``); its scores
mean nothing, its cost is a real reranker's. A request is one query (12 tokens) and ``--documents``
documents whose lengths are consecutive rows of conv-embed (real text, median 128 tokens, 5% at the
512 limit), with ``truncate: true`` (the pair is cut to 512 tokens, as CrossEncoder does).

The baseline is what a team writes first: ``CrossEncoder(path).predict(pairs)`` inside an ``async``
FastAPI route (one request at a time; predict batches the request's own pairs 32 at a time, padded
to the longest of each). batchpilot runs ``batchpilot serve --model PATH`` with its defaults (start-up
profile, default policy): the pairs of one request are admitted together and batched with those of
other requests by length. Both are subprocesses on 127.0.0.1, fp32, all cores; the load generator is
this process (``bench.loadgen``), on the same cores.

1. Parity: the first request's scores from both servers (max |difference|).
2. Throughput, closed loop: ``--concurrency`` clients each sending the next request when the last
   returns, ``--closed-seconds`` per server and round, the servers taking turns.
3. Latency, open loop: Poisson arrivals at ``--fractions`` x the baseline's throughput, the same
   arrivals for both servers, interleaved, ``--rounds`` times; P50/P99 pool a server's rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from light_load import subprocess_server
from pydantic import BaseModel

from batchpilot.bench.loadgen import LoadGenConfig, PlannedRequest, load_tokenizer, replay
from batchpilot.bench.records import summarize
from batchpilot.bench.scrape import parse_metrics
from batchpilot.bench.serverproc import free_port
from batchpilot.models.texts import texts_for_lengths
from batchpilot.sim.traces import load_workload

SLA_S = 2.0
QUERY_TOKENS = 12


class RerankBody(BaseModel):
    query: str
    documents: list[str]
    model: str | None = None
    truncate: bool = True


def naive_server(port: int, path: str) -> None:
    """The baseline: CrossEncoder.predict inside an async FastAPI route, one request at a time."""
    import uvicorn
    from fastapi import FastAPI
    from sentence_transformers import CrossEncoder

    model = CrossEncoder(path, device="cpu")
    app = FastAPI()

    @app.post("/v1/rerank")
    async def rerank(body: RerankBody) -> dict[str, Any]:
        scores = model.predict([(body.query, d) for d in body.documents])
        order = np.argsort(-scores)
        results = [{"index": int(i), "relevance_score": float(scores[i])} for i in order]
        return {"id": "rerank", "model": "naive", "usage": {"total_tokens": 0}, "results": results}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": "naive", "object": "model", "task": "score"}]}

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


def make_bodies(n_requests: int, n_docs: int, seed: int = 0) -> list[dict[str, Any]]:
    tok = load_tokenizer()
    lengths = load_workload("conv-embed").input_tokens.tolist()[: n_requests * n_docs]
    docs = texts_for_lengths(tok, [max(3, int(x) - 2) for x in lengths], seed=seed)  # less [CLS]/[SEP]
    queries = texts_for_lengths(tok, [QUERY_TOKENS] * n_requests, seed=seed + 1)
    return [{"query": queries[i], "documents": docs[i * n_docs:(i + 1) * n_docs], "truncate": True}
            for i in range(n_requests)]


async def closed_loop(url: str, bodies: list[dict[str, Any]], concurrency: int, seconds: float) -> float:
    """Requests per second with ``concurrency`` clients sending back to back for ``seconds``."""
    done = 0
    stop_at = time.perf_counter() + seconds

    async def client(k: int) -> None:
        nonlocal done
        async with httpx.AsyncClient(base_url=url, timeout=120) as c:
            i = k
            while time.perf_counter() < stop_at:
                r = await c.post("/v1/rerank", json=bodies[i % len(bodies)])
                r.raise_for_status()
                done += 1
                i += concurrency

    t0 = time.perf_counter()
    await asyncio.gather(*(client(k) for k in range(concurrency)))
    return done / (time.perf_counter() - t0)


def open_loop(url: str, bodies: list[dict[str, Any]], rate: float, seconds: float, seed: int) -> list[Any]:
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1.0 / rate, size=int(rate * seconds * 1.5) + 10)
    times = np.cumsum(gaps)
    times = times[times < seconds]
    plan = [PlannedRequest(i, float(t), 0, 0, dict(bodies[i % len(bodies)])) for i, t in enumerate(times)]
    cfg = LoadGenConfig(url, endpoint="rerank", progress=False, scrape_interval_s=0, timeout_s=120)
    return replay(plan, cfg).records


def scores_of(url: str, body: dict[str, Any]) -> np.ndarray:
    res = httpx.post(url + "/v1/rerank", json=body, timeout=120).json()["results"]
    out = np.zeros(len(res))
    for x in res:
        out[x["index"]] = x["relevance_score"]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--documents", type=int, default=50)
    ap.add_argument("--closed-seconds", type=float, default=20.0)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--fractions", type=float, nargs="+", default=[0.5, 0.8])
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--naive-server", nargs=2, metavar=("PORT", "PATH"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.naive_server:
        naive_server(int(args.naive_server[0]), args.naive_server[1])
        return 0

    from batchpilot.models.seeded import build_cross_encoder

    cache = Path(os.environ.get("TMPDIR", tempfile.gettempdir())) / "batchpilot-bench-models"
    path = build_cross_encoder(cache / "reranker-minilm-l6", seed=0)
    bodies = make_bodies(200, args.documents)
    pairs = [len(b["documents"]) for b in bodies]
    print(f"model: {path} (seeded, 6 layers x 384); {len(bodies)} distinct requests of 1 query x "
          f"{args.documents} documents (conv-embed lengths); cores: {len(os.sched_getaffinity(0))}")
    with ExitStack() as stack:
        pn, pb = free_port(), free_port()
        urls = {
            "naive": stack.enter_context(subprocess_server(
                [sys.executable, __file__, "--naive-server", str(pn), path], pn, "rerank-naive")),
            "batchpilot": stack.enter_context(subprocess_server(
                [sys.executable, "-m", "batchpilot.cli", "serve", "--host", "127.0.0.1", "--port", str(pb),
                 "--model", path], pb, "rerank-batchpilot")),
        }
        for url in urls.values():  # warm: first calls pay for allocator and kernels
            for b in bodies[:3]:
                httpx.post(url + "/v1/rerank", json=b, timeout=120).raise_for_status()
        diff = np.abs(scores_of(urls["naive"], bodies[0]) - scores_of(urls["batchpilot"], bodies[0])).max()
        print(f"\nparity: max |score difference| on request 0 ({pairs[0]} pairs): {diff:.2e}")

        tput: dict[str, list[float]] = {n: [] for n in urls}
        before = parse_metrics(httpx.get(urls["batchpilot"] + "/metrics").text)
        for _ in range(args.rounds):
            for name, url in urls.items():
                rps = asyncio.run(closed_loop(url, bodies, args.concurrency, args.closed_seconds))
                tput[name].append(rps)
        after = parse_metrics(httpx.get(urls["batchpilot"] + "/metrics").text)
        useful, computed = (after[k] - before[k] for k in ("batchpilot_useful_tokens_total",
                                                           "batchpilot_computed_tokens_total"))
        print(f"\nbatchpilot's batches in the closed loop: {computed:,.0f} tokens computed for "
              f"{useful:,.0f} real ones ({useful / computed:.0%} useful)")
        print(f"\nthroughput, closed loop ({args.concurrency} clients, {args.closed_seconds:.0f} s per "
              f"server and round, {args.rounds} rounds):")
        print("| server | requests/s (rounds) | pairs/s | ratio |")
        print("|---|---|---|---|")
        base = float(np.mean(tput["naive"]))
        for name, vals in tput.items():
            m = float(np.mean(vals))
            print(f"| {name} | {m:.2f} ({', '.join(f'{v:.2f}' for v in vals)}) | {m * args.documents:.0f} | "
                  f"{m / base:.2f}x |")

        print(f"\nlatency, open loop (Poisson, {args.seconds:.0f} s per server and round, {args.rounds} "
              f"rounds; rate = fraction x the baseline's {base:.2f} req/s; goodput: answered within "
              f"{SLA_S:.0f} s per second):")
        print("| fraction | rate req/s | server | requests | P50 ms | P99 ms | errors | goodput req/s |")
        print("|---|---|---|---|---|---|---|---|")
        for frac in args.fractions:
            recs: dict[str, list[Any]] = {n: [] for n in urls}
            for r in range(args.rounds):
                for name, url in urls.items():
                    recs[name] += open_loop(url, bodies, frac * base, args.seconds, seed=r)
            for name, rs in recs.items():
                s = summarize(rs, SLA_S)
                good = sum(1 for x in rs if x.ok and x.latency_s <= SLA_S) / (args.seconds * args.rounds)
                print(f"| {frac:.2f} | {frac * base:.2f} | {name} | {s.num_requests} | "
                      f"{s.latency['p50'] * 1e3:.0f} | {s.latency['p99'] * 1e3:.0f} | "
                      f"{sum(s.errors.values())} | {good:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
