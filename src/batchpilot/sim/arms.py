"""A deployment served in arms, simulated: each request goes to the arm the server would give it
(``core.rollout.arm_for`` on its client key), and each arm's rows run through that arm's own resolved
deployment, as each arm runs its own scheduler and slots live.

    keys = client_keys(len(workload), clients=200, seed=0)      # what `bench ab` sends as X-Client-Id
    runs = simulate_arms(workload, keys, primary, rollout, cost_model, limits)   # {arm: SimRun}

    batchpilot simulate --config a.yaml --canary b.yaml --canary-share 0.5 --clients 200

(``simulate`` with a config whose ``arms:`` section has candidates, or with ``--canary``, reports each
arm and its P50/P99 ratios to the primary.)

What it does not model: arms sharing one machine's cores. Where batches wait on a device (or on a
fixed delay, as the no-op model's do) the arms are independent and this is the prediction; on a
CPU-bound model every arm's batches also slow the others'.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from batchpilot.core.costmodel import CostModel
from batchpilot.core.deployment import DeploymentSpec, ModelLimits, resolve_deployment
from batchpilot.core.rollout import RolloutSpec, arm_for
from batchpilot.sim.metrics import SimReport
from batchpilot.sim.service import ServiceModel
from batchpilot.sim.target import SimRun, simulate_encoder
from batchpilot.sim.traces import Workload


def client_keys(n: int, clients: int, seed: int = 0) -> list[str]:
    """``n`` requests from ``clients`` clients drawn uniformly with ``seed``: ``client-<k>``."""
    if clients < 1:
        raise ValueError(f"clients must be >= 1, got {clients}")
    return [f"client-{k}" for k in np.random.default_rng(seed).integers(0, clients, n)]


def assign(keys: Sequence[str], rollout: RolloutSpec) -> np.ndarray:
    """The arm index of each request, as the server assigns it (no rollback)."""
    shares = rollout.shares()
    return np.array([arm_for(k, shares, 0.0) for k in keys], dtype=np.int64)


def simulate_arms(workload: Workload, keys: Sequence[str], primary: DeploymentSpec, rollout: RolloutSpec,
                  cost_model: CostModel, limits: ModelLimits | None = None,
                  service: ServiceModel | None = None) -> dict[str, SimRun]:
    """Each arm's rows through its own deployment (arms with no rows are left out)."""
    if len(keys) != len(workload):
        raise ValueError(f"{len(keys)} client keys for {len(workload)} workload rows")
    arms = assign(keys, rollout)
    specs = [primary, *(a.spec for a in rollout.arms)]
    out = {}
    for i, (name, spec) in enumerate(zip(rollout.names(), specs, strict=True)):
        rows = arms == i
        if not rows.any():
            continue
        sub = Workload.from_columns(f"{workload.name}/{name}", workload.arrival_s[rows],
                                    workload.input_tokens[rows], workload.output_tokens[rows],
                                    workload.priority[rows])
        scheduler = resolve_deployment(spec, cost_model, limits).scheduler
        out[name] = simulate_encoder(sub, scheduler, cost_model, service=service)
    return out


def arms_table(workload: Workload, rollout: RolloutSpec, reports: dict[str, SimReport], clients: int) -> Any:
    """Each arm's report beside its share, with its P99 over the primary's (``simulate`` with arms)."""
    from rich.table import Table

    t = Table(title=f"{workload.name}: {len(workload)} requests from {clients} clients over "
                    f"{len(rollout.names())} arms", header_style="bold")
    for col in ("arm", "share", "requests", "P50 ms", "P99 ms", "P99 vs primary", "goodput req/s",
                "mean batch", "padding"):
        t.add_column(col, justify="right")
    base = reports.get("primary")
    for arm, share in zip(rollout.names(), rollout.shares(), strict=True):
        r = reports.get(arm)
        if r is None:
            t.add_row(arm, f"{share:.2f}", "0", *["-"] * 6)
            continue
        ratio = f"{r.latency['p99'] / base.latency['p99']:.2f}x" if base and base.latency["p99"] else "-"
        t.add_row(arm, f"{share:.2f}", f"{r.num_measured:,}", f"{r.latency['p50'] * 1e3:.1f}",
                  f"{r.latency['p99'] * 1e3:.1f}", ratio, f"{r.goodput_rps:.2f}", f"{r.mean_batch_size:.2f}",
                  f"{r.padding_efficiency:.1%}")
    return t
