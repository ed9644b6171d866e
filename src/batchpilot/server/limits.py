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
from dataclasses import dataclass

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


@dataclass(frozen=True)
class QueueBounds:
    """Checked per HTTP request, all inputs together, by the server (``EmbeddingService``): a request is
    refused when the queue is not empty and its inputs would take it over a bound. Per request, not per
    input (the core's ``admission.max_queued_*``), so one large request (2048 inputs are allowed) is
    served when the queue is empty instead of being refused forever, and never half-admitted."""

    max_requests: int
    max_tokens: int
    tokens_per_s: float  # drain rate at the longest inputs, for Retry-After

    def refusal(self, num_waiting: int, waiting_tokens: int, lengths: list[int]) -> str | None:
        if num_waiting == 0:
            return None
        if num_waiting + len(lengths) > self.max_requests:
            return (f"{num_waiting} inputs are waiting and this request adds {len(lengths)} "
                    f"(queue bound {self.max_requests}, from the {SLA_WORD} SLA)")
        if waiting_tokens + sum(lengths) > self.max_tokens:
            return (f"{waiting_tokens} tokens are waiting and this request adds {sum(lengths)} "
                    f"(queue bound {self.max_tokens} tokens, from the {SLA_WORD} SLA)")
        return None

    def retry_after_s(self, waiting_tokens: int) -> float:
        return max(1.0, waiting_tokens / max(self.tokens_per_s, 1e-6))


SLA_WORD = "latency"


def queue_bounds(cfg: SchedulerConfig, cost_model: CostModel, enabled: bool = True) -> QueueBounds | None:
    """The server's SLA queue bounds, unless disabled or the config sets its own admission limits."""
    adm = cfg.admission
    if not enabled or adm.max_queued_requests or adm.max_queued_tokens or adm.rate:
        return None
    max_requests, max_tokens = sla_queue_bounds(cfg, cost_model)
    max_len = min(cfg.planner.max_len, cfg.admission.max_length)
    n, s = _best_batch(cfg, cost_model, max_len, cfg.policy.sla_s * BATCH_SHARE)
    return QueueBounds(max_requests, max_tokens, n * max_len / max(s, 1e-6) * cfg.num_slots)


def apply(cfg: SchedulerConfig, cost_model: CostModel, enabled: bool = True) -> SchedulerConfig:
    """Fill the batch memory budget when the config leaves it unlimited (0)."""
    if not enabled or cfg.planner.max_batch_memory_bytes:
        return cfg
    planner = dataclasses.replace(cfg.planner, max_batch_memory_bytes=default_memory_budget_bytes())
    return dataclasses.replace(cfg, planner=planner)


def describe(cfg: SchedulerConfig, bounds: QueueBounds | None) -> str:
    a, p = cfg.admission, cfg.planner
    mem = f"{p.max_batch_memory_bytes / 2**20:.0f} MiB" if p.max_batch_memory_bytes else "none"
    if bounds is not None:
        queue = (f"queue <= {bounds.max_requests} inputs / {bounds.max_tokens} tokens per request "
                 f"(SLA {cfg.policy.sla_s:g} s)")
    else:
        queue = f"queue <= {a.max_queued_requests or 'inf'} inputs / {a.max_queued_tokens or 'inf'} tokens"
    return f"limits: {queue}, rate {a.rate or 'inf'}/s, batch memory budget {mem}"
