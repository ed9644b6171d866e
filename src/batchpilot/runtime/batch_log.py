"""One JSON line per executed encoder batch (``serve --batch-log PATH``).

A batch observer of the ``Batcher`` (``batcher.batch_observers``): for every batch that ran, when the
scheduler formed it, when its slot started it, how long the slot was busy with it (the executor call
plus the thread hand-off: what the simulator's cost model stands for), its size, its cost-model features
and its requests' arrivals at the scheduler. The event loop only queues the batch; a writer thread
formats and writes the lines (``json_lines.JsonLines``), within ``json_lines.FLUSH_S`` of the batch.
``bench fidelity`` reads it while the server writes (``read_batches`` takes whole lines only) to report
how the run's batches compared with the profile. Nothing fits a prediction on it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from batchpilot.core.scheduler import Batch
from batchpilot.runtime.json_lines import JsonLines


def batch_line(item: tuple[Batch, float, float]) -> dict[str, Any]:
    """One batch's line: what ``read_batches`` reads back."""
    batch, start, slot_s = item
    return {"batch": batch.id, "formed": batch.formed_at, "start": start, "slot_s": slot_s, "n": batch.size,
            "predicted_s": batch.predicted_s, "features": batch.shape.features(),
            "arrivals": [r.arrival for r in batch.requests]}


class BatchLog:
    def __init__(self, path: str) -> None:
        self._lines = JsonLines(path, batch_line, name="batch-log")

    def __call__(self, batch: Batch, start: float, slot_s: float) -> None:
        self._lines.append((batch, start, slot_s))

    def flush(self) -> None:
        self._lines.flush()

    def close(self) -> None:
        self._lines.close()


@dataclass(frozen=True)
class LoggedBatch:
    start: float
    slot_s: float
    n: int
    features: dict[str, float]
    formed: float = math.nan
    predicted_s: float = math.nan  # what the scheduler predicted (its cost model, no load terms)
    arrivals: tuple[float, ...] = ()  # its requests' arrivals at the scheduler (the profile's rate clock)


def read_batches(path: str | Path, offset: int = 0) -> tuple[list[LoggedBatch], int]:
    """Batches logged from byte ``offset`` on (whole lines only), and the offset to read from next."""
    with open(path, "rb") as f:
        f.seek(offset)
        data = f.read()
    end = data.rfind(b"\n") + 1
    out = []
    for line in data[:end].decode().splitlines():
        if line.strip():
            d = json.loads(line)
            out.append(LoggedBatch(float(d["start"]), float(d["slot_s"]), int(d["n"]),
                                   {k: float(v) for k, v in d["features"].items()},
                                   float(d.get("formed", math.nan)), float(d.get("predicted_s", math.nan)),
                                   tuple(float(a) for a in d.get("arrivals", ()))))
    return out, offset + end
