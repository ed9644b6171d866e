"""Hooks the Batcher calls at each step of a request's life, so metrics live outside the driver.

The server's Prometheus metrics subclass this; the default does nothing. Every hook runs on the event
loop thread and must be cheap (it sits on the per-request path).
"""

from __future__ import annotations

from batchpilot.core.request import Request
from batchpilot.core.scheduler import Batch, RejectReason


class BatcherObserver:
    def on_admit(self, request: Request) -> None:
        """The scheduler accepted the request into its queue."""

    def on_reject(self, reason: RejectReason) -> None:
        """Rejected at admission, dropped from the queue (expired deadline) or failed at shutdown."""

    def on_dispatch(self, batch: Batch, now: float) -> None:
        """A batch left the queue (queue time of each request is ``now - request.arrival``)."""

    def on_batch_done(self, batch: Batch, run_s: float, ok: bool) -> None:
        """An executor call finished; ``run_s`` is its wall time (bisection retries report too)."""

    def on_request_done(self, request: Request, latency_s: float, ok: bool) -> None:
        """A request's result or error was delivered; ``latency_s`` is from arrival to delivery."""

    def on_cancel(self, request: Request, queued: bool) -> None:
        """The caller gave up; ``queued``: removed before execution (else its result is discarded)."""

    def on_slot_busy(self, slot: int, busy: bool) -> None:
        """A slot started or stopped executing (for utilisation)."""

    def on_health(self, state: str) -> None:
        """The Batcher's health changed: ok, degraded, draining or stopped."""
