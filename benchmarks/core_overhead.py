"""Scheduling-core overhead: decide + plan cost per request with 10k requests waiting.

    .venv/bin/python benchmarks/core_overhead.py [--waiting 10000] [--batches 500] [--stream 20000]
                                                 [--repeat 3] [--wall]

For each planner grouping (and each policy with the default grouping) the queue is filled with
``--waiting`` requests (conv-embed-like lengths 4..512, seeded), then ``schedule(now, 1)`` is called
repeatedly, each call dispatching one batch, while the dispatched requests are replaced by fresh
submits so the backlog stays at ``--waiting``. Reported: µs per dispatched request of schedule()
(decide + plan + queue removal) and of submit() (admission + queue insert), and a streaming figure:
submit + schedule on every arrival, wake-up and batch end, µs per request end to end, at 1.5x the
executor's capacity (deep queue, full batches) and at 0.1x ("light": batches of one or two, so every
request pays a dispatch, like the conv-embed trace) — the per-request budget of the simulator's
1M-requests-in-30-s goal is 30 µs including its own loop.
Target: decide + plan <= 20 µs per request. Times are this process's CPU time (``time.process_time``:
other jobs on shared cores inflate wall time, not this); ``--wall`` uses ``perf_counter`` instead.
Each figure is the best of ``--repeat`` runs. Still noisy (caches, frequency): compare rows of one run.
"""

from __future__ import annotations

import argparse
import random
import time

from batchpilot.core.config import PlannerConfig, PolicyConfig, SchedulerConfig
from batchpilot.core.request import Request
from batchpilot.core.scheduler import BatchScheduler


def _lengths(n: int, seed: int) -> list[int]:
    rnd = random.Random(seed)
    # conv-embed-like: log-normal around 128 tokens, clipped to [4, 512]
    return [min(512, max(4, int(rnd.lognormvariate(4.8, 0.8)))) for _ in range(n)]


CLOCK = time.process_time


def backlog_case(config: SchedulerConfig, waiting: int, batches: int, seed: int = 0) -> tuple[float, float]:
    """(µs per dispatched request in schedule, µs per submit) with ``waiting`` requests queued."""
    sched = BatchScheduler(config)
    lengths = _lengths(waiting + batches * config.policy.max_batch_size + 1, seed)
    next_id = 0
    now = 0.0
    t_submit = 0.0
    n_submit = 0

    def fill() -> None:
        nonlocal next_id, t_submit, n_submit
        need = waiting - sched.num_waiting
        t0 = CLOCK()
        for _ in range(need):
            sched.submit(Request(next_id, now, lengths[next_id]), now)
            next_id += 1
        t_submit += CLOCK() - t0
        n_submit += max(need, 0)

    fill()
    now = 1.0  # everyone has waited past max_wait: every call dispatches
    t_sched = 0.0
    dispatched = 0
    for _ in range(batches):
        t0 = CLOCK()
        out = sched.schedule(now, 1)
        t_sched += CLOCK() - t0
        for b in out.batches:
            dispatched += b.size
            sched.on_batch_done(b, now, b.predicted_s)
        fill()
        now += 1e-4
    return t_sched / max(dispatched, 1) * 1e6, t_submit / max(n_submit, 1) * 1e6


def stream_case(config: SchedulerConfig, n: int, seed: int = 0, load: float = 1.5) -> float:
    """µs per request for submit + schedule on every arrival, wake-up and batch end (executor and
    clock simulated); ``load`` is the offered rate over what full batches of the mean length serve."""
    sched = BatchScheduler(config)
    lengths = _lengths(n, seed)
    rnd = random.Random(seed + 1)
    # offered load 1.5x what full batches of the mean length can serve: the queue grows and stays deep
    mean_len = sum(lengths) / n
    cap = config.policy.max_batch_size
    full = sched.cost_model.batch_latency(cap, cap * mean_len, cap * mean_len * mean_len)
    rate = load * cap / full
    t = 0.0
    busy_until = 0.0
    wake: float | None = None
    running = None
    t0 = CLOCK()
    for i in range(n):
        t += rnd.expovariate(rate)
        # events before this arrival: the batch end and the scheduler's wake-ups, in time order
        while True:
            done = busy_until if running is not None else None
            nxt = min((x for x in (done, wake) if x is not None and x <= t), default=None)
            if nxt is None:
                break
            if running is not None and busy_until == nxt:
                sched.on_batch_done(running, nxt, running.predicted_s)
                running = None
            out = sched.schedule(nxt, 0 if running is not None else 1)
            wake = out.wake_at
            if out.batches:
                running = out.batches[0]
                busy_until = nxt + running.predicted_s
        sched.submit(Request(i, t, lengths[i]), t)
        out = sched.schedule(t, 0 if running is not None else 1)
        wake = out.wake_at
        if out.batches:
            running = out.batches[0]
            busy_until = t + running.predicted_s
    return (CLOCK() - t0) / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--waiting", type=int, default=10_000)
    ap.add_argument("--batches", type=int, default=500)
    ap.add_argument("--stream", type=int, default=20_000)
    ap.add_argument("--repeat", type=int, default=3, help="report the best of this many runs per figure")
    ap.add_argument("--wall", action="store_true", help="time with perf_counter (wall) instead of CPU time")
    args = ap.parse_args()
    global CLOCK
    if args.wall:
        CLOCK = time.perf_counter
    print(f"scheduling core overhead, {args.waiting} requests waiting, max batch 32, lookahead 4")
    print(f"{'case':<30} {'schedule us/req':>16} {'submit us/req':>14} {'stream us/req':>14} "
          f"{'light us/req':>13}")
    cases: list[tuple[str, SchedulerConfig]] = []
    for grouping in ("fifo", "bucket", "sorted", "dp"):
        padding = "bucket" if grouping == "bucket" else "dynamic"
        cases.append((f"window / {grouping}", SchedulerConfig(
            policy=PolicyConfig(name="window"), planner=PlannerConfig(grouping=grouping, padding=padding))))
    for policy in ("static", "backlog", "hybrid", "adaptive", "sla", "aimd"):
        pol = PolicyConfig(name=policy, patience_s=0.005)
        cases.append((f"{policy} / sorted", SchedulerConfig(policy=pol)))
    cases.append(("window / sorted / priority", SchedulerConfig(queue_order="priority")))
    cases.append(("window / sorted / edf", SchedulerConfig(queue_order="edf")))
    worst, worst_stream = 0.0, 0.0
    for name, cfg in cases:
        # Best of --repeat: other jobs on shared cores only ever add time, so the minimum is the
        # closest to what the code itself costs.
        backlog = [backlog_case(cfg, args.waiting, args.batches) for _ in range(args.repeat)]
        per_req, per_submit = min(b[0] for b in backlog), min(b[1] for b in backlog)
        stream = min(stream_case(cfg, args.stream) for _ in range(args.repeat))
        light = min(stream_case(cfg, args.stream, load=0.1) for _ in range(args.repeat))
        worst, worst_stream = max(worst, per_req), max(worst_stream, stream, light)
        print(f"{name:<30} {per_req:>16.2f} {per_submit:>14.2f} {stream:>14.2f} {light:>13.2f}")
    verdict = "meets" if worst <= 20.0 else "MISSES"
    print(f"worst decide+plan: {worst:.2f} us/request ({verdict} the 20 us target)")
    print(f"worst stream: {worst_stream:.2f} us/request = {worst_stream:.1f} s of core time per 1M requests")


if __name__ == "__main__":
    main()
