"""Live conv-embed on the real MiniLM: dispatch policies vs the fixed-window baseline, and the headline
goodput of the default config vs the same server with batching off (max batch size 1), side by side.

    .venv/bin/python benchmarks/live_policies.py [--count 220] [--scales 2 3] [--profile profile.json]
    .venv/bin/python benchmarks/live_policies.py --headline-only

An in-process open-loop replay: the standard conv-embed workload (sim/traces.py: Azure 2023 arrivals,
lengths clip(round(ContextTokens/8), 4, 512), real English texts of exactly that many tokens) is
submitted to a fresh ``Batcher`` over the real ``EncoderExecutor`` at each arrival time, sped up
``scale`` times. Texts are tokenised once up front (the server does it per request in a thread, equally
for every config). Latency is measured from the *scheduled* arrival, so a stalled sender cannot hide
queueing (no coordinated omission). In the goodput search a run stops early once more requests have
exceeded the SLA than a P99 <= SLA allows (the verdict cannot change), which keeps overloaded runs short;
the policy table runs every request to the end.

Goodput (docs/design.md) = the highest rate at which P99 <= 1 s. The headline searches it upward over
``--goodput-scales`` for both configs, interleaved, so machine-load drift hits both alike.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import math
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from batchpilot.core.config import PlannerConfig, PolicyConfig, SchedulerConfig  # noqa: E402
from batchpilot.core.costmodel import CostModel  # noqa: E402
from batchpilot.core.deployment import DeploymentSpec, ModelLimits, resolve_deployment  # noqa: E402
from batchpilot.runtime.batcher import Batcher  # noqa: E402
from batchpilot.runtime.errors import RequestRejected  # noqa: E402


def configs(names: list[str]) -> dict[str, SchedulerConfig]:
    base = SchedulerConfig()
    out = {"fixed-window (baseline)": SchedulerConfig(
        policy=PolicyConfig(name="window", max_batch_size=32, max_wait_s=0.010),
        planner=PlannerConfig(grouping="fifo", padding="dynamic"))}
    for name in names:
        label = f"{name} (default)" if name == base.policy.name else name
        policy = dataclasses.replace(base.policy, name=name)  # type: ignore[arg-type]
        out[label] = dataclasses.replace(base, policy=policy)
    out["default, padding none"] = dataclasses.replace(base, planner=dataclasses.replace(base.planner,
                                                                                         padding="none"))
    out["max batch size 1"] = batching_off(base)
    return out


def batching_off(cfg: SchedulerConfig) -> SchedulerConfig:
    return dataclasses.replace(cfg, policy=dataclasses.replace(cfg.policy, max_batch_size=1))


@dataclass
class Run:
    label: str
    scale: float
    rate: float
    n: int
    done: int
    p50: float
    p99: float
    mean_batch: float
    padding_eff: float
    aborted: bool

    def ok(self, sla: float) -> bool:
        return not self.aborted and self.done == self.n and self.p99 <= sla


async def replay(executor: Any, cfg: SchedulerConfig, cost: CostModel, arrivals: np.ndarray,
                 ids: list[list[int]], scale: float, sla: float, label: str,
                 stop_early: bool = True, grace_s: float = 30.0) -> Run:
    batcher = Batcher(executor, cfg, cost)
    loop = asyncio.get_running_loop()
    n = len(ids)
    # P99 (numpy's linear interpolation) > SLA once the sample at floor(0.99 (n-1)) exceeds it
    allowed_over = n - math.floor(0.99 * (n - 1)) - 1
    lat = np.full(n, np.nan)
    start = loop.time() + 0.05
    due = start + arrivals / scale
    over = 0
    abort = asyncio.Event()

    async def one(i: int) -> None:
        nonlocal over
        try:
            await batcher.submit(ids[i], len(ids[i]))
            lat[i] = loop.time() - due[i]
        except RequestRejected:
            lat[i] = math.inf
        if lat[i] > sla:
            over += 1
            if over > allowed_over and stop_early:
                abort.set()

    async def watchdog() -> None:  # in-flight requests already past the SLA count too
        while not abort.is_set():
            now = loop.time()
            late = over + int(np.sum((due < now - sla) & np.isnan(lat)))
            if late > allowed_over and stop_early:
                abort.set()
            await asyncio.sleep(0.1)

    async def sender() -> None:
        for i in range(n):
            delay = due[i] - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.add(asyncio.ensure_future(one(i)))

    tasks: set[asyncio.Task[None]] = set()
    dog = asyncio.ensure_future(watchdog())
    send = asyncio.ensure_future(sender())
    await send
    waiter = asyncio.ensure_future(asyncio.gather(*tasks))
    # after the last arrival, a run gets at most `grace_s` more to finish (an overloaded queue may take
    # minutes); what is left then counts as not done and the P99 is reported as unbounded
    await asyncio.wait({waiter, asyncio.ensure_future(abort.wait())}, timeout=grace_s,
                       return_when=asyncio.FIRST_COMPLETED)
    aborted = not waiter.done()
    send.cancel()
    dog.cancel()
    stats = batcher.scheduler.stats
    await batcher.shutdown(drain_timeout=0.0 if aborted else 30.0)
    waiter.cancel()
    for slot in batcher.slots:  # let a batch still running finish before the next run starts
        await loop.run_in_executor(None, slot.run_pool.shutdown, True)
    done = lat[np.isfinite(lat)]
    p50 = float(np.percentile(done, 50)) if len(done) else math.nan
    p99 = float(np.percentile(done, 99)) if len(done) else math.nan
    if aborted:
        p99 = math.inf
    return Run(label, scale, n / (arrivals[-1] / scale), n, len(done), p50, p99,
               stats.dispatched / stats.batches if stats.batches else math.nan, stats.padding_efficiency,
               aborted)


def show(r: Run) -> None:
    p99 = "> SLA (stopped)" if r.aborted else f"{r.p99 * 1e3:8.0f} ms"
    print(f"  {r.label:<26} x{r.scale:<4} {r.rate:6.1f} req/s  P50 {r.p50 * 1e3:7.0f} ms  P99 {p99:>15}  "
          f"batch {r.mean_batch:5.1f}  pad-eff {r.padding_eff:5.2f}  done {r.done}/{r.n}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--count", type=int, default=220,
                    help="trace rows (220 ~ the first 60 s, incl. the burst)")
    ap.add_argument("--start", type=int, default=0)
    ap.add_argument("--scales", type=float, nargs="+", default=[2.0, 3.0], help="rates for the policy table")
    ap.add_argument("--policies", nargs="+", default=["backlog", "hybrid", "adaptive", "sla", "aimd"])
    ap.add_argument("--goodput-scales", type=float, nargs="+",
                    default=[1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 8.0])
    ap.add_argument("--headline-only", action="store_true")
    ap.add_argument("--padding-free", action="store_true",
                    help="headline: also the default config with padding 'none' (padding-free batches)")
    ap.add_argument("--table-only", action="store_true")
    ap.add_argument("--profile", default=None, help="cost-model JSON (default: CostModel.default_cpu_minilm)")
    ap.add_argument("--sla", type=float, default=1.0)
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads (default: all cores; on a machine other jobs share, 1 is faster)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    from batchpilot.models.encoder import EncoderConfig, EncoderExecutor
    from batchpilot.models.texts import texts_for_lengths
    from batchpilot.sim.traces import load_workload

    ex = EncoderExecutor(EncoderConfig(num_threads=args.threads))
    ex.warmup()
    cost = CostModel.load(args.profile) if args.profile else CostModel.default_cpu_minilm()
    wl = load_workload("conv-embed", start=args.start, count=args.count)
    texts = texts_for_lengths(ex.tokenizer, [int(x) for x in wl.input_tokens], seed=args.seed)
    ids = ex.tokenize(texts)
    arrivals = np.asarray(wl.arrival_s, dtype=float)
    base_rate = len(ids) / arrivals[-1]
    print(f"conv-embed rows {args.start}..{args.start + len(ids)} ({arrivals[-1]:.0f} s of trace, "
          f"{base_rate:.2f} req/s at x1), {ex.model_name} ({ex.forward_impl} forward, "
          f"{ex.num_threads} threads), "
          f"cost model: {args.profile or 'default_cpu_minilm'}, SLA P99 <= {args.sla:.1f} s")

    def run(label: str, cfg: SchedulerConfig, scale: float, stop_early: bool = True) -> Run:
        # the deployment `serve` would run for this config (core.deployment), on this model
        fitted = resolve_deployment(DeploymentSpec(encoder=cfg), cost,
                                    ModelLimits(ex.max_length, ex.supports_padding_free())).scheduler
        r = asyncio.run(replay(ex, fitted, cost, arrivals, ids, scale, args.sla, label, stop_early))
        show(r)
        return r

    if not args.headline_only:
        print("\npolicies (P50/P99 from scheduled arrival; batch = mean requests per batch; "
              "pad-eff = useful/computed tokens)")
        table = configs(args.policies)
        for scale in args.scales:
            for label, cfg in table.items():
                run(label, cfg, scale, stop_early=False)  # the table reports the real P99
    if args.table_only:
        return
    print("\nheadline: goodput (highest rate with P99 <= SLA), default config vs max batch size 1, "
          "interleaved")
    default = SchedulerConfig()
    contenders = {"default config": default, "max batch size 1": batching_off(default)}
    if args.padding_free:  # the same config with the padding-free executor path (models/ragged.py)
        contenders["default, padding none"] = dataclasses.replace(
            default, planner=dataclasses.replace(default.planner, padding="none"))
    best: dict[str, float] = {k: 0.0 for k in contenders}
    alive = set(contenders)
    for scale in args.goodput_scales:
        for label, cfg in contenders.items():
            if label in alive:
                r = run(label, cfg, scale)
                if r.ok(args.sla):
                    best[label] = r.rate
                else:
                    alive.discard(label)
        if not alive:
            break
    one = best["max batch size 1"]
    for label, good in best.items():
        ratio = f"{good / one:.2f}x max batch size 1" if one else "max batch size 1 passed no scale"
        print(f"goodput: {label:<24} {good:6.1f} req/s  ({ratio})")
    print("target: default config >= 1.5x; a config that passed the last scale tried is capped there")


if __name__ == "__main__":
    main()
