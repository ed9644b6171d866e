"""Does a live ``batchpilot serve --llm`` process run its steps as the profile's loaded phase saw them?

    .venv/bin/python benchmarks/llm_loaded_level.py --profile DIR/llm_profile.json [--rounds 2]
                                                     [--requests 400] [--rate 3]

The LLM profile prices a step under load from its loaded phase (``profile/llm.py``): the
engine served in the profiling process (``in_thread``), its streams sent open-loop from a child process
that neither scrapes ``/metrics`` nor draws a progress bar. ``bench fidelity --workload conv-llm``
measures a ``batchpilot serve --llm`` process, sent to by its own load generator, which scrapes
``/metrics`` every 0.5 s and draws a progress bar. This sends one seeded steady stream load (Poisson
at ``--rate``, prompts 16-1024 tokens, outputs 64-320: tens of sequences per step, not the profile's
traffic and not a fidelity workload), in interleaved rounds with the order rotated, to:

* ``in-process``: the profile's set-up (an engine built here as ``bench fidelity`` builds the one it
  profiles, the real app in a thread, the load from a child process);
* ``serve``: a ``batchpilot serve --llm`` process, the same child-process load;
* ``serve, again``: a second such process, the same flags (how far two processes differ);
* ``serve, no fallbacks`` and ``serve, no fallbacks again``: two with ``--llm-fallback off
  --no-encoder-fallback``;
* ``serve, huge pages`` and ``serve, huge pages again``: two with ``THP_MEM_ALLOC_ENABLE=1`` (torch's
  CPU allocator asks the kernel for transparent huge pages for its large blocks, the KV pool's among
  them; where ``/sys/kernel/mm/transparent_hugepage/enabled`` is ``madvise`` nothing else gets them);
* ``serve, bench client``: the first ``serve`` process, the load sent by this process's load generator
  as ``bench fidelity`` sends it (``/metrics`` every 0.5 s, the progress bar; the child's model and
  120 s timeout).

``--variants`` picks some of them (default: all).

Per variant, the steps against the profile (``bench.llm_fidelity``): the whole cycle against what the
simulator prices it at, and by sequences per step the forward against its price and the rest of the
cycle against the overhead line. All variants run on every core this process may use (pin the whole
command with ``taskset`` to compare pinned set-ups).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np
from step_log_cost import workload

from batchpilot.bench.llm_fidelity import (
    LoggedStep,
    format_by_seqs,
    read_steps,
    speed_by_seqs,
    speed_vs_profile,
)
from batchpilot.bench.loadgen import LoadGenConfig, build_plan, replay
from batchpilot.bench.serverproc import serve
from batchpilot.core.costmodel import CostModel
from batchpilot.core.deployment import ServingOptions
from batchpilot.profile.serving import send_elsewhere
from batchpilot.runtime.executor import NoopExecutor
from batchpilot.runtime.journal import wait_written
from batchpilot.runtime.llm.build import build_llm_engine
from batchpilot.server.app import MountedEngine, ServedModel, create_app
from batchpilot.server.config import ServerConfig
from batchpilot.server.inproc_server import bound_socket, in_thread
from batchpilot.server.llm.routes import make_llm_router
from batchpilot.sim.llm import LLMFrontEnd
from batchpilot.sim.traces import Workload

THP = {"THP_MEM_ALLOC_ENABLE": "1"}  # torch's CPU allocator asks for transparent huge pages (>= 2 MiB)
SERVES: dict[str, tuple[list[str], dict[str, str]]] = {  # a `serve --llm` process each: flags, environment
    "serve": ([], {}),
    "serve, again": ([], {}),  # a second process with the same flags: how far two processes differ
    "serve, no fallbacks": (["--llm-fallback", "off", "--no-encoder-fallback"], {}),
    "serve, no fallbacks again": (["--llm-fallback", "off", "--no-encoder-fallback"], {}),
    "serve, huge pages": ([], THP),
    "serve, huge pages again": ([], THP),
}
VARIANTS = ("in-process", *SERVES, "serve, bench client")


def stream_load(n: int, rate: float, seed: int) -> Workload:
    return workload(rate, n, seed, prompts=(16, 1024), outputs=(64, 320), name="llm-loaded-level")


def logged(record: Any) -> LoggedStep:
    return LoggedStep(record.start, record.wall_s, record.forward_s, record.num_seqs, record.after_idle,
                      dict(record.features))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", required=True, help="an LLM profile (bench fidelity's llm_profile.json)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--requests", type=int, default=400, help="streams per variant and round")
    ap.add_argument("--rate", type=float, default=3.0, help="streams per second")
    ap.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    args = ap.parse_args()
    variants = tuple(v for v in VARIANTS if v in args.variants)
    cost_model, frontend = CostModel.load(args.profile), LLMFrontEnd.from_profile(args.profile)
    plan = build_plan(stream_load(args.requests, args.rate, 7), "completions", seed=7)
    warm = build_plan(stream_load(2, 1.0, 8), "completions", warmup_requests=2)
    engine = build_llm_engine(None, start=True)
    steps: list[Any] = []
    folder = Path(tempfile.mkdtemp(prefix="llm-loaded-level-"))
    sock, port = bound_socket()
    app = create_app(ServerConfig(port=port, drain_timeout_s=5.0,
                                  serving=ServingOptions(request_timeout_s=600.0)),
                     [ServedModel(NoopExecutor())],
                     [MountedEngine(lambda registry: make_llm_router(engine, registry), engine.model_name)])
    results: dict[str, list[list[LoggedStep]]] = {v: [] for v in variants}
    with ExitStack() as stack:
        here = stack.enter_context(in_thread(app, sock, "llm-loaded-level"))
        send_elsewhere(here, engine.model_name, warm, endpoint="completions")
        servers: dict[str, tuple[str, Path]] = {}
        for i, (name, (flags, env)) in enumerate(SERVES.items()):
            if name in variants or (name == "serve" and "serve, bench client" in variants):
                log = folder / f"steps-{i}.jsonl"
                url = stack.enter_context(serve(["--llm", "--log-level", "warning", "--no-warmup",
                                                 "--llm-step-log", str(log), *flags],
                                                log_path=log.with_suffix(".log"), env=env))
                replay(warm, LoadGenConfig(url, "completions", progress=False, scrape_interval_s=0))
                servers[name] = (url, log)
        servers["serve, bench client"] = servers.get("serve", ("", folder / "none"))
        for r in range(args.rounds):
            order = variants[r % len(variants):] + variants[:r % len(variants)]
            for variant in order:
                if variant == "in-process":
                    steps.clear()
                    engine.step_observers.append(steps.append)
                    try:
                        send_elsewhere(here, engine.model_name, plan, endpoint="completions")
                    finally:
                        engine.step_observers.remove(steps.append)
                    run = [logged(s) for s in steps]
                else:
                    url, log = servers[variant]
                    wait_written()
                    offset = log.stat().st_size if log.exists() else 0
                    if variant == "serve, bench client":
                        replay(plan, LoadGenConfig(url, "completions", model=engine.model_name,
                                                   timeout_s=120.0), description=f"round {r + 1}")
                    else:
                        send_elsewhere(url, engine.model_name, plan, endpoint="completions")
                    wait_written()
                    run = read_steps(log, offset)[0]
                results[variant].append(run)
                print(f"round {r + 1} {variant}: {len(run)} steps, "
                      f"{np.mean([s.seqs for s in run]):.1f} sequences per step, cycle "
                      f"{speed_vs_profile(cost_model, run, frontend):+.1%} against the profile", flush=True)
    engine.shutdown()
    print(f"\n{args.requests} streams at {args.rate:g}/s, {args.rounds} rounds; against {args.profile} "
          "(forward: against step_alpha x the count's factor x the step model; overhead: the rest of "
          "the cycle against the overhead line; steps in parentheses)")
    for variant in variants:
        runs = results[variant]
        cycle = statistics.median(speed_vs_profile(cost_model, run, frontend) for run in runs)
        every = [s for run in runs for s in run]
        print(f"{variant:>20}: cycle {cycle:+.1%} (median of rounds); "
              + format_by_seqs(speed_by_seqs(cost_model, every, frontend)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
