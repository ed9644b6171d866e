"""batchpilot's LLM server against llama.cpp's ``llama-server``, over HTTP, on the same weights.

The model: the default tiny Llama (6 x 512, GQA 8:4, vocab 4096, seeded random weights) saved as an HF
folder with the built-in byte-level BPE tokenizer, and converted to GGUF (float32 and bfloat16) by
llama.cpp's own ``convert_hf_to_gguf.py``. The converter recognises a BPE pre-tokenizer by hashing what
the tokenizer makes of a test string; the built-in tokenizer is GPT-2's scheme (byte-level, GPT-2's
split regex), so the conversion registers it as ``gpt-2`` and writes its vocabulary as GPT-2's.

The servers, each a subprocess on 127.0.0.1:

* batchpilot: ``batchpilot serve --noop --llm --llm-model <folder> --llm-dtype <precision>`` with the grid's
  ``--max-num-batched-tokens``, ``--max-num-seqs`` and ``--threads`` (2048 KV blocks x 16 tokens, no
  prefix caching: the defaults);
* llama.cpp: ``llama-server -m <gguf> -np <slots> -c <slots x 2048> -ub <ubatch> -b <2048, at least
  the ubatch> -t/-tb <threads> --no-cache-prompt`` (a slot's KV of its own, 2048 tokens, the model's
  positions; f16 KV cache, llama.cpp's default; continuous batching on, its default).

**The greedy check**, before anything is timed, on every precision of each server: 4 prompts of token ids
(BOS + 5 to 120 seeded ids), 16 greedy tokens each, compared with HF ``generate`` in float32 on the
folder: llama.cpp's token ids (``/completion`` with ``return_tokens``), batchpilot's per-token texts
and its whole text (``/v1/completions`` with ``logprobs: 0``) against the reference's. A precision that
does not give the reference's tokens on every prompt is left out of that server's grid (and said so).

**The load** (the same bodies to both: ``/v1/completions``, token-id prompts, ``temperature`` 0,
``ignore_eos``, streamed with usage; ``bench.loadgen``):

* burst: conv-llm rows ``--start``.. (``--requests``, default 64; prompt and output lengths from the
  trace, docs/design.md) all sent at t=0. Output tok/s = tokens received / (last answer - first send);
  TTFT = first streamed chunk - send; TPOT = (last chunk - first chunk) / (tokens - 1), tokens from the
  usage. Every request must come back with the tokens it asked for.
* lone: one request (a 128-token prompt, 128 tokens) on the idle server after each burst: its decode
  rate, (tokens - 1) / (last chunk - first chunk).
* open loop: ``--open-requests`` conv-llm rows (from ``--start``) at the trace's own arrival pattern,
  scaled to ``--load`` (default 0.7) x llama.cpp's capacity (its best config's burst requests per
  second, the median over rounds), each server at its best config; TTFT and TPOT P50/P99.

**Fairness**: ``--rounds`` rounds (default 3); each round runs every config of both grids, the systems'
order swapped each round and each grid walked in the opposite direction every other round; each config
gets a fresh server and a warm-up (4 short requests) before its timed runs. A system's best config is
its highest median burst tok/s over the rounds; a round's ratio is batchpilot's best-of-grid over
llama.cpp's that round. With ``--keep-failing`` the precisions that fail the check are timed too and
reported apart; the headline and the open loop stay on those that pass. The open-loop runs alternate
the two servers, ``--rounds`` times. The load average is printed with every run (2 shared cores: read
the figures with it).

Stream chunks: llama-server sends no chunk for a token that ends inside a UTF-8 character (its text goes
out with the next token's) and a last chunk with no text; batchpilot sends one chunk per token. TTFT is
the first chunk either way (a llama.cpp request whose first token is such a byte waits for its second),
and TPOT spans first to last chunk over the usage's token count.

    .venv/bin/python benchmarks/llamacpp.py --llama-server PATH/build/bin/llama-server [--rounds 3]

The binary comes from ``--llama-server`` or ``$LLAMA_SERVER``; the llama.cpp source tree (for the
converter and its ``gguf-py``) from ``--llama-cpp`` or ``$LLAMA_CPP_DIR``, else two folders above the
binary's. Without a binary the script says so and exits 0 (nothing measured).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from batchpilot.bench.loadgen import LoadGenConfig, PlannedRequest, build_plan, replay_async
from batchpilot.bench.records import RequestRecord
from batchpilot.bench.serverproc import free_port, serve, wait_ready
from batchpilot.sim.traces import load_workload

SYSTEMS = ("batchpilot", "llama.cpp")
# weights/KV cache: batchpilot's --llm-dtype/--llm-kv-dtype, llama.cpp's GGUF type and -ctk/-ctv
PRECISIONS = {"batchpilot": ("f32/f32", "f32/f16", "bf16/bf16"),
              "llama.cpp": ("f32/f16", "f32/f32", "bf16/f16")}
TORCH_NAMES = {"f32": "float32", "f16": "float16", "bf16": "bfloat16"}
SLOT_CTX = 2048  # llama.cpp's context per slot: the model's positions
CHECK_LENGTHS = (5, 17, 40, 120)
CHECK_TOKENS = 16
LONE_PROMPT, LONE_TOKENS = 128, 128
TARGETS = {"throughput": 1.0, "lone": 0.6}  # batchpilot / llama.cpp


@dataclass(frozen=True)
class Config:
    """One grid point of one system."""

    system: str
    precision: str
    threads: int
    tokens: int = 0  # batchpilot: max_num_batched_tokens
    seqs: int = 0  # batchpilot: max_num_seqs
    slots: int = 0  # llama.cpp: -np
    ubatch: int = 0  # llama.cpp: -ub

    def label(self) -> str:
        if self.system == "batchpilot":
            return f"{self.precision} tokens={self.tokens} seqs={self.seqs} t={self.threads}"
        return f"{self.precision} np={self.slots} ub={self.ubatch} t={self.threads}"


# -- the model: an HF folder and its GGUF conversions --------------------------------------------------

def save_model(out: Path) -> Path:
    """The default tiny Llama and the built-in tokenizer, saved as an HF folder (what ``serve --llm``
    serves without ``--llm-model``: the same seeded weights)."""
    from batchpilot.models.llm.tokenizer import build_tokenizer
    from batchpilot.models.llm.weights import load_hf_llama
    from batchpilot.models.seeded import LLMModelConfig

    if not (out / "config.json").exists():
        cfg = LLMModelConfig()
        load_hf_llama(None, cfg).save_pretrained(out)
        build_tokenizer(cfg.vocab_size).save_pretrained(out)
    return out


# run in a subprocess with the llama.cpp tree first on sys.path: the converter, told that the built-in
# tokenizer is GPT-2's byte-level BPE (its pre-tokenizer by name, its vocabulary written as GPT-2's)
CONVERT = """
import runpy, sys
tree = sys.argv[1]
sys.path[:0] = [tree, tree + "/gguf-py"]
import conversion.base, conversion.llama
conversion.base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
conversion.llama.LlamaModel.set_vocab = lambda self: self._set_vocab_gpt2()
sys.argv = [tree + "/convert_hf_to_gguf.py", *sys.argv[2:]]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def convert_gguf(folder: Path, tree: Path, outtype: str, out: Path) -> Path:
    if not out.exists():
        cmd = [sys.executable, "-c", CONVERT, str(tree), str(folder), "--outtype", outtype,
               "--outfile", str(out)]
        done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        if done.returncode != 0:
            raise RuntimeError(f"convert_hf_to_gguf.py failed:\n{done.stderr[-3000:]}")
    return out


def hf_reference(folder: Path, prompts: Sequence[list[int]], n: int) -> list[list[int]]:
    import torch

    from batchpilot.models.llm.weights import load_hf_llama

    model = load_hf_llama(str(folder))
    out = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                                 pad_token_id=0, eos_token_id=None)
            out.append(gen[0, len(p):].tolist())
    return out


# -- the servers --------------------------------------------------------------------------------------

@contextlib.contextmanager
def llama_server(binary: Path, gguf: Path, cfg: Config, log: Path) -> Iterator[str]:
    port = free_port()
    kv = cfg.precision.split("/")[1]
    cmd = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-np", str(cfg.slots),
           "-c", str(cfg.slots * SLOT_CTX), "-ub", str(cfg.ubatch), "-b", str(max(2048, cfg.ubatch)),
           "-t", str(cfg.threads), "-tb", str(cfg.threads), "-ctk", kv, "-ctv", kv, "--no-cache-prompt",
           "--no-webui"]
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, 120.0, proc, log)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def server(cfg: Config, files: dict[str, Path], binary: Path, logs: Path) -> Iterator[str]:
    log = logs / f"{cfg.system}-{cfg.label().replace(' ', '_').replace('/', '-')}.log"
    weights, kv = cfg.precision.split("/")
    if cfg.system == "llama.cpp":
        with llama_server(binary, files[weights], cfg, log) as url:
            yield url
        return
    args = ["--noop", "--no-warmup", "--llm", "--llm-model", str(files["folder"]), "--llm-dtype",
            TORCH_NAMES[weights], "--llm-kv-dtype", TORCH_NAMES[kv], "--max-num-seqs", str(cfg.seqs),
            "--max-num-batched-tokens", str(cfg.tokens),
            "--threads", str(cfg.threads), "--llm-fallback", "off"]
    with serve(args, log_path=log, ready_timeout_s=600.0) as url:
        yield url


# -- the greedy check ---------------------------------------------------------------------------------

def check_prompts(vocab: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed + 7)
    return [[1, *rng.integers(7, vocab, n).tolist()] for n in CHECK_LENGTHS]


def greedy_check(system: str, url: str, prompts: Sequence[list[int]], ref: Sequence[list[int]],
                 tokenizer: Any) -> tuple[int, str]:
    """How many prompts give exactly the reference's tokens, and the first difference seen."""
    ok, first = 0, ""
    with httpx.Client(base_url=url, timeout=120) as http:
        for p, want in zip(prompts, ref, strict=True):
            if system == "llama.cpp":
                r = http.post("/completion", json={"prompt": p, "n_predict": len(want), "temperature": 0,
                                                    "ignore_eos": True, "cache_prompt": False,
                                                    "return_tokens": True}).json()
                same, got = r.get("tokens") == want, str(r.get("tokens"))
            else:
                model = http.get("/v1/models").json()["data"]
                name = next(m["id"] for m in model if m.get("dimensions") is None)
                r = http.post("/v1/completions", json={"model": name, "prompt": p, "max_tokens": len(want),
                                                       "temperature": 0, "ignore_eos": True,
                                                       "logprobs": 0}).json()
                choice = r["choices"][0]
                pieces = [tokenizer.decode([t], skip_special_tokens=False) for t in want]
                same = choice["logprobs"]["tokens"] == pieces and choice["text"] == tokenizer.decode(want)
                got = str(choice["logprobs"]["tokens"])
            ok += bool(same)
            if not same and not first:
                first = f"prompt of {len(p)}: want {want}, got {got[:200]}"
    return ok, first


# -- the load -----------------------------------------------------------------------------------------

def rows_plan(start: int, count: int, seed: int, rate: float | None = None) -> list[PlannedRequest]:
    """conv-llm rows as request bodies; all at t=0 without ``rate``, else the trace's arrivals scaled to
    ``rate`` requests per second."""
    wl = load_workload("conv-llm", start=start, count=count)
    if rate is not None:
        wl = wl.scale_rate(rate / wl.mean_rate)
    plan = build_plan(wl, "completions", vocab_range=(7, 4096), seed=seed)
    return plan if rate is not None else [dataclasses.replace(p, scheduled_s=0.0) for p in plan]


def replay(url: str, plan: Sequence[PlannedRequest]) -> list[RequestRecord]:
    config = LoadGenConfig(url, endpoint="completions", model=model_name(url), timeout_s=900.0,
                           scrape_interval_s=0.0, progress=False)
    return asyncio.run(replay_async(plan, config)).records


def model_name(url: str) -> str:
    data = httpx.get(url + "/v1/models", timeout=10).json()
    cards = data.get("data") or data.get("models") or []
    llm = [m for m in cards if m.get("dimensions") is None]
    return str((llm or cards or [{"id": "default"}])[0].get("id") or "default")


def pct(xs: Sequence[float], p: float) -> float:
    return float(np.percentile(xs, p)) if len(xs) else float("nan")


def summarize(recs: Sequence[RequestRecord]) -> dict[str, Any]:
    done = [r for r in recs if r.ok]
    t0 = min(r.sent_s for r in recs)
    makespan = max(r.done_s for r in done) - t0 if done else float("nan")
    tokens = sum(r.tokens_received for r in done)
    tpot = [sum(r.itl_s) / (r.tokens_received - 1) for r in done if r.tokens_received > 1 and r.itl_s]
    ttft = [r.ttft_s for r in done]
    return {"tok_s": tokens / makespan, "req_s": len(done) / makespan, "ok": len(done), "n": len(recs),
            "tokens_ok": all(r.tokens_received == r.output_tokens for r in recs),
            "ttft_p50": pct(ttft, 50), "ttft_p99": pct(ttft, 99), "tpot_p50": pct(tpot, 50),
            "tpot_p99": pct(tpot, 99), "load": os.getloadavg()[0]}


def lone_rate(url: str, seed: int) -> dict[str, float]:
    rng = np.random.default_rng(seed + 11)
    body = {"prompt": [1, *rng.integers(7, 4096, LONE_PROMPT - 1).tolist()], "max_tokens": LONE_TOKENS,
            "temperature": 0.0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    plan = [PlannedRequest(0, 0.0, LONE_PROMPT, LONE_TOKENS, body)]
    rec = replay(url, plan)[0]
    decode = sum(rec.itl_s) / max(1, rec.tokens_received - 1)
    return {"tok_s": 1.0 / decode, "ms_per_token": decode * 1e3, "ttft": rec.ttft_s,
            "ok": float(rec.ok and rec.tokens_received == LONE_TOKENS)}


def warm_up(url: str, seed: int) -> None:
    rng = np.random.default_rng(seed + 13)
    bodies = [{"prompt": rng.integers(7, 4096, n).tolist(), "max_tokens": 4, "temperature": 0.0,
               "ignore_eos": True, "stream": True} for n in (8, 32, 128, 512)]
    replay(url, [PlannedRequest(i, 0.0, 0, 4, b) for i, b in enumerate(bodies)])


# -- the runs -----------------------------------------------------------------------------------------

def grids(args: argparse.Namespace, passing: dict[str, list[str]]) -> dict[str, list[Config]]:
    """Every grid point of each system at each of its precisions that passed the greedy check."""
    bp = [Config("batchpilot", p, t, tokens=b, seqs=s) for p in passing["batchpilot"] for t in args.bp_threads
          for b in args.bp_tokens for s in args.bp_seqs]
    lc = [Config("llama.cpp", p, t, slots=n, ubatch=u) for p in passing["llama.cpp"] for t in args.lc_threads
          for n in args.lc_slots for u in args.lc_ubatch]
    return {"batchpilot": bp, "llama.cpp": lc}


def run_config(cfg: Config, files: dict[str, Path], args: argparse.Namespace, logs: Path) -> dict[str, Any]:
    with server(cfg, files, args.binary, logs) as url:
        warm_up(url, args.seed)
        row = summarize(replay(url, rows_plan(args.start, args.requests, args.seed)))
        row["lone"] = lone_rate(url, args.seed)
    return row


def burst_rounds(grid: dict[str, list[Config]], files: dict[str, Path], args: argparse.Namespace,
                 logs: Path) -> list[dict[str, Any]]:
    rows = []
    for r in range(args.rounds):
        order = list(SYSTEMS) if r % 2 == 0 else list(reversed(SYSTEMS))
        for system in order:
            configs = grid[system] if r % 2 == 0 else list(reversed(grid[system]))
            for cfg in configs:
                row = {"round": r, "config": cfg, **run_config(cfg, files, args, logs)}
                rows.append(row)
                lone = row["lone"]
                print(f"round {r} {cfg.system:10s} {cfg.label():38s} {row['tok_s']:7.1f} tok/s  "
                      f"TTFT P50/P99 {row['ttft_p50']:.2f}/{row['ttft_p99']:.2f} s  TPOT P50/P99 "
                      f"{row['tpot_p50'] * 1e3:.1f}/{row['tpot_p99'] * 1e3:.1f} ms  lone "
                      f"{lone['ms_per_token']:.2f} ms/token  ok {row['ok']}/{row['n']}"
                      f"{'' if row['tokens_ok'] else ' (TOKEN COUNT MISMATCH)'}  load {row['load']:.2f}",
                      flush=True)
    return rows


def best_config(rows: Sequence[dict[str, Any]], system: str) -> tuple[Config, float]:
    by: dict[Config, list[float]] = {}
    for row in rows:
        if row["config"].system == system:
            by.setdefault(row["config"], []).append(row["tok_s"])
    cfg = max(by, key=lambda c: statistics.median(by[c]))
    return cfg, statistics.median(by[cfg])


def open_rounds(best: dict[str, Config], rate: float, files: dict[str, Path], args: argparse.Namespace,
                logs: Path) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {s: [] for s in SYSTEMS}
    plan = rows_plan(args.start, args.open_requests, args.seed, rate)
    for r in range(args.rounds):
        for system in (SYSTEMS if r % 2 == 0 else tuple(reversed(SYSTEMS))):
            with server(best[system], files, args.binary, logs) as url:
                warm_up(url, args.seed)
                row = summarize(replay(url, plan))
            out[system].append(row)
            print(f"open loop round {r} {system:10s} {rate:.2f} req/s: TTFT P50/P99 {row['ttft_p50']:.3f}/"
                  f"{row['ttft_p99']:.3f} s  TPOT P50/P99 {row['tpot_p50'] * 1e3:.1f}/"
                  f"{row['tpot_p99'] * 1e3:.1f} ms  {row['tok_s']:.1f} tok/s  ok {row['ok']}/{row['n']}  "
                  f"load {row['load']:.2f}", flush=True)
    return out


# -- the report ---------------------------------------------------------------------------------------

def report_burst(rows: Sequence[dict[str, Any]], rounds: int, title: str) -> dict[str, Any]:
    best = {s: best_config(rows, s) for s in SYSTEMS}
    print(f"\n{title}: best of grid (median burst tok/s over rounds):")
    for s, (cfg, tok_s) in best.items():
        print(f"  {s:10s} {cfg.label():38s} {tok_s:.1f} tok/s")
    ratios, lone = [], []
    for r in range(rounds):
        top = {s: max((x for x in rows if x["round"] == r and x["config"].system == s),
                      key=lambda x: x["tok_s"]) for s in SYSTEMS}
        ratios.append(top["batchpilot"]["tok_s"] / top["llama.cpp"]["tok_s"])
        lone_best = {s: max(x["lone"]["tok_s"] for x in rows if x["round"] == r and x["config"].system == s)
                     for s in SYSTEMS}
        lone.append(lone_best["batchpilot"] / lone_best["llama.cpp"])
    thr, solo = statistics.median(ratios), statistics.median(lone)
    print(f"throughput batchpilot / llama.cpp, best of grid per round: {thr:.2f}x "
          f"({', '.join(f'{x:.2f}' for x in ratios)}); target >= {TARGETS['throughput']}x: "
          f"{'met' if thr >= TARGETS['throughput'] else 'missed'}")
    print(f"lone request decode tok/s, best of grid per round: {solo:.2f}x "
          f"({', '.join(f'{x:.2f}' for x in lone)}); target >= {TARGETS['lone']}x: "
          f"{'met' if solo >= TARGETS['lone'] else 'missed'}")
    return {"best": {s: (c.label(), t) for s, (c, t) in best.items()}, "throughput_ratios": ratios,
            "lone_ratios": lone}


def report_open(out: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    med = {s: {k: statistics.median(r[k] for r in rows) for k in ("ttft_p50", "ttft_p99", "tpot_p50",
                                                                   "tpot_p99")}
           for s, rows in out.items()}
    ratio = med["batchpilot"]["ttft_p99"] / med["llama.cpp"]["ttft_p99"]
    print(f"open loop, medians over rounds: batchpilot TTFT P99 {med['batchpilot']['ttft_p99']:.3f} s, "
          f"llama.cpp {med['llama.cpp']['ttft_p99']:.3f} s: {ratio:.2f}x; target <= 1.0x: "
          f"{'met' if ratio <= 1.0 else 'missed'}")
    return {"medians": med, "ttft_p99_ratio": ratio}


# -- main ---------------------------------------------------------------------------------------------

def find_binary(given: str | None) -> Path | None:
    path = given or os.environ.get("LLAMA_SERVER") or shutil.which("llama-server")
    return Path(path) if path and Path(path).is_file() else None


def find_tree(given: str | None, binary: Path) -> Path:
    tree = Path(given or os.environ.get("LLAMA_CPP_DIR") or binary.resolve().parents[2])
    if not (tree / "convert_hf_to_gguf.py").is_file():
        raise SystemExit(f"no convert_hf_to_gguf.py in {tree}: give the llama.cpp source tree with "
                         "--llama-cpp or LLAMA_CPP_DIR")
    return tree


def prepare(args: argparse.Namespace, work: Path) -> tuple[dict[str, Path], dict[str, list[str]]]:
    """The model files, and the precisions of each server that pass the greedy check."""
    from batchpilot.models.llm.tokenizer import load_tokenizer

    folder = save_model(work / "hf")
    types = {p.split("/")[0] for p in args.lc_precisions}
    files = {"folder": folder,
             **{t: convert_gguf(folder, args.tree, t, work / f"tiny-{t}.gguf") for t in sorted(types)}}
    prompts = check_prompts(4096, args.seed)
    ref = hf_reference(folder, prompts, CHECK_TOKENS)
    tokenizer = load_tokenizer(str(folder), 4096)
    passing: dict[str, list[str]] = {s: [] for s in SYSTEMS}
    print(f"greedy check: {len(prompts)} prompts x {CHECK_TOKENS} tokens against HF generate (float32)")
    for system in SYSTEMS:
        for p in (args.bp_precisions if system == "batchpilot" else args.lc_precisions):
            cfg = (Config(system, p, 1, tokens=512, seqs=8) if system == "batchpilot"
                   else Config(system, p, 1, slots=4, ubatch=512))
            with server(cfg, files, args.binary, work) as url:
                ok, first = greedy_check(system, url, prompts, ref, tokenizer)
            verdict = "passes" if ok == len(prompts) else f"fails, left out ({first})"
            print(f"  {system:10s} {p:9s} {ok}/{len(prompts)} prompts identical: {verdict}", flush=True)
            if ok == len(prompts):
                passing[system].append(p)
    return files, passing


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--llama-server", default=None, help="llama-server binary (default: $LLAMA_SERVER, PATH)")
    p.add_argument("--llama-cpp", default=None, help="llama.cpp source tree (default: $LLAMA_CPP_DIR, else "
                                                     "two folders above the binary)")
    p.add_argument("--work-dir", default=None, help="model files and server logs (default: a temp dir)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--start", type=int, default=0)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--open-requests", type=int, default=128)
    p.add_argument("--load", type=float, default=0.7, help="open loop: share of llama.cpp's capacity")
    p.add_argument("--seed", type=int, default=0)
    names = lambda s: s.split(",")  # noqa: E731
    p.add_argument("--bp-precisions", type=names, default=list(PRECISIONS["batchpilot"]),
                   help="batchpilot weights/KV precisions to check and time (f32, bf16, f16)")
    p.add_argument("--lc-precisions", type=names, default=list(PRECISIONS["llama.cpp"]),
                   help="llama.cpp GGUF/KV precisions to check and time")
    p.add_argument("--bp-tokens", type=ints, default=[256, 1024], help="batchpilot max_num_batched_tokens")
    p.add_argument("--bp-seqs", type=ints, default=[64], help="batchpilot max_num_seqs")
    p.add_argument("--bp-threads", type=ints, default=[1, 2])
    p.add_argument("--lc-slots", type=ints, default=[16, 32, 64], help="llama.cpp -np")
    p.add_argument("--lc-ubatch", type=ints, default=[512], help="llama.cpp -ub")
    p.add_argument("--lc-threads", type=ints, default=[1, 2])
    p.add_argument("--keep-failing", action="store_true",
                   help="time the precisions that fail the greedy check too, reported apart (the headline "
                        "and the open loop stay on those that pass)")
    p.add_argument("--json", default=None, help="write every run's figures here")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    args.binary = find_binary(args.llama_server)
    if args.binary is None:
        print("llama-server not found: build llama.cpp's llama-server and pass --llama-server PATH (or set "
              "LLAMA_SERVER); nothing measured")
        return 0
    args.tree = find_tree(args.llama_cpp, args.binary)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="batchpilot-llamacpp-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"{time.strftime('%Y-%m-%d %H:%M')}; {cpu_model()}; load average {os.getloadavg()[0]:.2f}; "
          f"files and logs in {work}")
    files, passing = prepare(args, work)
    if not all(passing.values()):
        print(f"a server passes the greedy check at no precision: {passing}; nothing timed")
        return 1
    asked = {"batchpilot": args.bp_precisions, "llama.cpp": args.lc_precisions}
    timed = asked if args.keep_failing else passing
    rows = burst_rounds(grids(args, timed), files, args, work)
    checked = [r for r in rows if r["config"].precision in passing[r["config"].system]]
    summary = report_burst(checked, args.rounds, "precisions that pass the greedy check")
    if args.keep_failing:
        summary["all"] = report_burst(rows, args.rounds, "every precision, the check's failures included")
    best = {s: best_config(checked, s)[0] for s in SYSTEMS}
    capacity = statistics.median(r["req_s"] for r in checked if r["config"] == best["llama.cpp"])
    rate = args.load * capacity
    print(f"\nopen loop at {args.load:.0%} of llama.cpp's capacity ({capacity:.2f} req/s): {rate:.2f} req/s")
    summary["open"] = report_open(open_rounds(best, rate, files, args, work))
    if args.json:
        runs = [{**{k: v for k, v in r.items() if k != "config"}, "config": dataclasses.asdict(r["config"])}
                for r in rows]
        Path(args.json).write_text(json.dumps({"runs": runs, "summary": summary}, indent=2, default=str))
    return 0


def cpu_model() -> str:
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    except OSError:
        return "CPU unknown"
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    flags = fields.get("Flags", "").split()
    bf16 = [f for f in flags if "bf16" in f or f.startswith("amx")]
    name = fields.get("Model name", "?").strip()
    return f"{name}, {os.cpu_count()} CPUs, bf16 flags: {' '.join(bf16) or 'none'}"


if __name__ == "__main__":
    sys.exit(main())
