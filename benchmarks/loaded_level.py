"""Does a live ``batchpilot serve`` process run loaded batches as the profile's loaded phase saw them?

    .venv/bin/python benchmarks/loaded_level.py --profile PROFILE.json [--rounds 3] [--requests N]

The profile prices a batch under load from its loaded phase (``profile/serving.py``): the
model served in the profiling process (``in_thread``) with the profile's scheduler, the seeded loaded
plan (``profile.serving.loaded_plan``) sent open-loop from a child process. ``bench fidelity`` measures a
``batchpilot serve`` process instead. This sends the same loaded plan, in interleaved rounds, to:

* ``in-process``: the profile's set-up (the executor this process loads as the profile did);
* ``serve``: a ``batchpilot serve --profile`` process, the profile's scheduler as its ``--config``;
* ``serve, no fallback``: the same with ``--no-encoder-fallback``;
* ``serve, loadgen here``: the ``serve`` process, the plan replayed by this process's load generator
  scraping ``/metrics`` every 0.5 s, as ``bench fidelity`` sends.

Every server writes its batch log (``--batch-log``). Per variant, the batches' slot seconds over what
the profile prices them at (``fidelity.priced_seconds``: the rate from the logged arrivals, the idle
time before each batch): 1.00 is the profile's line. All variants run on every core this process may
use (pin the whole command with ``taskset`` to compare pinned set-ups).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from batchpilot.bench.fidelity import idle_before, logged_rates, priced_seconds
from batchpilot.bench.loadgen import LoadGenConfig, replay
from batchpilot.bench.serverproc import serve
from batchpilot.core.costmodel import CostModel
from batchpilot.core.deployment import ServingOptions
from batchpilot.models.encoder import EncoderConfig, EncoderExecutor
from batchpilot.profile.serving import (
    LOADED_REQUESTS,
    loaded_plan,
    lone_plan,
    scheduler_config,
    send_elsewhere,
)
from batchpilot.runtime.journal import BatchLog, read_batches
from batchpilot.server.app import ServedModel, create_app
from batchpilot.server.build import profiled_threads
from batchpilot.server.config import ServerConfig
from batchpilot.server.inproc_server import bound_socket, in_thread
from batchpilot.sim.service import FrontEnd

SHORT_TOKENS = 32  # the short batches' ratio is printed apart: a fixed cost per batch shows there most


def level(log: Path, offset: int, cost_model: CostModel,
          frontend: FrontEnd) -> tuple[float, int, float, float]:
    """(slot seconds / priced seconds, batches, mean batch size, the ratio among the batches of fewer
    than ``SHORT_TOKENS`` computed tokens) of the batches logged from ``offset``."""
    batches = sorted(read_batches(log, offset)[0], key=lambda b: b.start)
    priced = priced_seconds(batches, cost_model, frontend, logged_rates(batches), idle_before(batches))
    short = [(b.slot_s, p) for b, p in zip(batches, priced, strict=True)
             if b.features.get("tokens", 0.0) < SHORT_TOKENS]
    return (sum(b.slot_s for b in batches) / sum(priced), len(batches), statistics.mean(b.n for b in batches),
            sum(s for s, _ in short) / sum(p for _, p in short) if short else float("nan"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", required=True, help="a `batchpilot profile` file (padding none)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=LOADED_REQUESTS,
                    help=f"loaded requests a round (the profile's {LOADED_REQUESTS})")
    args = ap.parse_args()
    cost_model = CostModel.load(args.profile)
    frontend = FrontEnd.from_profile(args.profile)
    dtype = json.loads(Path(args.profile).read_text())["meta"].get("precision", {}).get("chosen", "float32")
    ex = EncoderExecutor(EncoderConfig(dtype=dtype))
    ex.threads = profiled_threads(cost_model, "auto")
    ex.warmup()
    texts, lengths, _ = lone_plan(ex)
    plan = loaded_plan(texts, lengths, cost_model, "none", 0, args.requests)
    sched = scheduler_config(ex, "none", cost_model)
    tmp = Path(tempfile.mkdtemp(prefix="loaded-level-"))
    (tmp / "sched.yaml").write_text(json.dumps({"encoder": sched.to_dict()}))  # JSON is YAML
    model = ex.model_name
    settings = ServerConfig(serving=ServingOptions(request_timeout_s=30.0), drain_timeout_s=5.0)
    logs: dict[str, Path] = {}
    senders: dict[str, Callable[[], Any]] = {}

    def child(url: str) -> Callable[[], Any]:
        return lambda: send_elsewhere(url, model, plan)

    def here(url: str) -> Callable[[], Any]:
        return lambda: replay(plan, LoadGenConfig(url, model=model, timeout_s=30.0, progress=False,
                                                  scrape_interval_s=0.5))

    results: dict[str, list[tuple[float, int, float]]] = {}
    serve_args = ["--profile", args.profile, "--config", str(tmp / "sched.yaml"), "--log-level", "warning"]
    with (in_thread(_app(settings, ex, sched, cost_model, tmp / "a.jsonl"), bound_socket()[0], "a") as a,
          serve([*serve_args, "--batch-log", str(tmp / "c.jsonl")]) as c,
          serve([*serve_args, "--batch-log", str(tmp / "d.jsonl"), "--no-encoder-fallback"]) as d):
        for name, url, key, send in (("in-process", a, "a", child),
                                     ("serve", c, "c", child), ("serve, no fallback", d, "d", child),
                                     ("serve, loadgen here", c, "c", here)):
            logs[name], senders[name] = tmp / f"{key}.jsonl", send(url)
        for name in senders:  # one unmeasured pass each: first shapes, allocator
            senders[name]()
        for r in range(args.rounds):
            names = list(senders)
            for name in names[r % len(names):] + names[:r % len(names)]:
                time.sleep(1.0)
                offset = logs[name].stat().st_size
                senders[name]()
                time.sleep(0.5)  # the last batches reach the log
                results.setdefault(name, []).append(level(logs[name], offset, cost_model, frontend))
                print(f"round {r + 1} {name:24s} slot/priced {results[name][-1][0]:.3f} "
                      f"short {results[name][-1][3]:.3f}", flush=True)
    print(f"\n{args.requests} loaded requests a round, {args.rounds} rounds, profile {args.profile}")
    print(f"{'variant':24s} {'slot/priced':>11s} {'rounds':>15s} {'batches':>8s} {'mean size':>9s} "
          f"{'< ' + str(SHORT_TOKENS) + ' tokens':>11s}")
    for name, xs in results.items():
        ratios = [x[0] for x in xs]
        print(f"{name:24s} {statistics.median(ratios):11.3f} {min(ratios):7.3f}..{max(ratios):.3f} "
              f"{statistics.mean(x[1] for x in xs):8.0f} {statistics.mean(x[2] for x in xs):9.2f} "
              f"{statistics.median(x[3] for x in xs):11.3f}")
    return 0


def _app(settings: ServerConfig, executor: Any, sched: Any, cost_model: CostModel, log: Path) -> Any:
    app = create_app(settings, [ServedModel(executor, sched, cost_model)])
    app.state.service.batcher.batch_observers.append(BatchLog(str(log)))
    return app


if __name__ == "__main__":
    raise SystemExit(main())
