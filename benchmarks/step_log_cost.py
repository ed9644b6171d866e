"""What logging every engine step costs the steps it logs, on the real app under open-loop load.

One engine (the built-in tiny Llama, or ``--llm-model``) served in-process by the real app, as the
profile's serving path serves it; the same seeded open-loop streams (Poisson at ``--rate``, prompts
16-512 tokens, outputs 16-128) replayed from a client process once per arm per round, arms rotated
between rounds. The arms differ only in the step observer:

* ``memory``: each ``StepRecord`` appended to a list (no I/O: the reference);
* ``line per step``: the baseline, each step written as a JSON line on the engine thread (``json.dumps``
  into a line-buffered file: a system call per step);
* ``StepLog``: what ``serve --llm-step-log`` runs now (the engine thread queues, a writer thread writes).

Printed per arm and by sequences per step: the mean time between one step's end and the next one's
start while the engine stays busy (``gap``), and the mean busy cycle beyond the forward (``cycle -
forward``, what the profile's overhead line prices), and both over all busy steps against the ``memory``
arm's. Not the whole cycle: the arms' steps differ in size (a slower arm runs fewer, larger steps), so
per-step cycles are not alike, and the forward's own noise between rounds (a few percent of 10-60 ms)
would hide a fraction of a millisecond. Run unpinned to see the shared cores, e.g.
``.venv/bin/python benchmarks/step_log_cost.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from batchpilot.bench.loadgen import build_plan
from batchpilot.core.deployment import ServingOptions
from batchpilot.profile.serving import send_elsewhere
from batchpilot.runtime.executor import NoopExecutor
from batchpilot.runtime.llm.build import build_llm_engine
from batchpilot.runtime.llm.engine import StepLog, StepRecord
from batchpilot.server.app import MountedEngine, ServedModel, create_app
from batchpilot.server.config import ServerConfig
from batchpilot.server.inproc_server import bound_socket, in_thread
from batchpilot.server.llm.routes import make_llm_router
from batchpilot.settings import load_spec
from batchpilot.sim.llm import step_cycles
from batchpilot.sim.traces import Workload

BINS = ((1, 1), (2, 3), (4, 7), (8, 15), (16, 31), (32, 10**6))


class LinePerStep:
    """The baseline: one JSON line written on the engine thread per step (line-buffered)."""

    def __init__(self, path: str) -> None:
        self._f = open(path, "a", buffering=1)  # noqa: SIM115 - closed by close()

    def __call__(self, rec: StepRecord) -> None:
        self._f.write(json.dumps({"step": rec.step_id, "start": rec.start, "wall_s": rec.wall_s,
                                  "forward_s": rec.forward_s, "seqs": rec.num_seqs,
                                  "after_idle": rec.after_idle, "features": rec.features}) + "\n")

    def close(self) -> None:
        self._f.close()


def workload(rate: float, n: int, seed: int, prompts: tuple[int, int] = (16, 512),
             outputs: tuple[int, int] = (16, 128), name: str = "step-log-cost") -> Workload:
    """``n`` streams, seeded: Poisson arrivals at ``rate`` per second, prompt and output tokens uniform
    over ``prompts`` and ``outputs`` (both ends included)."""
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1.0 / rate, n))
    return Workload.from_columns(name, [float(a) for a in arrivals],
                                 [int(p) for p in rng.integers(prompts[0], prompts[1] + 1, n)],
                                 [int(o) for o in rng.integers(outputs[0], outputs[1] + 1, n)])


def run_arm(engine: Any, url: str, arm: str, plan: list[Any], tmp: Path) -> list[StepRecord]:
    seen: list[StepRecord] = []
    extra: Any = None
    if arm == "line per step":
        extra = LinePerStep(str(tmp / "line.jsonl"))
    elif arm == "StepLog":
        extra = StepLog(str(tmp / "steplog.jsonl"))
    observers = [seen.append] + ([extra] if extra is not None else [])
    engine.step_observers.extend(observers)
    try:
        send_elsewhere(url, engine.model_name, plan, endpoint="completions")
    finally:
        for obs in observers:
            engine.step_observers.remove(obs)
        if extra is not None:
            extra.close()
    return seen


def summary(steps: list[StepRecord]) -> dict[str, Any]:
    start = np.array([s.start for s in steps])
    wall = np.array([s.wall_s for s in steps])
    fwd = np.array([s.forward_s for s in steps])
    seqs = np.array([s.num_seqs for s in steps])
    idle = [s.after_idle for s in steps]
    cycle = step_cycles(start, wall, idle)
    busy = np.r_[~np.asarray(idle, dtype=bool)[1:], False]  # the next step followed at once
    gap = cycle - wall
    out: dict[str, Any] = {"steps": len(steps), "seqs": float(seqs[busy].mean()),
                           "gap_s": float(gap[busy].mean()), "beyond_s": float((cycle - fwd)[busy].mean()),
                           "bins": []}
    for lo, hi in BINS:
        m = busy & (seqs >= lo) & (seqs <= hi)
        if m.sum():
            out["bins"].append((lo, hi, int(m.sum()), float(gap[m].mean()), float((cycle - fwd)[m].mean())))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--llm-model", default=None)
    ap.add_argument("--rate", type=float, default=5.0, help="requests per second (default 5)")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seed", type=int, default=5)
    args = ap.parse_args()
    engine = build_llm_engine(args.llm_model, load_spec(None), start=True, threads=0)
    arms = ["memory", "line per step", "StepLog"]
    plan = build_plan(workload(args.rate, args.requests, args.seed), "completions", seed=args.seed)
    warm = build_plan(workload(args.rate, 8, args.seed + 1), "completions", seed=args.seed + 1)
    sock, port = bound_socket()
    app = create_app(ServerConfig(port=port, drain_timeout_s=5.0,
                                  serving=ServingOptions(request_timeout_s=60.0)),
                     [ServedModel(NoopExecutor())],
                     [MountedEngine(lambda registry: make_llm_router(engine, registry), engine.model_name)])
    steps: dict[str, list[StepRecord]] = {a: [] for a in arms}
    with tempfile.TemporaryDirectory() as d, in_thread(app, sock, "step-log-cost") as url:
        send_elsewhere(url, engine.model_name, warm, endpoint="completions")  # first shapes, allocator
        for r in range(args.rounds):
            for arm in arms[r % len(arms):] + arms[:r % len(arms)]:
                time.sleep(1.0)
                got = run_arm(engine, url, arm, plan, Path(d))
                steps[arm] += got
                print(f"round {r + 1} {arm:14s} {len(got)} steps, gap {summary(got)['gap_s'] * 1e3:.3f} ms "
                      "per busy step", flush=True)
    engine.shutdown()
    print(f"\n{args.requests} streams at {args.rate:g} req/s, {args.rounds} rounds, "
          f"{os.cpu_count()} cores, affinity {sorted(os.sched_getaffinity(0))}")
    ref = summary(steps["memory"])
    for arm in arms:
        s = summary(steps[arm])
        print(f"{arm}: {s['steps']} steps, {s['seqs']:.1f} sequences per busy step; per busy step: gap "
              f"{s['gap_s'] * 1e3:.3f} ms ({s['gap_s'] / ref['gap_s']:.2f}x memory's), cycle - forward "
              f"{s['beyond_s'] * 1e3:.3f} ms ({s['beyond_s'] / ref['beyond_s']:.2f}x)")
        for lo, hi, n, gap, extra in s["bins"]:
            name = f"{lo}" if lo == hi else (f"{lo}+" if hi > 1000 else f"{lo}-{hi}")
            print(f"  {name:>6s} seqs  {n:5d} steps  gap {gap * 1e3:.3f} ms  "
                  f"cycle - forward {extra * 1e3:.3f} ms")


if __name__ == "__main__":
    main()
