"""The serving path's delay stage under load: ``FrontEnd.delay_loaded_s`` and ``delay_rate_coef_s``.

The profile's lone requests (``serving_profile``, one at a time from a client process) give the
``delay`` stage of an idle server: HTTP, validation, JSON both ways, the client. Under open-loop
traffic it is longer: the event loop parses every arriving request and encodes every response, a
batch's answers leave one after another, and all of it shares the cores with the model; the load
generator is another process with many connections open. The loaded phase (``serving_load``) sends
its traffic from such a process, which reports each answered request (``DelayRow``); here each
request's delay beyond the lone line (its *excess*) is set against the arrival rate before it.

The fit: per segment of the loaded plan (segments take turns at ``LOADED_SHARES`` of one slot's rate,
``alternating_arrivals``), the median excess and the median rate; then ``excess ~ delay_loaded_s +
delay_rate_coef_s * rate`` through the points of the segments below one slot's one-at-a-time rate
(share < 1), both >= 0 (``line_fit.fit_line``). Medians, not means: the shift is what moves a
prediction's P50, and a few requests held up by a pause of the host would pull a mean toward a
delay most requests never see. Not the segments past one slot's rate: there the model runs without
a break while the queue grows, and the excess measured in them (0.6-4.8 ms in the profiles of three
fidelity matrices, ``benchmarks/fidelity.py`` at commits 43f68a3, 566b02d and f5c37f3) is not what
a server at 50-80% of its predicted capacity sees: fitted through them, the line put the live median
outside the batcher 0.6-1.1 ms too high on average in each of those matrices (docs/profiler.md, "The
delay under load").
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from batchpilot.sim.frontend import FrontEnd, rates_at
from batchpilot.sim.line_fit import fit_line

# per answered request of the loaded phase: (index in the plan, scheduled_s, latency_s,
# server_tokenize_s, server_batcher_s, input_tokens)
DelayRow = tuple[float, float, float, float, float, float]
MIN_ROWS = 20


def fit_loaded_delay(rows: list[DelayRow], frontend: FrontEnd, planned: int, segments: int,
                     shares: Sequence[float] = ()) -> tuple[float, float, dict[str, object]]:
    """``(delay_loaded_s, delay_rate_coef_s, details)`` from the loaded phase's ``rows`` of a plan of
    ``planned`` requests in ``segments`` segments taking turns at ``shares`` of one slot's rate
    (module docstring: the line goes through the segments below 1; all of them without shares, or
    when none is below 1); ``(0, 0, ...)`` with a note when fewer than ``MIN_ROWS`` requests have
    every part measured."""
    arr = np.asarray(rows, dtype=float).reshape(-1, 6)
    arr = arr[np.isfinite(arr).all(axis=1)]
    if len(arr) < MIN_ROWS or planned <= 0 or segments <= 0:
        return 0.0, 0.0, {"requests": int(len(arr)), "note": "too few answered requests: not measured"}
    arr = arr[np.argsort(arr[:, 1], kind="stable")]
    index, scheduled, latency, tokenize, batcher, tokens = arr.T
    excess = latency - tokenize - batcher - frontend.delay(tokens)
    rate = rates_at(scheduled)
    per = max(planned // segments, 1)
    segment = np.minimum(index // per, segments - 1)
    points = [(float(np.median(rate[segment == k])), float(np.median(excess[segment == k])),
               int((segment == k).sum()), shares[k % len(shares)] if shares else 0.0)
              for k in range(segments) if (segment == k).sum() >= 3]
    below = [p for p in points if p[3] < 1.0] or points
    x = np.array([p[0] for p in below])
    y = np.array([p[1] for p in below])
    const, coef = fit_line(x, y, trim=False) if len(below) >= 2 else (max(float(np.median(excess)), 0.0),
                                                                       0.0)
    return const, coef, {
        "requests": int(len(arr)), "median_excess_s": float(np.median(excess)),
        "mean_excess_s": float(np.mean(excess)),
        "segments": [{"rate": p[0], "median_excess_s": p[1], "requests": p[2], "share": p[3],
                      "fitted": p in below} for p in points],
        "const_s": const, "rate_coef_s": coef}
