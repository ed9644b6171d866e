"""Overload protection the server applies when a config leaves it open: the SLA backlog bound and a
batch memory budget.

The bound itself is the core's (``core/overload.py``: how much predicted work may be ahead of an
admitted input, batches in flight included, within the SLA), so the simulator applies the same rule
(``with_sla_queue_bounds``). Here it is checked per HTTP request, all inputs together, with 503 +
Retry-After. An explicit value in the config (or ``--config``) always wins;
``limits.apply(..., enabled=False)`` leaves the config as is.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from dataclasses import dataclass

from ..core.config import SchedulerConfig
from ..core.costmodel import CostModel
from ..core.overload import leaves_queue_open, sla_backlog_s, work_refusal

__all__ = ["QueueBounds", "apply", "default_memory_budget_bytes", "describe", "queue_bounds",
           "sla_backlog_s"]

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
    refused when the queue is not empty and its inputs' predicted work would take the backlog (batches
    in flight + queued work, ``BatchScheduler.predicted_backlog_s``) over the bound. Per request, not
    per input (the core's ``admission.max_backlog_s``, the same rule ``work_refusal``), so one large
    request (2048 inputs are allowed) is served when the queue is empty instead of being refused
    forever, and never half-admitted."""

    max_backlog_s: float
    work_s: Sequence[float]  # per input length: the core's AdmissionController.work_s

    def refusal(self, num_waiting: int, backlog_s: float, lengths: list[int],
                work_scale: float = 1.0) -> tuple[str, float] | None:
        """None to admit, else why and the Retry-After seconds (``backlog_s`` and ``work_scale`` as the
        scheduler has them: ``predicted_backlog_s``, ``work_scale``)."""
        last = len(self.work_s) - 1
        added = sum(self.work_s[min(x, last)] for x in lengths) * work_scale
        over = work_refusal(self.max_backlog_s, num_waiting, backlog_s, added)
        if not over:
            return None
        return (f"{backlog_s * 1e3:.0f} ms of predicted work is ahead ({num_waiting} inputs waiting) and "
                f"this request adds {added * 1e3:.0f} ms (bound {self.max_backlog_s * 1e3:.0f} ms, from the "
                "latency SLA)", max(1.0, over))


def queue_bounds(cfg: SchedulerConfig, cost_model: CostModel, enabled: bool = True) -> QueueBounds | None:
    """The server's SLA queue bound, unless disabled or the config sets its own admission limits."""
    if not enabled or not leaves_queue_open(cfg):
        return None
    from ..core.admission import AdmissionController

    adm = AdmissionController(cfg.admission, cfg.planner, cost_model, cfg.policy.max_batch_size,
                              cfg.num_slots)
    return QueueBounds(sla_backlog_s(cfg), adm.work_s)


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
        example = bounds.work_s[min(128, len(bounds.work_s) - 1)]
        queue = (f"backlog <= {bounds.max_backlog_s * 1e3:.0f} ms of predicted work per request "
                 f"(SLA {cfg.policy.sla_s:g} s; a 128-token input is {example * 1e3:.1f} ms of it)")
    else:
        work = f"{a.max_backlog_s * 1e3:.0f} ms" if a.max_backlog_s else "inf"
        queue = (f"queue <= {a.max_queued_requests or 'inf'} inputs / {a.max_queued_tokens or 'inf'} "
                 f"tokens, backlog <= {work}")
    return f"limits: {queue}, rate {a.rate or 'inf'}/s, batch memory budget {mem}"
