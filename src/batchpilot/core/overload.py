"""SLA-derived queue bounds: how much work may wait before admitting more would break the latency SLA.

The core's admission limits are all "0 = unlimited" (``AdmissionConfig``), which is right for the
tuner's search, but a server with an unbounded queue answers overload with timeouts: at 3x capacity
the queue grows for as long as the burst lasts and every request ends up waiting its timeout. A
server must instead refuse early (503 + Retry-After) so the requests it does admit still finish
within the SLA. The bound follows from the cost model:

    a request admitted behind Q queued tokens waits about Q / throughput, plus the batch running, the
    one the slot has prepared behind it, and its own: keep that within the SLA
        Q <= (0.8 * sla_s - 3 * batch_s) * throughput     (batch_s <= 0.2 * sla_s)

(the 0.8 leaves slack for the HTTP layer; measured with ``benchmarks/overload_soak.py``, a bound of
half the SLA minus one batch put the admitted P99 at 1.0-1.5 s). It takes the *lowest* token
throughput over input lengths (long inputs are the slowest per token), so the bound holds for any
length mix; a request bound covers the per-call cost that dominates very short inputs.

The server applies it per HTTP request (``server/limits.py``); ``with_sla_queue_bounds`` writes it
into a config's admission limits, which is the same rule for single-input requests, so the simulator
refuses exactly what the server would.
"""

from __future__ import annotations

import dataclasses

from .config import SchedulerConfig
from .costmodel import BatchShape, CostModel

TARGET_SHARE = 0.8  # aim admitted latency at 80 % of the SLA (slack for the HTTP layer and noise)
BATCH_SHARE = 0.2  # batches sized to run in at most this share of the SLA
IN_FLIGHT_BATCHES = 3  # besides the queue: the batch running, the one prepared behind it, its own


def best_batch(cfg: SchedulerConfig, cost_model: CostModel, length: int,
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
        n, s = best_batch(cfg, cost_model, length, sla * BATCH_SHARE)
        wait_s = max(sla * TARGET_SHARE - IN_FLIGHT_BATCHES * s, sla * 0.1)
        return wait_s, n / max(s, 1e-6) * cfg.num_slots

    # tokens: lengths where per-token work dominates (short inputs are bounded by the request count)
    lengths = sorted({64, 128, 256, max_len} & set(range(1, max_len + 1))) or [max_len]
    max_tokens = min(wait * rate * length for wait, rate, length in ((*bound(x), x) for x in lengths))
    wait_1, rate_1 = bound(1)
    max_requests = max(int(wait_1 * rate_1), cfg.policy.max_batch_size)
    return max_requests, max(int(max_tokens), max_len)  # one longest input always fits


def leaves_queue_open(cfg: SchedulerConfig) -> bool:
    """No queue or rate limit of the config's own: the SLA bounds apply (an explicit limit always wins)."""
    adm = cfg.admission
    return not (adm.max_queued_requests or adm.max_queued_tokens or adm.rate)


def with_sla_queue_bounds(cfg: SchedulerConfig, cost_model: CostModel) -> SchedulerConfig:
    """``cfg`` with the SLA queue bounds as its admission limits, when it sets none of its own."""
    if not leaves_queue_open(cfg):
        return cfg
    max_requests, max_tokens = sla_queue_bounds(cfg, cost_model)
    adm = dataclasses.replace(cfg.admission, max_queued_requests=max_requests, max_queued_tokens=max_tokens)
    return dataclasses.replace(cfg, admission=adm)
