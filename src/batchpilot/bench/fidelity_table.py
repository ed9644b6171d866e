"""The fidelity check's table: the prediction against the live run, cell by cell, with its targets."""

from __future__ import annotations

import math
from typing import Any

from batchpilot.bench.live_run import Measurement
from batchpilot.bench.records import tail_seconds

TARGETS = {"P50": 0.10, "P99": 0.10, "throughput": 0.05}
METRICS = ("P50 ms", "P99 ms", "throughput req/s", "rejected", "mean batch size")  # what each point reports
HEAD = ["load", "rate scale", "metric", "predicted", "measured", "error", "target", "within",
        "speed vs profile", "error at the run's speed", "predicted band (P5-P95 of the draws)",
        "speed checked before", "error of the profile alone"]
_DRAWN = ("p50", "p99", "throughput_rps", "failed", "mean_batch_size")  # sim.draws names of METRICS
_SCALE = (1e3, 1e3, 1.0, 1.0, 1.0)


def relative_error(pred: float, meas: float) -> float:
    """``(pred - meas) / meas``; NaN where either is not finite or ``meas`` is 0."""
    return (pred - meas) / meas if meas and math.isfinite(meas) and math.isfinite(pred) else math.nan


def within_target(metric: str, value: float, reference: float,
                  targets: dict[str, float] = TARGETS) -> bool | None:
    """Whether ``value`` is within ``metric``'s target of ``reference``, the value it is scored against:
    the rejected count within 10% or 5 requests, any other metric within ``targets`` of its first word
    (a relative error); None for a metric without a target."""
    if metric == "rejected":
        return abs(value - reference) <= max(5, 0.10 * reference)
    target = targets.get(metric.split()[0])
    if target is None:
        return None
    e = relative_error(value, reference)
    return math.isfinite(e) and abs(e) <= target


def _metrics(pred: Any) -> list[float]:
    """A prediction's value of each of ``METRICS``: its median over the draws (``fidelity.Prediction``)."""
    return [pred.drawn.median(name) * k for name, k in zip(_DRAWN, _SCALE, strict=True)]


def predicted_bands(pred: Any) -> dict[str, list[float]]:
    """Per metric of ``METRICS``, the 5th and 95th percentiles of its value over the prediction's draws."""
    return {m: [lo * k, hi * k] for m, name, k in zip(METRICS, _DRAWN, _SCALE, strict=True)
            for lo, hi in [pred.drawn.band(name)]}


def comparison_rows(load: float, k: float, pred: Any, live: Measurement, speed: float,
                    hindsight: Any | None = None, spread: str = "-", checked: float = math.nan,
                    alone: Any | None = None) -> list[list[Any]]:
    """Predicted vs measured, with targets: P50/P99 10%, throughput 5%, rejected within 10% or 5.
    ``hindsight``: the simulator at the run's own measured speed, a diagnosis that splits the error
    into the machine's drift and the model's own error; never the prediction. ``checked``: the speed
    the recheck before the point measured (``pred`` is made at it); ``alone``: the prediction from the
    profile as it was, whose error is shown beside."""
    measured = measured_metrics(live)
    speed_cell = f"{speed:+.1%}" + (f" ({spread})" if spread != "-" else "")
    predicted = _metrics(pred)
    later = _metrics(hindsight) if hindsight is not None else [math.nan] * 5
    first = _metrics(alone) if alone is not None else [math.nan] * 5
    check_cell = f"{checked:+.1%}" if math.isfinite(checked) else "-"
    bands = predicted_bands(pred)
    rows: list[list[Any]] = []
    for i, metric in enumerate(METRICS):
        a, b, h, f = predicted[i], measured[i], later[i], first[i]
        lo, hi = bands[metric]
        ok = within_target(metric, a, b)
        verdict = "-" if ok is None else ("yes" if ok else "no")
        if metric == "rejected":
            rows.append([f"{load:.0%}", f"{k:.3f}", metric, f"{a:.0f}", f"{b:.0f}", f"{a - b:+.0f}",
                         "10% or 5", verdict, speed_cell,
                         f"{h - b:+.0f}" if math.isfinite(h) else "-", f"{lo:.0f} .. {hi:.0f}", check_cell,
                         f"{f - b:+.0f}" if math.isfinite(f) else "-"])
            continue
        e = relative_error(a, b)
        target = TARGETS.get(metric.split()[0])
        rows.append([f"{load:.0%}", f"{k:.3f}", metric, f"{a:.2f}", f"{b:.2f}", f"{e:+.1%}",
                     f"{target:.0%}" if target else "-", verdict, speed_cell,
                     f"{relative_error(h, b):+.1%}" if math.isfinite(h) else "-", f"{lo:.2f} .. {hi:.2f}",
                     check_cell,
                     f"{relative_error(f, b):+.1%}" if math.isfinite(f) else "-"])
    return rows


def text_table(head: list[str], rows: list[list[Any]]) -> str:
    cells = [head] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(head))]
    return "\n".join("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths,
                                                                                              strict=True)))
                     for r in cells)


def measured_metrics(live: Measurement) -> list[float]:
    """P50 ms, P99 ms, throughput, refused or failed requests and mean batch size of a live run."""
    m = live.summary
    return [m.p50 * 1e3, m.p99 * 1e3, m.throughput_rps, m.num_requests - m.num_ok,
            live.server.get("batch_size", math.nan)]


REPEAT_HEAD = ["load", "metric", "live", "live again", "difference", "within target"]


def repeat_rows(load: float, first: Measurement, again: Measurement,
                speeds: tuple[float, float] = (math.nan, math.nan)) -> list[list[Any]]:
    """The same rows replayed twice on the same server: how far the live run agrees with itself, the
    floor under any prediction's error on this machine (``bench fidelity --live-repeats``), with the
    again run scored against the first under the prediction's targets, and each run's speed against
    the profile (``speeds``)."""
    rows: list[list[Any]] = []
    for name, a, b in zip(METRICS, measured_metrics(first), measured_metrics(again), strict=True):
        diff = f"{b - a:+.0f}" if name == "rejected" else f"{relative_error(b, a):+.1%}"
        ok = within_target(name, b, a)
        verdict = "-" if ok is None else ("yes" if ok else "no")
        rows.append([f"{load:.0%}", name, f"{a:.2f}", f"{b:.2f}", diff, verdict])
    a, b = speeds
    rows.append([f"{load:.0%}", "speed vs profile", f"{a:+.1%}", f"{b:+.1%}", f"{(b - a) * 100:+.1f} pts",
                 ""])
    (n, s1), (m, s2) = tail_seconds(first.records), tail_seconds(again.records)
    rows.append([f"{load:.0%}", "slowest 1%: requests / seconds", f"{n} / {s1}", f"{m} / {s2}", "", ""])
    return rows
