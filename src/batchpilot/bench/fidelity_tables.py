"""The fidelity check's tables: predicted vs measured with the targets, and where the time goes."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ..core.costmodel import CostModel

if TYPE_CHECKING:
    from .fidelity import Prediction
    from .live_run import Measurement

TARGETS = {"p50": 0.10, "p99": 0.10, "throughput": 0.05}


def model_time_of_live_batches(cost_model: CostModel, server: dict[str, float]) -> float:
    """The cost model's latency for the live run's *mean* batch (n and computed tokens from the server's
    counters). The attention term needs sum(n * padded_len^2), which the server does not export, so it
    is left out: this isolates the const/n/tokens part of the model from batch-formation differences."""
    n, tokens = server.get("batch_size", math.nan), server.get("computed_tokens_per_batch", math.nan)
    if not (math.isfinite(n) and math.isfinite(tokens)):
        return math.nan
    return cost_model.latency({"const": 1.0, "n": n, "tokens": tokens, "attn": 0.0})


def _err(pred: float, meas: float) -> float:
    return (pred - meas) / meas if meas and math.isfinite(meas) and math.isfinite(pred) else math.nan


HEAD = ["load", "rate scale", "metric", "predicted", "measured", "error", "target", "within",
        "core only", "core-only error", "run's own batch costs", "own-cost error"]


def comparison_rows(load: float, scale: float, pred: Prediction, live: Measurement,
                    core: Prediction | None = None, own: Prediction | None = None) -> list[list[Any]]:
    """Predicted (with the calibrated front end) vs measured; ``core`` is the simulator of the batcher
    alone (no front end), kept beside it so every run shows what the front-end stage changes; ``own``
    the simulator with the measured run's own batch costs (hindsight, not a prediction: it splits the
    error into the CPU's speed during the run and the rest)."""
    m = live.summary
    rows = []
    live_bs = live.server.get("batch_size", math.nan)
    core = core or pred
    nan = math.nan
    for key, p, c, o, v, unit in (
            ("P50 ms", pred.summary.p50, core.summary.p50, own.summary.p50 if own else nan, m.p50, 1e3),
            ("P99 ms", pred.summary.p99, core.summary.p99, own.summary.p99 if own else nan, m.p99, 1e3),
            ("throughput req/s", pred.summary.throughput_rps, core.summary.throughput_rps,
             own.summary.throughput_rps if own else nan, m.throughput_rps, 1.0),
            ("mean batch size", pred.report.mean_batch_size, core.report.mean_batch_size,
             own.report.mean_batch_size if own else nan, live_bs, 1.0)):
        e, ec, eo = _err(p, v), _err(c, v), _err(o, v)
        tgt = TARGETS.get(key.split()[0].lower())
        ok = "" if tgt is None or not math.isfinite(e) else ("yes" if abs(e) <= tgt else "NO")
        rows.append([f"{load:.0%}", f"{scale:.3f}", key, round(p * unit, 2), round(v * unit, 2), _pct(e),
                     f"±{tgt:.0%}" if tgt else "", ok, round(c * unit, 2), _pct(ec),
                     round(o * unit, 2) if math.isfinite(o) else "-", _pct(eo)])
    return rows


def _pct(e: float) -> str:
    return f"{e:+.1%}" if math.isfinite(e) else "-"


ATTEMPT_HEAD = ["load", "attempt", "run vs calibrated batch time", "P50 error", "P99 error",
                "throughput error", "in the table"]


def attempt_row(load: float, attempt: int, moved: float, used: bool, pred: Prediction,
                live: Measurement) -> list[Any]:
    """One measured attempt at a load point: how far the CPU moved since its calibration, and the errors."""
    m, p = live.summary, pred.summary
    return [f"{load:.0%}", attempt, _pct(moved), _pct(_err(p.p50, m.p50)), _pct(_err(p.p99, m.p99)),
            _pct(_err(p.throughput_rps, m.throughput_rps)), "yes" if used else "no (speed moved)"]


def speed_rows(load: float, service: CostModel, profile: CostModel, run: Sequence[Any]) -> list[list[Any]]:
    """The speed fitted before the run against the same fit on the measured run's own batches (hindsight,
    not a prediction: how far the CPU moved between calibration and run)."""
    from .batch_fit import fit_live_batches

    fit = service.meta["live_fit"]
    try:
        own = fit_live_batches(profile, run).meta["live_fit"]
    except ValueError:
        own = {"alpha": math.nan, "const_s": math.nan}
    return [[f"{load:.0%}", "live speed: alpha x profile (calibration | the run's own batches)",
             round(fit["alpha"], 3), round(own["alpha"], 3)],
            [f"{load:.0%}", "  + per-batch serving cost", round(fit["const_s"] * 1e3, 2),
             round(own["const_s"] * 1e3, 2)]]


DIAG_HEAD = ["load", "quantity (mean, ms)", "simulated", "live"]


def diagnosis_rows(load: float, pred: Prediction, live: Measurement,
                   cost_model: CostModel) -> list[list[Any]]:
    """Where the time goes. Client latency = outside the batcher (HTTP, JSON, tokenisation, event loop)
    + batcher latency (queue + executor); the simulator only has the second part."""
    s = live.server
    ms = lambda x: round(x * 1e3, 2) if math.isfinite(x) else "-"  # noqa: E731
    client = live.summary.latency_mean_s
    outside = client - s.get("batcher_latency_s", math.nan)
    rows = [
        [f"{load:.0%}", "end-to-end latency (client)", ms(pred.summary.latency_mean_s), ms(client)],
        [f"{load:.0%}", "  outside the batcher: HTTP + tokenise + loop",
         ms(pred.summary.latency_mean_s - pred.report.extra.get("batcher_latency_mean_s", math.nan)),
         ms(outside)],
        [f"{load:.0%}", "  batcher latency (arrival at batcher -> result)",
         ms(pred.report.extra.get("batcher_latency_mean_s", math.nan)),
         ms(s.get("batcher_latency_s", math.nan))],
        [f"{load:.0%}", "    queue time (arrival -> dispatch)", ms(pred.mean_queue_s),
         ms(s.get("queue_s", math.nan))],
        [f"{load:.0%}", "executor time per batch", ms(pred.mean_batch_s),
         ms(s.get("batch_run_s", math.nan))],
        [f"{load:.0%}", "  cost model on the live mean batch (no attn term)",
         ms(model_time_of_live_batches(cost_model, s)), "-"],
        [f"{load:.0%}", "computed tokens per batch (not ms)", round(pred.mean_tokens, 1),
         round(s.get("computed_tokens_per_batch", math.nan), 1)],
        [f"{load:.0%}", "HTTP handler time (server)", "-", ms(s.get("http_handler_s", math.nan))],
        [f"{load:.0%}", "send lag P99 (load generator)", 0.0, ms(live.summary.send_lag["p99"])],
    ]
    return rows


def text_table(head: list[str], rows: list[list[Any]]) -> str:
    cells = [head] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(head))]
    return "\n".join("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths,
                                                                                              strict=True)))
                     for r in cells)
