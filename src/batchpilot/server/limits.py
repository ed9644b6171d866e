"""Overload protection the server applies when a config leaves it open: SLA-derived queue bounds and a
batch memory budget.

The bound itself is the core's (``core/overload.py``: how many queued inputs and tokens keep an
admitted request within the SLA, from the cost model), so the simulator can apply the same rule
(``with_sla_queue_bounds``). Here it is checked per HTTP request, all inputs together, with 503 +
Retry-After. An explicit value in the config (or ``--config``) always wins;
``limits.apply(..., enabled=False)`` leaves the config as is.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from ..core.config import SchedulerConfig
from ..core.costmodel import CostModel
from ..core.overload import BATCH_SHARE, best_batch, leaves_queue_open, sla_queue_bounds

__all__ = ["QueueBounds", "apply", "default_memory_budget_bytes", "describe", "queue_bounds",
           "sla_queue_bounds"]

MEMORY_SHARE = 0.25  # default batch memory budget: this share of physical memory


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
    if not enabled or not leaves_queue_open(cfg):
        return None
    max_requests, max_tokens = sla_queue_bounds(cfg, cost_model)
    max_len = min(cfg.planner.max_len, cfg.admission.max_length)
    n, s = best_batch(cfg, cost_model, max_len, cfg.policy.sla_s * BATCH_SHARE)
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
