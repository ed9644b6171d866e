"""Why an LLM request did not (or will not) finish normally. Each has a stable ``code``; the HTTP layer
answers with a fixed message per code, and only ``RequestRejected`` carries a message meant for the
client (what the request asked for and what this engine allows)."""

from __future__ import annotations


class RequestRejected(ValueError):
    """The request can never run here (context length, KV pool, bad token ids); the message says why.
    ``code`` and ``param`` are for the OpenAI error body."""

    def __init__(self, message: str, code: str = "context_length_exceeded",
                 param: str | None = "max_tokens") -> None:
        super().__init__(message)
        self.code = code
        self.param = param


class EngineStopped(RuntimeError):
    """The engine is not running (shut down, or its loop died): nothing more will be generated."""

    code = "engine_stopped"

    def __init__(self, message: str = "the LLM engine is not running") -> None:
        super().__init__(message)


class EngineBusy(RuntimeError):
    """The engine holds as many sequences as it may queue: retry later."""

    code = "queue_full"

    def __init__(self, message: str = "the LLM engine's queue is full", retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class RequestTimedOut(TimeoutError):
    """The sequence passed its deadline; the engine aborted it and freed its KV blocks."""

    code = "timeout"

    def __init__(self, message: str = "the request passed its deadline") -> None:
        super().__init__(message)


class GenerationFailed(RuntimeError):
    """A model step failed for this sequence; the exception itself is in the engine's log."""

    code = "generation_failed"

    def __init__(self, message: str = "generation failed") -> None:
        super().__init__(message)
