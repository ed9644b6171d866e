"""The timing loop the drift benchmarks share (``encoder_drift.py``, ``llm_step_drift.py``).

``window_medians(timers, minutes, window_s)`` calls every timer round-robin (each returns the seconds
of one timed call) for ``window_s`` seconds at a time, prints each timer's median per window as it
goes, then the spread of the window medians (max / min - 1), and returns the medians per timer.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def window_medians(timers: dict[str, Callable[[], float]], minutes: float, window_s: float,
                   width: int = 10) -> dict[str, list[float]]:
    medians: dict[str, list[float]] = {k: [] for k in timers}
    t0 = time.monotonic()
    print(f"{'t (s)':>6s} " + " ".join(f"{k:>{width}s}" for k in timers) + "   (median ms per window)")
    while time.monotonic() - t0 < minutes * 60:
        w0 = time.monotonic()
        times: dict[str, list[float]] = {k: [] for k in timers}
        while time.monotonic() - w0 < window_s:
            for k, timer in timers.items():
                times[k].append(timer())
        for k, v in times.items():
            medians[k].append(statistics.median(v))
        row = " ".join(f"{medians[k][-1] * 1e3:{width}.2f}" for k in timers)
        print(f"{time.monotonic() - t0:6.0f} {row}", flush=True)
    print("spread of the window medians (max / min - 1): " + ", ".join(
        f"{k} {max(v) / min(v) - 1:+.1%}" for k, v in medians.items()))
    return medians
