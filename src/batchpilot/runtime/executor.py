"""The executor contract between the live driver and a model, and two executors that need no model.

The Batcher calls, per dispatched ``Batch``:

    prepared = executor.prepare(batch)   # worker thread; overlaps the previous batch's run (collation)
    results  = executor.run(prepared)    # the slot's worker thread; one result per batch.requests, in order

``run`` may also be a coroutine function (``async def run``): the Batcher then awaits it on the event
loop instead of a thread (that is how ``@batch`` wraps async user functions). ``run`` raising means
"something in this batch failed": the Batcher bisects the batch to find the poison request(s). Raising
``ExecutorCrashed`` means "this model instance is broken": the Batcher calls the optional ``recover()``
(health reports degraded meanwhile) and retries the batch once.

Optional members the server uses when present: ``tokenize(texts, truncate)``, ``model_name``, ``dim``,
``max_length``, ``vocab_size``, ``warmup()``.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

from batchpilot.core.scheduler import Batch


@runtime_checkable
class Executor(Protocol):
    def prepare(self, batch: Batch) -> Any:
        """Collate the batch into whatever ``run`` consumes (CPU work; runs in a worker thread)."""
        ...

    def run(self, prepared: Any) -> list[Any]:
        """Execute; one result per request of the batch, same order. Raise on failure."""
        ...


def _check_len(results: Sequence[Any], n: int, what: str) -> list[Any]:
    out = list(results)
    if len(out) != n:
        raise ValueError(f"{what} returned {len(out)} results for a batch of {n}; return one per input")
    return out


class CallableExecutor:
    """Runs ``fn(list_of_payloads) -> list_of_results`` (a plain synchronous callable) in a worker thread."""

    def __init__(self, fn: Callable[[list[Any]], Sequence[Any]]) -> None:
        self.fn = fn

    def prepare(self, batch: Batch) -> list[Any]:
        return [r.payload for r in batch.requests]

    def run(self, prepared: list[Any]) -> list[Any]:
        name = getattr(self.fn, "__name__", "the batch function")
        return _check_len(self.fn(prepared), len(prepared), name)


class AsyncCallableExecutor:
    """Awaits ``async fn(list_of_payloads) -> list_of_results`` on the event loop (no thread)."""

    def __init__(self, fn: Callable[[list[Any]], Awaitable[Sequence[Any]]]) -> None:
        self.fn = fn

    def prepare(self, batch: Batch) -> list[Any]:
        return [r.payload for r in batch.requests]

    async def run(self, prepared: list[Any]) -> list[Any]:
        results = await self.fn(prepared)
        return _check_len(results, len(prepared), getattr(self.fn, "__name__", "the batch function"))


def _word_id(word: str, vocab_size: int) -> int:
    return int.from_bytes(hashlib.blake2b(word.encode(), digest_size=4).digest(), "little") % vocab_size


class NoopExecutor:
    """A model that costs nothing (or a fixed ``delay_s`` per batch): for overhead benchmarks and tests.

    It also plays an encoder for the server: ``tokenize`` maps whitespace-separated words to stable ids
    (one id per word, plus one for an empty text), and ``run`` returns a ``dim``-float vector per input
    (float32 ``[len(ids), 0, 0, ...]``), so the HTTP path is exercised without torch.
    """

    model_name = "noop"

    def __init__(self, dim: int = 8, delay_s: float = 0.0, max_length: int = 512,
                 vocab_size: int = 30522) -> None:
        if dim < 1:
            raise ValueError(f"NoopExecutor: dim must be >= 1, got {dim}")
        if delay_s < 0:
            raise ValueError(f"NoopExecutor: delay_s must be >= 0, got {delay_s}")
        self.dim = dim
        self.delay_s = delay_s
        self.max_length = max_length
        self.vocab_size = vocab_size

    def tokenize(self, texts: list[str], truncate: bool = False) -> list[list[int]]:
        out = []
        for text in texts:
            ids = [_word_id(w, self.vocab_size) for w in text.split()] or [0]
            out.append(ids[: self.max_length] if truncate else ids)
        return out

    def warmup(self) -> None:
        return None

    def prepare(self, batch: Batch) -> list[Any]:
        return [r.payload for r in batch.requests]

    def run(self, prepared: list[Any]) -> list[Any]:
        if self.delay_s:
            time.sleep(self.delay_s)
        out = []
        for p in prepared:
            vec = np.zeros(self.dim, dtype=np.float32)
            vec[0] = len(p) if isinstance(p, list) else 0.0
            out.append(vec)
        return out
