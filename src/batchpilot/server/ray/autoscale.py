"""Ray Serve autoscaling on batchpilot's own signals: each replica reports its queue depth and
predicted queue wait, and the decision is the core's (``core.autoscale.Autoscaler``).

    replica:    record_autoscaling_stats() -> replica_stats(schedulers, now)
                {batchpilot_queue_length, batchpilot_backlog_seconds, batchpilot_batches_in_flight}
                (``core.autoscale.signal_of`` of every served model's scheduler, summed; the wait is the
                longest of them). The first two are the replica's Prometheus gauges of the same names
                (``server/metrics.py``: ``num_waiting`` and ``predicted_backlog_s(now)``, the predicted
                queue wait), so a dashboard or KEDA sees what the policy sees.
    controller: BatchpilotAutoscalingPolicy(ctx) -> Autoscaler.decide(now, current, signals)
                (one ``ReplicaSignal`` per replica that has reported, from ``ctx.aggregated_metrics``:
                the mean of each key over Serve's look-back window)

The policy is a class so Serve builds it once per deployment (``autoscaling_config.policy``
``policy_function`` + ``policy_kwargs``) and the Autoscaler keeps its delays across ticks. A replica
that has not reported yet (still starting) sends no signal: the core counts it as having no work, and
no signal at all as no information. Nothing here imports Ray: the policy
receives Serve's ``AutoscalingContext`` and reads only its documented attributes.
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Iterable, Mapping
from typing import TYPE_CHECKING, TypeVar

from batchpilot.core.autoscale import AutoscaleConfig, Autoscaler, ReplicaSignal, signal_of
from batchpilot.core.scheduler import BatchScheduler

if TYPE_CHECKING:  # ray is an optional dependency; Serve's controller hands the policy its context
    from ray.serve.config import AutoscalingContext

QUEUE_DEPTH = "batchpilot_queue_length"
PREDICTED_WAIT = "batchpilot_backlog_seconds"
RUNNING = "batchpilot_batches_in_flight"
POLICY_PATH = "batchpilot.server.ray.autoscale:BatchpilotAutoscalingPolicy"
Replica = TypeVar("Replica", bound=Hashable)  # Serve's replica id


def replica_stats(schedulers: Iterable[BatchScheduler], now: float) -> dict[str, float]:
    """What one replica reports: the signals of the schedulers it runs, as one replica's signal."""
    signals = [signal_of(s, now) for s in schedulers]
    return {QUEUE_DEPTH: float(sum(s.queue_depth for s in signals)),
            PREDICTED_WAIT: float(max((s.predicted_wait_s for s in signals), default=0.0)),
            RUNNING: float(sum(s.running for s in signals))}


def signals_from(metrics: Mapping[str, Mapping[Replica, float]], replicas: Iterable[Replica]
                 ) -> list[ReplicaSignal]:
    """One ``ReplicaSignal`` per running replica that reported, from Serve's aggregated custom metrics."""
    waits = metrics.get(PREDICTED_WAIT, {})

    def value(key: str, replica: Replica) -> float:
        return max(float(metrics.get(key, {}).get(replica, 0.0)), 0.0)

    return [ReplicaSignal(queue_depth=round(value(QUEUE_DEPTH, r)),
                          predicted_wait_s=value(PREDICTED_WAIT, r), running=round(value(RUNNING, r)))
            for r in replicas if r in waits]


class BatchpilotAutoscalingPolicy:
    """Serve's custom autoscaling policy (a callable class): ``policy(ctx) -> (replicas, state)``.
    ``kwargs`` are ``AutoscaleConfig``'s fields (JSON values, from ``policy_kwargs``)."""

    def __init__(self, **kwargs: float) -> None:
        self.config = AutoscaleConfig(**kwargs)
        self.autoscaler = Autoscaler(self.config)

    def __call__(self, ctx: AutoscalingContext) -> tuple[int, dict[str, object]]:
        now = time.monotonic()  # the controller's clock: the delays need one that never goes back
        signals = signals_from(ctx.aggregated_metrics or {}, ctx.running_replicas)
        decision = self.autoscaler.decide(now, ctx.target_num_replicas, signals)
        return decision, dict(ctx.policy_state or {})


def autoscaling_config(min_replicas: int, max_replicas: int, target_queue_wait_s: float,
                       upscale_delay_s: float, downscale_delay_s: float,
                       metrics_interval_s: float = 1.0, look_back_period_s: float = 5.0
                       ) -> dict[str, object]:
    """Serve's ``autoscaling_config`` running ``BatchpilotAutoscalingPolicy``. Serve's own delays are 0:
    the core's Autoscaler holds them (Serve still clamps to min/max)."""
    kwargs = {"min_replicas": min_replicas, "max_replicas": max_replicas,
              "target_queue_wait_s": target_queue_wait_s, "upscale_delay_s": upscale_delay_s,
              "downscale_delay_s": downscale_delay_s}
    AutoscaleConfig(**kwargs)  # validated here, at start-up, not first in the controller
    return {"min_replicas": min_replicas, "max_replicas": max_replicas, "initial_replicas": min_replicas,
            "metrics_interval_s": metrics_interval_s, "look_back_period_s": look_back_period_s,
            "upscale_delay_s": 0.0, "downscale_delay_s": 0.0,
            "policy": {"policy_function": POLICY_PATH, "policy_kwargs": kwargs}}
