"""What the LLM API's features cost and whether they hold: structured outputs, and ``n`` samples.

The default tiny Llama (6 x 512, GQA 8:4, vocab 4096, seeded random weights, fp32), served by the real
app in this process (the LLM routes over ``build_llm_engine``'s engine, uvicorn on a free 127.0.0.1
port), driven over HTTP by an ``httpx`` client with at most ``--concurrency`` requests in flight.
Grammar enforcement needs no trained model: a random model's answers are valid only if the masks are.

Parts (``--part``, default all):

* ``validity``: 500 ``response_format: json_schema`` answers (50 on each of ``SCHEMAS``: nesting,
  enums, arrays with bounds, integers and numbers with ranges, bounded strings), 100 ``regex`` and 100
  ``choice`` answers (``structured_outputs``), temperature 1 with a seed per request; an answer counts
  when it parses and validates (``jsonschema``), matches, or is one of the choices, and ended by itself
  (finish_reason ``stop``: ``max_tokens`` 600 is far above any answer's length). Then the same 100
  JSON answers (10 per schema) on an engine whose KV pool is so small that sequences are preempted
  mid-answer (the preemptions are counted).
* ``steps``: the engine's decode step (``profile/structured.decode_step_seconds``: masks, forward,
  choice, update) with 0%, 50% and 100% of 32 running sequences under a JSON schema; ``--rounds``
  rounds, the shares interleaved; median (min-max).
* ``throughput``: a conv-llm slice (``--requests`` rows from ``--start``: prompt and output lengths
  from the trace, prompts seeded random ids, all at t=0, EOS ignored) with none of the requests
  structured, and with every other one under ``profile/structured.SCHEMA`` (an answer that stays
  open past every output length, so both runs produce the same tokens and every structured step is
  masked); ``--rounds`` rounds, the two taking turns (the order flipped each round); output tok/s
  median (min-max) and the ratio per round. Target: a cost of at most 15%.
* ``samples``: the same slice's first ``--samples-prompts`` prompts, each asked once with ``n=4``
  against four times as separate requests (seeded, temperature 1, ``max_tokens`` 64, EOS ignored),
  taking turns; peak KV blocks in use (sampled after every engine step) and output tok/s.

    .venv/bin/python benchmarks/llm_api.py [--part all] [--rounds 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import jsonschema
import numpy as np

from batchpilot.core.deployment import ServingOptions
from batchpilot.profile.structured import SCHEMA as OPEN_SCHEMA
from batchpilot.profile.structured import decode_step_seconds
from batchpilot.runtime.executor import NoopExecutor
from batchpilot.runtime.llm.build import BuildOptions, build_llm_engine
from batchpilot.server.app import MountedEngine, ServedModel, create_app
from batchpilot.server.config import ServerConfig
from batchpilot.server.inproc_server import bound_socket, in_thread
from batchpilot.server.llm.routes import make_llm_router
from batchpilot.sim.traces import load_workload

S = {"type": "string", "maxLength": 10}
INT = {"type": "integer"}
NUM = {"type": "number"}


def obj(**props: Any) -> dict[str, Any]:
    """An object schema: every property required, no others."""
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


def arr(items: dict[str, Any], lo: int = 0, hi: int = 4) -> dict[str, Any]:
    return {"type": "array", "items": items, "minItems": lo, "maxItems": hi}


SCHEMAS: list[dict[str, Any]] = [
    obj(name=S, age={"type": "integer", "minimum": 0, "maximum": 120}),
    obj(unit={"enum": ["C", "F", "K"]}, value=NUM),
    arr({"type": "integer", "minimum": -5, "maximum": 5}, 1, 6),
    obj(user=obj(id=INT, tags=arr(S, 0, 3))),
    obj(ok={"type": "boolean"}, code={"enum": [200, 404, 500]}),
    arr(obj(x=NUM, y=NUM)),
    obj(title=S, pages={"type": "integer", "minimum": 1, "maximum": 999}, authors=arr(S, 1, 3)),
    obj(level={"enum": ["debug", "info", "warn", "error"]}, count={"type": "integer", "minimum": 0},
        ratio={"type": "number", "minimum": 0, "maximum": 1}),
    obj(matrix=arr(arr({"type": "integer", "minimum": 0, "maximum": 9}, 0, 3), 0, 3)),
    obj(a=obj(b=obj(c=S)), flag={"type": "boolean"}),
]
REGEXES = ["[A-Z]{2}-[0-9]{3}", "(yes|no), [a-z]{1,6}", "[0-9]{1,3}(\\.[0-9]{1,2})? (kg|lb)"]
CHOICES = ["apple", "banana", "cherry", "a longer answer"]
MAX_TOKENS = 600


def engine_for(args: argparse.Namespace, start: bool = True, **keys: Any) -> Any:
    base: dict[str, Any] = {"num_kv_blocks": 1024, "block_size": 16, "max_num_seqs": 32,
                            "max_num_batched_tokens": 512, "max_model_len": 2048, "model_name": "m"}
    base.update(keys)
    return build_llm_engine(None, options=BuildOptions(threads=args.threads, start=start), **base)


@contextmanager
def served(engine: Any) -> Iterator[str]:
    sock, port = bound_socket()
    serving = ServingOptions(request_timeout_s=600.0)
    app = create_app(ServerConfig(port=port, drain_timeout_s=5.0, serving=serving),
                     [ServedModel(NoopExecutor())],
                     [MountedEngine(lambda registry: make_llm_router(engine, registry), "m")])
    with in_thread(app, sock, "batchpilot-llm-api-bench") as url:
        yield url


async def post_all(url: str, bodies: list[dict[str, Any]], concurrency: int
                   ) -> tuple[list[dict[str, Any]], float]:
    """Every body to /v1/completions, at most ``concurrency`` in flight; the answers and the makespan."""
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        async def one(body: dict[str, Any]) -> dict[str, Any]:
            async with gate:
                r = await http.post("/v1/completions", json={"model": "m", **body})
                return dict(r.json()) | {"status": r.status_code}

        t0 = time.perf_counter()
        out = await asyncio.gather(*(one(b) for b in bodies))
        return list(out), time.perf_counter() - t0


def spread(xs: list[float], fmt: str = "{:.1f}") -> str:
    return f"{fmt.format(statistics.median(xs))} ({fmt.format(min(xs))}-{fmt.format(max(xs))})"


# -- validity ------------------------------------------------------------------------------------
def json_bodies(per_schema: int) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    return [({"prompt": f"record {k} of kind {i}", "max_tokens": MAX_TOKENS, "seed": 1000 * i + k,
              "temperature": 1.0, "response_format": {"type": "json_schema",
                                                      "json_schema": {"name": f"s{i}", "schema": schema}}},
             schema) for i, schema in enumerate(SCHEMAS) for k in range(per_schema)]


def json_ok(answer: dict[str, Any], schema: dict[str, Any]) -> bool:
    if answer["status"] != 200 or answer["choices"][0]["finish_reason"] != "stop":
        return False
    try:
        jsonschema.validate(json.loads(answer["choices"][0]["text"]), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def run_validity(args: argparse.Namespace) -> None:
    engine = engine_for(args)
    try:
        with served(engine) as url:
            pairs = json_bodies(50)
            answers, wall = asyncio.run(post_all(url, [b for b, _ in pairs], args.concurrency))
            ok = sum(json_ok(a, s) for a, (_, s) in zip(answers, pairs, strict=True))
            print(f"json_schema: {ok} of {len(pairs)} answers parse, validate and ended by themselves "
                  f"({len(SCHEMAS)} schemas; {wall:.1f} s)")
            bodies = [{"prompt": f"code {k}", "max_tokens": MAX_TOKENS, "seed": k, "temperature": 1.0,
                       "structured_outputs": {"regex": REGEXES[k % len(REGEXES)]}} for k in range(100)]
            answers, _ = asyncio.run(post_all(url, bodies, args.concurrency))
            ok = sum(a["status"] == 200 and a["choices"][0]["finish_reason"] == "stop"
                     and re.fullmatch(REGEXES[k % len(REGEXES)], a["choices"][0]["text"]) is not None
                     for k, a in enumerate(answers))
            print(f"regex: {ok} of 100 answers match ({len(REGEXES)} expressions)")
            bodies = [{"prompt": f"pick {k}", "max_tokens": MAX_TOKENS, "seed": k, "temperature": 1.0,
                       "structured_outputs": {"choice": CHOICES}} for k in range(100)]
            answers, _ = asyncio.run(post_all(url, bodies, args.concurrency))
            ok = sum(a["status"] == 200 and a["choices"][0]["text"] in CHOICES for a in answers)
            print(f"choice: {ok} of 100 answers are one of the {len(CHOICES)} choices")
    finally:
        engine.shutdown()
    small = engine_for(args, num_kv_blocks=40, max_num_seqs=32, max_model_len=640)  # 640 slots for 32
    try:
        with served(small) as url:
            before = small.stats().num_preemptions
            pairs = json_bodies(10)
            answers, _ = asyncio.run(post_all(url, [b for b, _ in pairs], args.concurrency))
            ok = sum(json_ok(a, s) for a, (_, s) in zip(answers, pairs, strict=True))
            print(f"json_schema under preemption (40 KV blocks of 16 for up to 32 sequences): {ok} of "
                  f"{len(pairs)} answers valid; {small.stats().num_preemptions - before} preemptions")
    finally:
        small.shutdown()


# -- step time -----------------------------------------------------------------------------------
def run_steps(args: argparse.Namespace) -> None:
    engine = engine_for(args, start=False)
    shares = (0.0, 0.5, 1.0)
    times: dict[float, list[float]] = {s: [] for s in shares}
    for r in range(args.rounds):
        for share in shares if r % 2 == 0 else shares[::-1]:
            times[share].append(decode_step_seconds(engine, 32, share, steps=24, seed=r) * 1e3)
    base = statistics.median(times[0.0])
    print("decode step of 32 sequences (ms): " + "; ".join(
        f"{int(s * 100)}% under a schema {spread(times[s], '{:.2f}')} "
        f"(x{statistics.median(times[s]) / base:.3f})" for s in shares))


# -- throughput ------------------------------------------------------------------------------------
def slice_bodies(args: argparse.Namespace, structured_every: int) -> list[dict[str, Any]]:
    wl = load_workload("conv-llm", start=args.start, count=args.requests)
    rng = np.random.default_rng(7)
    out = []
    lengths = zip(wl.input_tokens.tolist(), wl.output_tokens.tolist(), strict=True)
    for i, (n_in, n_out) in enumerate(lengths):
        body: dict[str, Any] = {"prompt": rng.integers(7, 4096, int(n_in)).tolist(),
                                "max_tokens": int(n_out), "temperature": 0.0, "ignore_eos": True}
        if structured_every and i % structured_every == 0:
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "open",
                                                                              "schema": OPEN_SCHEMA}}
        out.append(body)
    return out


def tokens_per_s(answers: list[dict[str, Any]], wall: float) -> float:
    bad = [a for a in answers if a["status"] != 200]
    if bad:
        raise RuntimeError(f"{len(bad)} requests failed: {bad[0]}")
    return sum(a["usage"]["completion_tokens"] for a in answers) / wall


def run_throughput(args: argparse.Namespace) -> None:
    engine = engine_for(args, max_num_seqs=64)
    arms = {"none structured": slice_bodies(args, 0), "half structured": slice_bodies(args, 2)}
    tok: dict[str, list[float]] = {k: [] for k in arms}
    try:
        with served(engine) as url:
            warm = [dict(b, max_tokens=4) for b in arms["half structured"][:8]]
            asyncio.run(post_all(url, warm, 8))
            for r in range(args.rounds):
                for name in list(arms) if r % 2 == 0 else list(arms)[::-1]:
                    answers, wall = asyncio.run(post_all(url, arms[name], len(arms[name])))
                    tok[name].append(tokens_per_s(answers, wall))
    finally:
        engine.shutdown()
    ratios = [h / n for h, n in zip(tok["half structured"], tok["none structured"], strict=True)]
    print(f"conv-llm slice ({args.requests} requests at t=0): output tok/s none structured "
          f"{spread(tok['none structured'])}, half structured {spread(tok['half structured'])}; "
          f"ratio per round {', '.join(f'{x:.3f}' for x in ratios)} "
          f"(cost {(1 - statistics.median(ratios)) * 100:.1f}%; target <= 15%)")


# -- n samples -------------------------------------------------------------------------------------
def run_samples(args: argparse.Namespace) -> None:
    engine = engine_for(args, max_num_seqs=64)
    prompts = [b["prompt"] for b in slice_bodies(args, 0)[: args.samples_prompts]]
    common = {"max_tokens": 64, "temperature": 1.0, "ignore_eos": True}
    arms = {"n=4": [{"prompt": p, "n": 4, "seed": i, **common} for i, p in enumerate(prompts)],
            "4 requests": [{"prompt": p, "seed": 4 * i + j, **common} for i, p in enumerate(prompts)
                           for j in range(4)]}
    peak: list[int] = [0]
    used = engine.scheduler.block_manager

    def observe(_: Any) -> None:
        peak[0] = max(peak[0], used.num_used_blocks)

    blocks: dict[str, list[int]] = {k: [] for k in arms}
    tok: dict[str, list[float]] = {k: [] for k in arms}
    engine.step_observers.append(observe)
    try:
        with served(engine) as url:
            for r in range(args.rounds):
                for name in list(arms) if r % 2 == 0 else list(arms)[::-1]:
                    peak[0] = 0
                    answers, wall = asyncio.run(post_all(url, arms[name], len(arms[name])))
                    tok[name].append(tokens_per_s(answers, wall))
                    blocks[name].append(peak[0])
    finally:
        engine.shutdown()
    mean_prompt = statistics.mean(len(p) for p in prompts)
    print(f"{len(prompts)} prompts (mean {mean_prompt:.0f} tokens) x 4 samples of 64 tokens: "
          + "; ".join(f"{k}: peak KV blocks {spread([float(b) for b in blocks[k]], '{:.0f}')}, "
                      f"output tok/s {spread(tok[k])}" for k in arms))


PARTS = {"validity": run_validity, "steps": run_steps, "throughput": run_throughput, "samples": run_samples}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=(*PARTS, "all"), default="all")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: every core)")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--requests", type=int, default=64, help="throughput: conv-llm rows")
    ap.add_argument("--start", type=int, default=0, help="throughput: the first conv-llm row")
    ap.add_argument("--samples-prompts", type=int, default=16)
    args = ap.parse_args()
    for name, run in PARTS.items():
        if args.part in (name, "all"):
            run(args)


if __name__ == "__main__":
    main()
