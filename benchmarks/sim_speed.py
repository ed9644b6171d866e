"""How fast does the simulator replay a million requests, and where does the time go?

    .venv/bin/python benchmarks/sim_speed.py [--requests 1000000] [--rate-scale 1.0]
                                             [--profile-requests 100000]

Workload: conv-embed tiled end to end until it has ``--requests`` rows (each copy starts where the last
ended), at ``--rate-scale``; the batchpilot default SchedulerConfig and the default CPU cost model.
Printed, all measured in this one run:

1. the full run: wall and CPU seconds, simulated requests per second (the target: 1M in <= 30 s).
   Other engineers share these 2 cores, so wall time swings with their load; CPU time (this process)
   is what the run costs on an idle machine, give or take cache effects;
2. the same rows with a trivial scheduler stub (FIFO, take everything waiting) behind the same target
   and engine: what the loop itself costs, and the ratio of the full run to it;
3. a cProfile of ``--profile-requests`` rows: share of time inside core/ (the scheduler) vs sim/, and
   the core functions with the most self time (where to optimise if the 30 s target is missed).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time
from collections import deque

import numpy as np

from batchpilot.core.batch import Batch, SchedulerOutput
from batchpilot.core.config import SchedulerConfig
from batchpilot.core.costmodel import BatchShape, CostModel
from batchpilot.sim.engine import Engine
from batchpilot.sim.metrics import summarize
from batchpilot.sim.target import EncoderTarget, simulate_encoder
from batchpilot.sim.traces import Workload, conv_embed


def tiled(n: int, rate_scale: float) -> Workload:
    base = conv_embed()
    copies = -(-n // len(base))
    gap = float(np.diff(base.arrival_s).mean())
    span = base.duration_s + gap
    t = np.concatenate([base.arrival_s + i * span for i in range(copies)])[:n]
    lens = np.tile(base.input_tokens, copies)[:n]
    return Workload.from_columns(f"conv-embed tiled x{copies}", t, lens).scale_rate(rate_scale)


class StubScheduler:
    """FIFO, takes everything waiting (up to 32): the cheapest scheduler the target can drive."""

    def __init__(self) -> None:
        self.queue: deque = deque()
        self.cost_model = CostModel.default_cpu_minilm()
        self.config = SchedulerConfig()  # one slot: what the target reads of the scheduler's config
        self.ids = 0

    @property
    def num_waiting(self) -> int:
        return len(self.queue)

    def submit(self, req, now):  # type: ignore[no-untyped-def]
        self.queue.append(req)

    def schedule(self, now: float, free_slots: int) -> SchedulerOutput:
        out = SchedulerOutput()
        if free_slots and self.queue:
            reqs = [self.queue.popleft() for _ in range(min(32, len(self.queue)))]
            lens = [r.length for r in reqs]
            shape = BatchShape.padded(lens, max(lens))
            self.ids += 1
            out.batches.append(Batch(self.ids, reqs, shape.padded_len, shape, "dynamic", now))
        return out

    def next_batch_at(self, batch, started_at):  # type: ignore[no-untyped-def]
        return float("inf")  # no pipelining: the slot takes its next batch when this one ends

    def on_batch_done(self, batch, now, latency_s):  # type: ignore[no-untyped-def]
        return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=1_000_000)
    ap.add_argument("--rate-scale", type=float, default=1.0)
    ap.add_argument("--profile-requests", type=int, default=100_000)
    ap.add_argument("--config", help="SchedulerConfig YAML (default: the batchpilot default)")
    args = ap.parse_args()
    wl = tiled(args.requests, args.rate_scale)
    cfg = SchedulerConfig()
    if args.config:
        from batchpilot.settings import load_spec

        cfg = load_spec(args.config).encoder
    print(f"workload: {wl.name}, {len(wl):,} requests, {wl.mean_rate:.2f} req/s; config: "
          f"{args.config or 'batchpilot default'} ({cfg.policy.name}, {cfg.planner.grouping}/"
          f"{cfg.planner.padding}, bs {cfg.policy.max_batch_size}, {cfg.policy.max_wait_s * 1e3:g} ms)")

    t0, c0 = time.perf_counter(), time.process_time()
    run = simulate_encoder(wl, cfg)
    rep = summarize(run, sla_s=1.0)
    full, full_cpu = time.perf_counter() - t0, time.process_time() - c0
    s = run.stats
    print(f"full run:   {full:6.2f} s wall, {full_cpu:6.2f} s CPU = {len(wl) / full:,.0f} requests/s (wall); "
          f"{s.num_jobs:,} batches, {s.num_schedule_calls:,} schedule calls; per 1M requests: "
          f"{full * 1e6 / len(wl):.1f} s wall, {full_cpu * 1e6 / len(wl):.1f} s CPU (target <= 30 s)")
    print(f"            simulated P99 {rep.latency['p99'] * 1e3:.0f} ms, "
          f"mean batch {rep.mean_batch_size:.2f}")

    t0, c0 = time.perf_counter(), time.process_time()
    stub_target = EncoderTarget(StubScheduler(), wl)  # type: ignore[arg-type]
    stub_stats = Engine(stub_target, 1).run(wl.arrival_s)
    stub, stub_cpu = time.perf_counter() - t0, time.process_time() - c0
    print(f"stub core:  {stub:6.2f} s wall, {stub_cpu:6.2f} s CPU ({stub_stats.num_jobs:,} batches): the "
          f"engine + target alone; full / stub = {full_cpu / stub_cpu:.1f}x (CPU)")

    n = min(args.profile_requests, len(wl))
    part = wl.slice(0, n)
    prof = cProfile.Profile()
    prof.enable()
    simulate_encoder(part, cfg)
    prof.disable()
    stats = pstats.Stats(prof)
    total = sum(v[2] for v in stats.stats.values())  # type: ignore[attr-defined]
    by_layer: dict[str, float] = {}
    core_rows = []
    for (file, line, func), (_, ncalls, tottime, _, _) in stats.stats.items():  # type: ignore[attr-defined]
        layer = "core" if "/batchpilot/core/" in file else "sim" if "/batchpilot/sim/" in file else "other"
        by_layer[layer] = by_layer.get(layer, 0.0) + tottime
        if layer == "core":
            core_rows.append((tottime, ncalls, f"{file.split('/batchpilot/')[-1]}:{line}({func})"))
    shares = ", ".join(f"{k} {v / total:.0%}" for k, v in sorted(by_layer.items(), key=lambda kv: -kv[1]))
    print(f"profile of {n:,} requests, self time by layer (builtins called from a layer count as 'other'): "
          f"{shares}")
    print("core functions by self time:")
    for tottime, ncalls, where in sorted(core_rows, reverse=True)[:10]:
        print(f"  {tottime / total:5.1%}  {ncalls:>9,} calls  {where}")


if __name__ == "__main__":
    main()
