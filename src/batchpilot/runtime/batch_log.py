"""One JSON line per executed encoder batch (``serve --batch-log PATH``).

A batch observer of the ``Batcher`` (``batcher.batch_observers``): for every batch that ran, when the
scheduler formed it, when its slot started it, how long the slot was busy with it (the executor call
plus the thread hand-off: what
the simulator's cost model stands for), its size and its cost-model features. ``bench fidelity``
reads it while the server writes (line-buffered; ``bench.batch_fit.read_batches`` takes whole lines
only) and fits the profile's speed on the live server's own batches.
"""

from __future__ import annotations

import json
from typing import IO

from ..core.scheduler import Batch


class BatchLog:
    def __init__(self, path: str) -> None:
        self._f: IO[str] = open(path, "a", buffering=1)  # noqa: SIM115 - line-buffered; close() on shutdown

    def __call__(self, batch: Batch, start: float, slot_s: float) -> None:
        if self._f.closed:
            return
        self._f.write(json.dumps({"batch": batch.id, "formed": batch.formed_at, "start": start,
                                  "slot_s": slot_s, "n": batch.size,
                                  "predicted_s": batch.predicted_s, "features": batch.shape.features()})
                      + "\n")

    def close(self) -> None:
        self._f.close()
