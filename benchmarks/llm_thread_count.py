"""How many threads a `batchpilot serve --llm` process's engine runs on, and what it costs, per source tree.

    .venv/bin/python benchmarks/llm_thread_count.py --profile P.json [--baseline-src DIR/src] [--rounds 3]

torch keeps an intra-op thread count per thread, taken at the thread's first op from the last
process-wide ``torch.set_num_threads`` (``models.device.bind_threads``). A server that embeds with a
thread plan of one thread for short batches (``models/encoder.py``) leaves that count behind after its
warm-up; an LLM engine thread that does not set its own then runs on one thread for its life.

The encoder profile ``P`` (any ``batchpilot profile`` output) is copied with its thread plan set to one
thread below 1,024 tokens and every core from there, the plan start-up measures on some 2-core VMs,
so the case happens every time, not in some processes. Each round starts ``serve --llm --profile
COPY`` (warm-up on) from this checkout and, with ``--baseline-src``, from another source tree (a
``git worktree`` of an older commit: its ``src``, put first on ``PYTHONPATH``), one after the other,
and sends each the same load: one warm-up completion, then ``--bursts`` bursts of 8 concurrent
150-token completions (``ignore_eos``). Per server: its threads that ran at least 0.2 s of CPU during
the load (the engine thread and each of its OpenMP workers; the event loop's share stays under it) and
the load's wall time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from batchpilot.bench.serverproc import serve
from batchpilot.profile.serving import thread_cpu_s

PLAN = {"steps": [[0, 1], [1024, 2]], "measured_ms": {}}
MODEL = "batchpilot-tiny-llama"


def server_pid(port: int) -> int:
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmd = (proc / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"serve" in cmd and str(port).encode() in cmd:
                return int(proc.name)
    raise RuntimeError(f"no server process on port {port}")


def complete(url: str, prompt: str, tokens: int) -> None:
    r = httpx.post(f"{url}/v1/completions", timeout=120.0, json={
        "model": MODEL, "prompt": prompt, "max_tokens": tokens, "ignore_eos": True})
    r.raise_for_status()


def measure(url: str, bursts: int) -> tuple[int, float]:
    """(threads with >= 0.2 s CPU during the load, the load's wall seconds)."""
    pid = server_pid(int(url.rsplit(":", 1)[1]))
    complete(url, "warm up", 20)
    before, t0 = thread_cpu_s(pid), time.perf_counter()
    with ThreadPoolExecutor(8) as pool:
        for b in range(bursts):
            prompts = [f"burst {b} request {i}: a long story of the sea" for i in range(8)]
            list(pool.map(lambda p: complete(url, p, 150), prompts))
    wall, after = time.perf_counter() - t0, thread_cpu_s(pid)
    busy = sum(1 for t, s in after.items() if s - before.get(t, 0.0) >= 0.2)
    return busy, wall


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", required=True, help="an encoder profile (`batchpilot profile -o P.json`)")
    ap.add_argument("--baseline-src", default=None, help="another source tree's src/ to compare with")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--bursts", type=int, default=3)
    args = ap.parse_args()
    profile = json.loads(Path(args.profile).read_text())
    profile["cost_model"]["meta"]["thread_plan"] = PLAN
    copy = Path(tempfile.mkdtemp(prefix="llm-thread-count-")) / "profile.json"
    copy.write_text(json.dumps(profile))
    trees = {"this checkout": {}}
    if args.baseline_src:
        trees[f"baseline {args.baseline_src}"] = {"PYTHONPATH": str(Path(args.baseline_src).resolve())}
    results: dict[str, list[tuple[int, float]]] = {name: [] for name in trees}
    for r in range(args.rounds):
        for name, env in (list(trees.items()) if r % 2 == 0 else list(trees.items())[::-1]):
            with serve(["--llm", "--profile", str(copy), "--log-level", "warning"], env=env) as url:
                busy, wall = measure(url, args.bursts)
            results[name].append((busy, wall))
            print(f"round {r + 1} {name}: {busy} busy threads, {wall:.2f} s", flush=True)
    print(f"\n{args.bursts} bursts of 8 x 150-token completions, encoder plan {PLAN['steps']} "
          f"(median of {args.rounds} rounds, order alternating)")
    for name, runs in results.items():
        walls = ", ".join(f"{w:.2f}" for _, w in runs)
        print(f"{name:>30}: busy threads {sorted({b for b, _ in runs})}, "
              f"wall {statistics.median(w for _, w in runs):.2f} s ({walls})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
