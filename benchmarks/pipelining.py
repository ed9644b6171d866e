"""Does pipelining pay? The Batcher with and without collating the next batch beside the running one.

    .venv/bin/python benchmarks/pipelining.py [--requests 600] [--rounds 3] [--padding dynamic]

In-process, the real all-MiniLM-L6-v2 executor, the default scheduler config: a saturating closed
burst (every conv-embed text, real lengths, submitted at once, so a batch is always waiting while
another runs: the case pipelining is for). The same Batcher settings run with ``pipeline=True`` (the
slot's prepare thread collates batch N+1 while batch N runs) and ``pipeline=False`` (collation after
the run, on the slot's idle path), taking turns round by round. Printed: requests per second of each,
their ratio, and the mean collation and run time per batch (the most pipelining can save is the
collation's share of a batch). Texts are tokenised once up front; both variants get the same ones.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

import numpy as np

from batchpilot.core.batch import Batch
from batchpilot.core.config import PlannerConfig, SchedulerConfig
from batchpilot.runtime.batcher import Batcher


class Timed:
    """The executor, with its prepare and run times recorded."""

    def __init__(self, executor: Any) -> None:
        self.executor = executor
        self.prepare_s: list[float] = []
        self.run_s: list[float] = []

    def prepare(self, batch: Batch) -> Any:
        t0 = time.perf_counter()
        out = self.executor.prepare(batch)
        self.prepare_s.append(time.perf_counter() - t0)
        return out

    def run(self, prepared: Any) -> list[Any]:
        t0 = time.perf_counter()
        out = self.executor.run(prepared)
        self.run_s.append(time.perf_counter() - t0)
        return list(out)


async def burst(ex: Timed, cfg: SchedulerConfig, ids: list[list[int]], pipeline: bool) -> float:
    batcher = Batcher(ex, cfg, pipeline=pipeline)
    t0 = time.perf_counter()
    futures = batcher.submit_group_nowait(ids, [len(x) for x in ids])  # one admission, every input
    await asyncio.gather(*futures)
    took = time.perf_counter() - t0
    await batcher.shutdown()
    return len(ids) / took


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=600)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--padding", default="dynamic", choices=["dynamic", "none", "bucket", "max"])
    args = ap.parse_args()

    from batchpilot.bench.loadgen import build_plan
    from batchpilot.models.encoder import EncoderExecutor
    from batchpilot.sim.traces import load_workload

    executor = EncoderExecutor()
    wl = load_workload("conv-embed", start=0, count=args.requests)
    texts = [p.body["input"] for p in build_plan(wl, tokenizer=executor.tokenizer)]
    ids = executor.tokenize(texts, truncate=True)
    cfg = SchedulerConfig(planner=PlannerConfig(padding=args.padding))  # type: ignore[arg-type]
    asyncio.run(burst(Timed(executor), cfg, ids[:64], True))  # warm-up
    rates: dict[bool, list[float]] = {True: [], False: []}
    timed = {True: Timed(executor), False: Timed(executor)}
    for rnd in range(args.rounds):
        for pipeline in ((True, False) if rnd % 2 == 0 else (False, True)):
            rates[pipeline].append(asyncio.run(burst(timed[pipeline], cfg, ids, pipeline)))
            print(f"  round {rnd} pipeline={pipeline!s:5} {rates[pipeline][-1]:7.1f} req/s", flush=True)
    on, off = float(np.median(rates[True])), float(np.median(rates[False]))
    prep = float(np.mean(timed[True].prepare_s + timed[False].prepare_s)) * 1e3
    run = float(np.mean(timed[True].run_s + timed[False].run_s)) * 1e3
    print(f"median of {args.rounds}: pipelined {on:.1f} req/s, not pipelined {off:.1f} req/s "
          f"= {on / off:.3f}x; per batch: collation {prep:.2f} ms, run {run:.1f} ms "
          f"({prep / run:.1%} of a run), padding {args.padding}")


if __name__ == "__main__":
    main()
