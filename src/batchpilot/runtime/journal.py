"""Append one JSON line per item from a thread that must not do I/O: ``JsonLines``.

The engine thread logs every step (``StepLog``, ``serve --llm-step-log``) and the batcher every batch
(``BatchLog``, ``serve --batch-log``). A write on the thread that runs the model is a system call that
releases the GIL: on shared cores another thread (the event loop, with a step's tokens to stream) takes
it there and the next step waits until that thread lets go. On two shared cores a line written per
step made each step 0.3-0.7 ms longer, the more sequences the longer:
the log slowed the server it was there to observe.

So ``append`` only queues the item (a ``deque`` append: no lock, no system call, nothing formatted). A
writer thread turns the queued items into lines (``to_json``, serialised with orjson) and writes them
together every ``FLUSH_S`` seconds, and once more at ``close()``. Contract for readers: while the
process runs, an item is in the file ``FLUSH_S`` seconds after its ``append`` at the latest, give or
take the writer's turn on the GIL (``wait_written`` waits that long, with a margin); lines are whole
(readers still take whole lines only); after ``close()`` every appended item is written and later
``append`` calls are dropped. The encoder's batch log (``BatchLog``) is the last section; the engine's
step log is ``runtime/llm/engine.py``'s ``StepLog``.
"""

from __future__ import annotations

import collections
import json
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from batchpilot.core.batch import Batch

log = logging.getLogger("batchpilot.runtime")

FLUSH_S = 0.1  # the writer's period
WRITTEN_MARGIN = 3.0  # ``wait_written`` waits this many periods


class JsonLines:
    """A JSON-lines file appended to off the caller's thread (module docstring)."""

    def __init__(self, path: str | Path, to_json: Callable[[Any], dict[str, Any]], name: str = "json-lines",
                 flush_s: float = FLUSH_S) -> None:
        import orjson  # the server's extra: only a server writes these logs

        if not flush_s > 0:
            raise ValueError(f"{name}: the flush period must be > 0 s, got {flush_s}")
        self._dumps: Callable[[dict[str, Any]], bytes] = lambda d: orjson.dumps(
            d, option=orjson.OPT_SERIALIZE_NUMPY)
        self._f = open(path, "ab")  # noqa: SIM115 - closed by close()
        self._to_json = to_json
        self._items: collections.deque[Any] = collections.deque()
        self._closed = False
        self._io = threading.Lock()  # the writer thread's flush vs close()
        self._stop = threading.Event()
        self._flush_s = float(flush_s)
        self._thread = threading.Thread(target=self._run, daemon=True, name=name)
        self._thread.start()

    def append(self, item: Any) -> None:
        """Queue ``item`` for the writer (dropped once closed). Cheap and I/O-free: any thread."""
        if not self._closed:
            self._items.append(item)

    def flush(self) -> int:
        """Write every queued item now (the writer thread does this every ``flush_s``); the lines written."""
        with self._io:
            if self._f.closed:
                return 0
            lines = []
            while self._items:
                item = self._items.popleft()
                try:
                    lines.append(self._dumps(self._to_json(item)))
                except Exception:  # one bad item must not lose the others, nor stop the writer
                    log.exception("%s: an item could not be written; dropped", self._thread.name)
            if lines:
                self._f.write(b"\n".join(lines) + b"\n")
                self._f.flush()
            return len(lines)

    def close(self) -> None:
        """Write what is queued and close the file. Idempotent; ``append`` is a no-op afterwards."""
        self._closed = True
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(5.0)
        self.flush()
        with self._io:
            self._f.close()

    def _run(self) -> None:
        while not self._stop.wait(self._flush_s):
            try:
                self.flush()
            except OSError:  # disk full, file gone: say so once per period, keep serving
                log.exception("%s: writing failed", self._thread.name)


def wait_written(flush_s: float = FLUSH_S) -> None:
    """Sleep until a ``JsonLines`` writer (of ``flush_s``), in this or another process, has written
    everything appended before the call: what a reader does before it takes an offset or reads."""
    time.sleep(WRITTEN_MARGIN * flush_s)


# -- The batch log ---------------------------------------------------------------------------------
# One JSON line per executed encoder batch (``serve --batch-log PATH``).
#
# A batch observer of the ``Batcher`` (``batcher.batch_observers``): for every batch that ran, when the
# scheduler formed it, when its slot started it, how long the slot was busy with it (the executor call
# plus the thread hand-off: what the simulator's cost model stands for), its size, its cost-model features
# and its requests' arrivals at the scheduler. The event loop only queues the batch; a writer thread
# formats and writes the lines (``journal.JsonLines``), within ``journal.FLUSH_S`` of the batch.
# ``bench fidelity`` reads it while the server writes (``read_batches`` takes whole lines only) to report
# how the run's batches compared with the profile. Nothing fits a prediction on it.

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


