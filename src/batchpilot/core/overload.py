"""The SLA backlog bound: how much predicted work may be ahead of a request before admitting it would
break the latency SLA.

The core's admission limits are all "0 = unlimited" (``AdmissionConfig``), which is right for the
tuner's search, but a server with an unbounded queue answers overload with timeouts: at 3x capacity
the queue grows for as long as the burst lasts and every request ends up waiting its timeout. A
server must instead refuse early (503 + Retry-After) so the requests it does admit still finish
within the SLA. The bound is in *predicted seconds*, from the cost model:

    backlog = the batches in flight (dispatched, not done: their predicted time)
            + the queue's work (each waiting input: its share of a full batch of its length,
              ``AdmissionController.work_s``), per executor slot
    admit while  backlog + this input's work <= TARGET_SHARE * sla_s  (0.6)

A bound on predicted work follows the length mix and the batches actually running. The token bound it
replaces had to assume the slowest case (in-flight batches and queued tokens all of the longest
inputs), so with MiniLM on one CPU core (a 512-token input takes a quarter of a 1 s SLA) it admitted
~4 queued requests of any length and refused bursts at a fifth of capacity.

The server checks it per HTTP request, all inputs together (``server/limits.py``), the scheduler per
input (``admission.max_backlog_s``, written by ``with_sla_queue_bounds``); both call ``work_refusal``,
so for single-input requests the simulator refuses exactly what the server would.
"""

from __future__ import annotations

import dataclasses

from .config import SchedulerConfig

# Under sustained overload the backlog sits at the bound, so a typical admitted request waits about
# this share of the SLA and the tail runs past it: at 0.8 the soak at 3x capacity (real MiniLM, 2 cores,
# benchmarks/overload_soak.py) put the admitted P50 at 737 ms and the P99 above 1 s.
TARGET_SHARE = 0.6


def sla_backlog_s(cfg: SchedulerConfig) -> float:
    """Predicted seconds of backlog ahead of an admitted input that keep it within ``policy.sla_s`` (the
    cost model prices each input and batch; the bound itself is a share of the SLA)."""
    return cfg.policy.sla_s * TARGET_SHARE


def work_refusal(max_backlog_s: float, num_waiting: int, backlog_s: float, added_work_s: float) -> float:
    """0.0 to admit, else how many seconds of work over the bound admitting would put the backlog (the
    Retry-After hint). An empty queue always admits: one input, or one request, larger than the bound
    alone would otherwise never be served."""
    if not max_backlog_s or not num_waiting:
        return 0.0
    return max(backlog_s + added_work_s - max_backlog_s, 0.0)


def leaves_queue_open(cfg: SchedulerConfig) -> bool:
    """No queue or rate limit of the config's own: the SLA bound applies (an explicit limit always wins)."""
    adm = cfg.admission
    return not (adm.max_queued_requests or adm.max_queued_tokens or adm.max_backlog_s or adm.rate)


def with_sla_queue_bounds(cfg: SchedulerConfig) -> SchedulerConfig:
    """``cfg`` with the SLA bound as its ``admission.max_backlog_s``, when it sets no limit of its own."""
    if not leaves_queue_open(cfg):
        return cfg
    adm = dataclasses.replace(cfg.admission, max_backlog_s=sla_backlog_s(cfg))
    return dataclasses.replace(cfg, admission=adm)
