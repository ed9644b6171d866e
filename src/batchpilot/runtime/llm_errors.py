"""Why an LLM request did not (or will not) finish normally. Each has a stable ``code``; the HTTP layer
answers with a fixed message per code, and only ``RequestRejected`` carries a message meant for the
client (what the request asked for and what this engine allows). ``refused`` turns the core's
admission refusal (``core/llm_admission.py``) into the error the engine raises."""

from __future__ import annotations

from batchpilot.core.llm_admission import NEVER_FITS, LLMRefusal


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


class EngineUnavailable(EngineStopped):
    """The engine failed (died, stalled, ran out of memory) and no fallback can take the request; a
    probe of the engine may bring it back (``runtime/llm_failover.py``): retry after ``retry_after_s``."""

    code = "engine_unavailable"

    def __init__(self, message: str = "the LLM engine is unavailable", retry_after_s: float = 5.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class GenerationFailed(RuntimeError):
    """A model step failed for this sequence; the exception itself is in the engine's log, and in
    ``cause`` for the failover to read (never for the client)."""

    code = "generation_failed"

    def __init__(self, message: str = "generation failed", cause: BaseException | None = None) -> None:
        super().__init__(message)
        self.cause = cause

    @property
    def out_of_memory(self) -> bool:
        """The step ran out of memory (``torch.OutOfMemoryError`` or a RuntimeError saying so)."""
        return is_out_of_memory(self.cause)


def is_out_of_memory(exc: BaseException | None) -> bool:
    """An out-of-memory error of torch (CUDA, MPS, CPU allocator) or of Python itself."""
    if exc is None:
        return False
    if isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError":
        return True
    return isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()


def refused(refusal: LLMRefusal) -> RequestRejected | EngineBusy:
    """The core's refusal as the engine's error: never fits -> ``RequestRejected`` (400, its message
    passed on), a full engine -> ``EngineBusy`` (503 + Retry-After)."""
    if refusal.reason == NEVER_FITS:
        return RequestRejected(refusal.message)
    return EngineBusy(refusal.message, refusal.retry_after_s or 1.0)
