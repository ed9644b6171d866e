"""Garbage-collector pauses: keep them short, and show them.

A full (generation 2) collection walks every tracked object, and a server that has just loaded torch,
transformers, a tokenizer and a model holds millions: measured on this repo's LLM server (2-core CPU
box), each full collection stopped every thread, the engine's and the event loop's, for 150-240 ms.
One such pause in a burst is a P99 by itself. ``freeze_heap()`` runs once when the server is ready:
it collects what startup left behind and moves every surviving object into the permanent
generation, so later collections only walk objects made while serving (the same step vLLM and
Instagram's servers take after start-up). ``GCPauses`` times every collection into a Prometheus
histogram, ``batchpilot_gc_pause_seconds{generation=...}``, so a pause is visible, not a guess.
"""

from __future__ import annotations

import gc
import time
from typing import Any

from prometheus_client import CollectorRegistry, Histogram

_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)


def freeze_heap() -> int:
    """Collect, then freeze every surviving object out of future collections; the number frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


class GCPauses:
    """A ``gc.callbacks`` hook observing each collection's duration from ``start()`` (after the heap is
    frozen: the freeze's own collection is not a pause while serving) to ``close()``."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.histogram = Histogram("batchpilot_gc_pause_seconds",
                                   "Python garbage-collector pauses (every thread stops), by generation",
                                   ["generation"], buckets=_BUCKETS, registry=registry)
        self._started = 0.0

    def start(self) -> None:
        if self not in gc.callbacks:
            gc.callbacks.append(self)

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started:
            self.histogram.labels(generation=str(info["generation"])).observe(
                time.perf_counter() - self._started)
            self._started = 0.0

    def close(self) -> None:
        if self in gc.callbacks:
            gc.callbacks.remove(self)
