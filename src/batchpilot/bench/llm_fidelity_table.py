"""The LLM fidelity check's tables: the prediction against the live run, and the live run against itself."""

from __future__ import annotations

import math
from typing import Any

from batchpilot.bench.fidelity_table import relative_error as _err
from batchpilot.bench.fidelity_table import within_target
from batchpilot.bench.records import Summary

TARGETS = {"TTFT": 0.10, "TPOT": 0.10, "output": 0.05}
METRICS = ("TTFT P50 ms", "TTFT P99 ms", "TPOT P50 ms", "TPOT P99 ms", "output tok/s")
HEAD = ["load", "rate scale", "metric", "predicted", "measured", "error", "target", "within",
        "speed vs profile", "speed checked before", "error of the profile alone"]
REPEAT_HEAD = ["load", "metric", "live", "live again", "difference", "within target", "speed vs profile"]


def _values(s: Summary) -> list[float]:
    """A run's value of each of ``METRICS``, in seconds for the latencies."""
    return [s.ttft.get("p50", math.nan), s.ttft.get("p99", math.nan), s.tpot.get("p50", math.nan),
            s.tpot.get("p99", math.nan), s.output_tokens_per_s]


def comparison_rows(load: float, k: float, pred: Summary, rejected_pred: int, meas: Summary,
                    speed: float, checked: float = math.nan,
                    alone: tuple[Summary, int] | None = None) -> list[list[Any]]:
    """Predicted vs measured with targets: TTFT and TPOT 10%, output tokens/s 5%, rejected within 10%
    or 5 requests; every row of the point carries its speed vs profile, the speed the recheck before
    the point measured (``pred`` is made at it) and the error of ``alone``, the prediction from the
    profile as it was (summary, rejected)."""
    sp = f"{speed:+.1%}" if math.isfinite(speed) else "-"
    ck = f"{checked:+.1%}" if math.isfinite(checked) else "-"
    first = _values(alone[0]) if alone else [math.nan] * 5
    rows: list[list[Any]] = []
    for metric, p, m, f in zip(METRICS, _values(pred), _values(meas), first, strict=True):
        unit = 1.0 if metric == "output tok/s" else 1e3
        e, target, ef = _err(p, m), TARGETS[metric.split()[0]], _err(f, m)
        rows.append([f"{load:.0%}", f"{k:.3f}", metric, f"{p * unit:.2f}", f"{m * unit:.2f}",
                     f"{e:+.1%}" if math.isfinite(e) else "-", f"{target:.0%}",
                     "yes" if within_target(metric, p, m, TARGETS) else "no", sp, ck,
                     f"{ef:+.1%}" if math.isfinite(ef) else "-"])
    rejected = meas.num_requests - meas.num_ok
    ok = within_target("rejected", rejected_pred, rejected)
    rows.append([f"{load:.0%}", f"{k:.3f}", "rejected", str(rejected_pred), str(rejected),
                 f"{rejected_pred - rejected:+d}", "10% or 5", "yes" if ok else "no", sp, ck,
                 f"{alone[1] - rejected:+d}" if alone else "-"])
    return rows


def repeat_rows(load: float, first: Summary, again: Summary, speeds: tuple[float, float]) -> list[list[Any]]:
    """The same rows replayed again on the same server, scored against the first replay under the
    prediction's targets (``bench fidelity --live-repeats``): how often the live run meets them against
    itself, back to back, which bounds how often a prediction made before the run can. ``speeds``: each
    replay's steps against the profile."""
    sp = " / ".join(f"{s:+.1%}" if math.isfinite(s) else "-" for s in speeds)
    rows: list[list[Any]] = []
    for metric, a, b in zip(METRICS, _values(first), _values(again), strict=True):
        unit = 1.0 if metric == "output tok/s" else 1e3
        e = _err(b, a)
        rows.append([f"{load:.0%}", metric, f"{a * unit:.2f}", f"{b * unit:.2f}",
                     f"{e:+.1%}" if math.isfinite(e) else "-",
                     "yes" if within_target(metric, b, a, TARGETS) else "no", sp])
    r1, r2 = first.num_requests - first.num_ok, again.num_requests - again.num_ok
    rows.append([f"{load:.0%}", "rejected", str(r1), str(r2), f"{r2 - r1:+d}",
                 "yes" if within_target("rejected", r2, r1) else "no", sp])
    return rows
