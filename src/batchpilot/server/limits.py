"""Overload protection the server applies when a config leaves it open: SLA-derived queue bounds and a
batch memory budget.

The core's admission limits are all "0 = unlimited" (``AdmissionConfig``), which is right for the
simulator and for the tuner's search, but a server with an unbounded queue answers overload with
timeouts: at 3x capacity the queue grows for as long as the burst lasts and every request ends up
waiting ``request_timeout_s``. A server must instead refuse early (503 + Retry-After) so the requests
it does admit still finish within the SLA. The bound that achieves it follows from the cost model:

    a request admitted behind Q queued tokens waits about Q / throughput, plus the batch running, the
    one the slot has prepared behind it, and its own: keep that within the SLA
        Q <= (0.8 * sla_s - 3 * batch_s) * throughput     (batch_s <= 0.2 * sla_s)

(the 0.8 leaves slack for the HTTP layer; measured with ``benchmarks/overload_soak.py``, a bound of
half the SLA minus one batch put the admitted P99 at 1.0-1.5 s). We take the *lowest* token throughput
over input lengths (long inputs are the slowest per token), so the bound holds for any length mix.
A request bound covers the per-call cost that dominates very short inputs. An explicit value in the
config (or ``--config``) always wins; ``limits.apply(..., enabled=False)`` leaves the config as is.
"""

from __future__ import annotations

import dataclasses
import os

from ..core.config import SchedulerConfig
from ..core.costmodel import BatchShape, CostModel

TARGET_SHARE = 0.8  # aim admitted latency at 80 % of the SLA (slack for the HTTP layer and noise)
BATCH_SHARE = 0.2  # batches sized to run in at most this share of the SLA
IN_FLIGHT_BATCHES = 3  # besides the queue: the batch running, the one prepared behind it, its own
MEMORY_SHARE = 0.25  # default batch memory budget: this share of physical memory


def _best_batch(cfg: SchedulerConfig, cost_model: CostModel, length: int,
                budget_s: float) -> tuple[int, float]:
    """Largest batch of ``length``-token inputs (<= max_batch_size) predicted to run within ``budget_s``
    (at least 1), and its predicted seconds."""
    best = (1, cost_model.latency(BatchShape.padded([length], length)))
    for n in range(2, cfg.policy.max_batch_size + 1):
        s = cost_model.latency(BatchShape.padded([length] * n, length))
        if s > budget_s:
            break
        best = (n, s)
    return best


def sla_queue_bounds(cfg: SchedulerConfig, cost_model: CostModel) -> tuple[int, int]:
    """``(max_queued_requests, max_queued_tokens)`` that keep an admitted request within ``policy.sla_s``."""
    sla = cfg.policy.sla_s
    max_len = min(cfg.planner.max_len, cfg.admission.max_length)

    def bound(length: int) -> tuple[float, float]:
        """Seconds the queue may hold, and the rate (inputs/s) it drains at, for inputs of ``length``."""
        n, s = _best_batch(cfg, cost_model, length, sla * BATCH_SHARE)
        wait_s = max(sla * TARGET_SHARE - IN_FLIGHT_BATCHES * s, sla * 0.1)
        return wait_s, n / max(s, 1e-6) * cfg.num_slots

    # tokens: lengths where per-token work dominates (short inputs are bounded by the request count)
    lengths = sorted({64, 128, 256, max_len} & set(range(1, max_len + 1))) or [max_len]
    max_tokens = min(wait * rate * length for wait, rate, length in ((*bound(x), x) for x in lengths))
    wait_1, rate_1 = bound(1)
    max_requests = max(int(wait_1 * rate_1), cfg.policy.max_batch_size)
    return max_requests, max(int(max_tokens), max_len)  # one longest input always fits


def default_memory_budget_bytes() -> float:
    """A share of physical memory: one batch may never take the whole machine."""
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) * MEMORY_SHARE
    except (ValueError, OSError, AttributeError):
        return 0.0


def apply(cfg: SchedulerConfig, cost_model: CostModel, enabled: bool = True) -> SchedulerConfig:
    """Fill the limits the config leaves unlimited (0): queue bounds from the SLA, a memory budget."""
    if not enabled:
        return cfg
    adm, planner = cfg.admission, cfg.planner
    if not adm.max_queued_requests and not adm.max_queued_tokens and not adm.rate:
        max_requests, max_tokens = sla_queue_bounds(cfg, cost_model)
        adm = dataclasses.replace(adm, max_queued_requests=max_requests, max_queued_tokens=max_tokens)
    if not planner.max_batch_memory_bytes:
        planner = dataclasses.replace(planner, max_batch_memory_bytes=default_memory_budget_bytes())
    return dataclasses.replace(cfg, admission=adm, planner=planner)


def describe(cfg: SchedulerConfig) -> str:
    a, p = cfg.admission, cfg.planner
    mem = f"{p.max_batch_memory_bytes / 2**20:.0f} MiB" if p.max_batch_memory_bytes else "none"
    return (f"limits: queue <= {a.max_queued_requests or 'inf'} requests / "
            f"{a.max_queued_tokens or 'inf'} tokens "
            f"(SLA {cfg.policy.sla_s:g} s), rate {a.rate or 'inf'}/s, batch memory budget {mem}")
