"""The executor contract between the live driver and a model, and two executors that need no model.

The Batcher calls, per dispatched ``Batch``:

    prepared = executor.prepare(batch)   # worker thread; overlaps the previous batch's run (collation)
    results  = executor.run(prepared)    # the slot's worker thread; one result per batch.requests, in order

``run`` may also be a coroutine function (``async def run``): the Batcher then awaits it on the event
loop instead of a thread (that is how ``@batch`` wraps async user functions). ``run`` raising means
"something in this batch failed": the Batcher bisects the batch to find the poison request(s). Raising
``ExecutorCrashed`` means "this model instance is broken": the Batcher calls the optional ``recover()``
(health reports degraded meanwhile) and retries the batch once.

What the server reads of a model's executor beyond this contract is declared below: ``ModelExecutor``
(every executor it serves), ``CheckpointExecutor`` (a checkpoint on torch) and ``EncoderPath`` (what an
embedding model chose at load). A ``FallbackExecutor`` answers for its primary (``primary_of``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np

from batchpilot.core.batch import Batch
from batchpilot.core.breaker import BreakerConfig, CircuitBreaker

if TYPE_CHECKING:
    import torch

    from batchpilot.models.encoder import ThreadPlan
    from batchpilot.models.precision import PrecisionReport


@runtime_checkable
class Executor(Protocol):
    def prepare(self, batch: Batch) -> Any:
        """Collate the batch into whatever ``run`` consumes (CPU work; runs in a worker thread)."""
        ...

    def run(self, prepared: Any) -> list[Any]:
        """Execute; one result per request of the batch, same order. Raise on failure."""
        ...


@runtime_checkable
class ModelExecutor(Executor, Protocol):
    """An executor the server serves (``models.tasks.load_model``'s, ``NoopExecutor``): its name, the
    task whose routes answer it (embed, score, classify), its output width and input limit."""

    model_name: str
    task: str
    dim: int
    max_length: int

    def supports_padding_free(self) -> bool:
        """Whether it runs ``padding: none`` batches (else the deployment pads them per batch)."""
        ...

    def warmup(self) -> None:
        ...


@runtime_checkable
class CheckpointExecutor(ModelExecutor, Protocol):
    """A checkpoint loaded on torch (not the no-op model): the folder it came from, the device whose
    memory its batch budget is a share of, its intra-op threads."""

    model_path: str | None
    device: torch.device
    num_threads: int


@runtime_checkable
class EncoderPath(Protocol):
    """What an embedding model chose at load (``models.tasks.load_model``): the precision the accuracy
    guard passed, the per-batch thread plan (None: the pool as set), the backend and the forward it runs.
    A cross-encoder has none of these: it runs float32 on torch's HF forward."""

    precision: PrecisionReport
    threads: ThreadPlan | None
    backend: str
    forward_impl: str


def primary_of(executor: Executor) -> Executor:
    """The executor whose model answers: a ``FallbackExecutor``'s primary (the fallback only stands in for
    it), else ``executor`` itself."""
    return executor.primary if isinstance(executor, FallbackExecutor) else executor


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
    task = "embed"

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

    def supports_padding_free(self) -> bool:
        return True  # it reads only the token ids: a batch's padding costs it nothing

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


# An encoder executor that falls back: batches run on ``primary`` (the padding-free, lean or low-precision
# path) and, once it has failed repeatedly, on ``fallback`` (the plain padded fp32 path of the same model)
# until a probe batch finds the primary healthy again (the circuit breaker of ``core.breaker``).
#
# A batch that fails on the primary is run again on the fallback at once: if the fallback answers, the
# primary's path was at fault (one failure on the breaker; the batch's requests get the fallback's
# results); if the fallback fails too, the input is (a poison request), and the primary's exception goes
# to the Batcher, which bisects as usual: a bad input never opens the breaker. While the breaker is open
# every batch goes to the fallback, padded (a padding-free batch is given ``dynamic`` padding to its
# longest input); when the probe is due one batch tries the primary, and its success closes the breaker.
# Everything else (``tokenize``, ``model_name``, ``dim``, ``max_length``, ...) is the primary's.
# ``prepare`` and ``run`` may run on different threads: the breaker is behind a lock.

log = logging.getLogger("batchpilot.runtime")


@dataclass
class _Prepared:
    batch: Batch
    on_primary: bool
    data: Any


def padded(batch: Batch) -> Batch:
    """The batch with ``dynamic`` padding to its longest input (a padding-free batch), else as it is."""
    if batch.padding != "none":
        return batch
    return dataclasses.replace(batch, padding="dynamic", padded_len=max(r.length for r in batch.requests))


class FallbackExecutor:
    def __init__(self, primary: Any, fallback: Any, breaker: BreakerConfig | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.primary, self.fallback = primary, fallback
        self.breaker = CircuitBreaker(breaker or BreakerConfig(failure_threshold=3, probe_interval_s=30.0))
        self.clock = clock
        self._lock = threading.Lock()
        self.num_primary_failures = 0  # batches the primary failed and the fallback answered
        self.num_fallback_batches = 0  # batches the fallback ran, retries included

    def __getattr__(self, name: str) -> Any:
        return getattr(self.primary, name)

    @property
    def fallback_active(self) -> bool:
        with self._lock:
            return not self.breaker.allows

    def prepare(self, batch: Batch) -> _Prepared:
        with self._lock:
            now = self.clock()
            on_primary = self.breaker.allows or self.breaker.take_probe(now)
        if on_primary:
            return _Prepared(batch, True, self.primary.prepare(batch))
        return _Prepared(batch, False, self.fallback.prepare(padded(batch)))

    def run(self, prepared: _Prepared) -> list[Any]:
        if not prepared.on_primary:
            self.num_fallback_batches += 1
            return list(self.fallback.run(prepared.data))
        try:
            out = list(self.primary.run(prepared.data))
        except Exception as exc:
            try:
                out = list(self.fallback.run(self.fallback.prepare(padded(prepared.batch))))
            except Exception:
                raise exc from None  # both paths fail on it: the input, not the primary
            self.num_fallback_batches += 1
            self.num_primary_failures += 1
            with self._lock:
                opened = self.breaker.record_failure(self.clock())
            log.warning("encoder batch %d failed on the primary path (%r) and ran on the padded fp32 "
                        "fallback%s", prepared.batch.id, exc,
                        "; the fallback takes every batch until a probe succeeds" if opened else "")
            return out
        with self._lock:
            if self.breaker.record_success(self.clock()):
                log.info("encoder probe batch %d succeeded on the primary path: traffic returns to it",
                         prepared.batch.id)
        return out
