"""In-process Batcher overhead with a no-op model: requests per second through submit -> batch -> result.

    .venv/bin/python benchmarks/batcher_overhead.py [--requests 200000] [--batch 256] [--uvloop]

Every variant runs in one process, one after the other, so the ratios between them are the result
(the machine is shared and its absolute speed varies run to run):

* ``bare futures``  — asyncio's own cost: create a future per item and resolve it, no batching;
* ``core alone``    — the scheduling core without asyncio: ``submit`` + ``schedule`` + ``on_batch_done``
                      in a plain loop (FIFO config): the ceiling any driver of that core can reach;
* ``submit_nowait`` — the Batcher's bulk path (no task per request), FIFO grouping;
* ``submit (tasks)``— one ``await batcher.submit()`` task per request, as a server handler would;
* ``default config``— ``submit_nowait`` with the default SchedulerConfig (hybrid policy, sorted grouping).

Target (issue 4): >= 50k requests/s through the Batcher with a no-op model.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Callable, Coroutine
from typing import Any

from batchpilot.core.config import PlannerConfig, PolicyConfig, SchedulerConfig
from batchpilot.core.request import Request
from batchpilot.core.scheduler import BatchScheduler
from batchpilot.runtime.batcher import Batcher
from batchpilot.runtime.executor import CallableExecutor


def fifo_config(batch: int) -> SchedulerConfig:
    return SchedulerConfig(policy=PolicyConfig(name="window", max_batch_size=batch, max_wait_s=0.0),
                           planner=PlannerConfig(grouping="fifo"))


def default_config(batch: int) -> SchedulerConfig:
    return SchedulerConfig(policy=PolicyConfig(max_batch_size=batch))


def echo(xs: list[Any]) -> list[Any]:
    return xs


async def bare(n: int, batch: int) -> None:
    loop = asyncio.get_running_loop()
    futs = [loop.create_future() for _ in range(n)]

    def resolve(lo: int) -> None:
        for i in range(lo, min(lo + batch, n)):
            futs[i].set_result(i)

    for lo in range(0, n, batch):
        loop.call_soon(resolve, lo)
    await asyncio.gather(*futs)


async def core_alone(n: int, batch: int) -> None:
    sched = BatchScheduler(fifo_config(batch))
    now = time.monotonic()
    for i in range(n):
        sched.submit(Request(i, now, 1 + i % 100), now)
    while sched.num_waiting:
        for b in sched.schedule(now, 1).batches:
            sched.on_batch_done(b, now, 0.0)


async def nowait(n: int, batch: int, cfg: Callable[[int], SchedulerConfig], window: int) -> None:
    b = Batcher(CallableExecutor(echo), cfg(batch))
    for lo in range(0, n, window):  # waves of `window` requests in flight, as a busy server holds
        out = await asyncio.gather(*[b.submit_nowait(i, 1 + i % 100) for i in range(lo, min(lo + window, n))])
        assert out[-1] == min(lo + window, n) - 1
    await b.shutdown()


async def tasks(n: int, batch: int, window: int) -> None:
    b = Batcher(CallableExecutor(echo), fifo_config(batch))
    for lo in range(0, n, window):
        out = await asyncio.gather(*(b.submit(i, 1 + i % 100) for i in range(lo, min(lo + window, n))))
        assert out[-1] == min(lo + window, n) - 1
    await b.shutdown()


def measure(label: str, n: int, make: Callable[[], Coroutine[Any, Any, None]], use_uvloop: bool) -> float:
    runner: Any = asyncio.run
    if use_uvloop:
        import uvloop

        runner = uvloop.run
    t0 = time.perf_counter()
    runner(make())
    rate = n / (time.perf_counter() - t0)
    print(f"  {label:<34} {rate:>10,.0f} req/s")
    return rate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=200_000)
    ap.add_argument("--batch", type=int, default=256, help="max batch size")
    ap.add_argument("--repeats", type=int, default=3, help="best of N per variant")
    ap.add_argument("--window", type=int, default=4096, help="requests in flight at once (waves)")
    ap.add_argument("--uvloop", action="store_true", help="run on uvloop (what uvicorn uses when installed)")
    args = ap.parse_args()
    n, bs, w = args.requests, args.batch, args.window
    loop_name = "uvloop" if args.uvloop else "asyncio"
    print(f"Batcher overhead: {n:,} requests in waves of {w}, max batch {bs}, no-op model, {loop_name}, "
          f"best of {args.repeats}")
    variants: list[tuple[str, Callable[[], Coroutine[Any, Any, None]]]] = [
        ("bare futures (asyncio floor)", lambda: bare(n, bs)),
        ("core alone (no asyncio), fifo", lambda: core_alone(n, bs)),
        ("Batcher submit_nowait, fifo", lambda: nowait(n, bs, fifo_config, w)),
        ("Batcher submit (task per request)", lambda: tasks(n, bs, w)),
        ("Batcher submit_nowait, default cfg", lambda: nowait(n, bs, default_config, w)),
    ]
    best: dict[str, float] = {}
    for _ in range(args.repeats):  # interleaved, so drift in machine load hits every variant alike
        for label, make in variants:
            best[label] = max(best.get(label, 0.0), measure(label, n, make, args.uvloop))
    print("best:")
    core = best["core alone (no asyncio), fifo"]
    for label, rate in best.items():
        print(f"  {label:<34} {rate:>10,.0f} req/s  ({rate / core:.2f}x core alone, "
              f"{rate / 50_000:.2f}x the 50k target)")


if __name__ == "__main__":
    main()
