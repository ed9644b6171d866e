"""An encoder executor that falls back: batches run on ``primary`` (the padding-free, lean or low-precision
path) and, once it has failed repeatedly, on ``fallback`` (the plain padded fp32 path of the same model)
until a probe batch finds the primary healthy again (the circuit breaker of ``core.breaker``).

A batch that fails on the primary is run again on the fallback at once: if the fallback answers, the
primary's path was at fault (one failure on the breaker; the batch's requests get the fallback's
results); if the fallback fails too, the input is (a poison request), and the primary's exception goes
to the Batcher, which bisects as usual: a bad input never opens the breaker. While the breaker is open
every batch goes to the fallback, padded (a padding-free batch is given ``dynamic`` padding to its
longest input); when the probe is due one batch tries the primary, and its success closes the breaker.
Everything else (``tokenize``, ``model_name``, ``dim``, ``max_length``, ...) is the primary's.
``prepare`` and ``run`` may run on different threads: the breaker is behind a lock.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from batchpilot.core.breaker import BreakerConfig, CircuitBreaker
from batchpilot.core.scheduler import Batch

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
