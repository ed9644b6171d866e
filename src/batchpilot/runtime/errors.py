"""Typed failures a caller of the runtime can see, each carrying what a server needs to answer.

``RequestRejected`` wraps the core's ``RejectReason`` (admission, expired deadline, shutdown) with a
``retry_after_s`` hint, so the HTTP layer maps it to 400/429/503/504 without parsing messages.
``ExecutionError`` is what a request gets when the batch it was in raised and bisection proved that this
request is (one of) the poison ones. ``ExecutorCrashed`` is raised *by an executor* to say the model
instance itself is broken (e.g. a CUDA error) and must be recovered before anything else runs on it.
"""

from __future__ import annotations

from batchpilot.core.admission import Rejection, RejectReason


class RequestRejected(Exception):
    """The request was not (or will not be) served; ``reason`` says why, ``retry_after_s`` when to retry."""

    def __init__(self, reason: RejectReason, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.retry_after_s = retry_after_s

    @classmethod
    def from_rejection(cls, rejection: Rejection) -> RequestRejected:
        return cls(rejection.reason, rejection.message, rejection.retry_after_s)

    def __repr__(self) -> str:
        return f"RequestRejected({self.reason.value}: {self.message})"


class ExecutionError(Exception):
    """The executor raised on this request alone (found by bisecting its batch); ``__cause__`` is why."""


class ExecutorCrashed(Exception):
    """Raised by an executor whose model instance is unusable; the runtime calls ``recover()`` and retries."""
