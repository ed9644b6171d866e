"""The tuner's search space: the grid of encoder configs it samples from, and the baselines it always
measures (a static batch padded to the model's max length; fixed windows with dynamic padding, as
TorchServe / Ray Serve / LitServe batch).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from batchpilot.core.config import PlannerConfig, PolicyConfig, SchedulerConfig
from batchpilot.sim.metrics import SimReport

if TYPE_CHECKING:
    from batchpilot.sim.tune import TuneConfig

# (grouping, padding, bucketing method) worth trying: bucket padding needs bucket grouping to pay off,
# and only bucket layouts read the bucketing method
LAYOUTS: tuple[tuple[str, str, str], ...] = (
    ("fifo", "dynamic", "fixed"), ("sorted", "dynamic", "fixed"), ("dp", "dynamic", "fixed"),
    ("bucket", "bucket", "fixed"), ("bucket", "bucket", "quantile"), ("bucket", "bucket", "dp"),
    ("fifo", "none", "fixed"),  # padding-free batches keep queue order whatever the grouping
)
POLICIES: tuple[str, ...] = ("window", "hybrid", "adaptive", "sla")
MAX_BATCH: tuple[int, ...] = (8, 16, 32, 64)
MAX_WAIT_S: tuple[float, ...] = (0.005, 0.02, 0.05, 0.1)
TOKEN_BUDGET: tuple[int, ...] = (0, 8192)


@dataclass
class Candidate:
    label: str
    config: SchedulerConfig
    kind: str = "search"  # search | baseline | default
    capacity: float = 0.0  # rate scale
    rps: float = 0.0  # offered req/s at that scale
    rung: int = -1
    report: SimReport | None = None  # the passing probe at capacity
    probes: list[tuple[float, bool]] = field(default_factory=list)


def baselines(base: SchedulerConfig) -> list[Candidate]:
    max_len = base.planner.max_len
    static = replace(base, policy=PolicyConfig(name="static", max_batch_size=8, max_wait_s=0.1),
                     planner=PlannerConfig(grouping="fifo", padding="max", max_len=max_len))
    out = [Candidate("static bs8, pad to max", static, "baseline")]
    for bs, wait in ((10, 0.01), (32, 0.05)):
        cfg = replace(base, policy=PolicyConfig(name="window", max_batch_size=bs, max_wait_s=wait),
                      planner=PlannerConfig(grouping="fifo", padding="dynamic", max_len=max_len))
        out.append(Candidate(f"window bs{bs} {wait * 1e3:g}ms, dynamic pad", cfg, "baseline"))
    return out


def grid(base: SchedulerConfig, tc: TuneConfig) -> list[Candidate]:
    """Every grid point whose padding mode is allowed, as a labelled config over ``base``."""
    out = []
    for policy, (grouping, padding, method), bs, wait, budget in itertools.product(
            POLICIES, LAYOUTS, MAX_BATCH, MAX_WAIT_S, TOKEN_BUDGET):
        if padding not in tc.paddings:
            continue
        buckets = replace(base.bucketing, method=method)
        pol = replace(base.policy, name=policy, max_batch_size=bs, max_wait_s=wait,
                      min_wait_s=min(base.policy.min_wait_s, wait), sla_s=tc.sla_p99_s,
                      backlog_requests=min(base.policy.backlog_requests, bs))
        plan = replace(base.planner, grouping=grouping, padding=padding, max_batch_tokens=budget)
        label = (f"{policy} bs{bs} {wait * 1e3:g}ms {grouping}/{padding}"
                 + (f"/{method}" if grouping == "bucket" else "") + (f" tok{budget}" if budget else ""))
        out.append(Candidate(label, replace(base, policy=pol, planner=plan, bucketing=buckets)))
    return out
