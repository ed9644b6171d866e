"""Does the simulator predict the live server? profile -> predict -> serve -> replay -> compare.

    batchpilot bench fidelity --workload conv-embed [--profile p.json] [--cpus 1] [deployment flags]
    batchpilot bench fidelity --workload mmpp:rate_on=40,rate_off=4,on_s=10,off_s=30 --lengths bimodal:...

1. Profile: ``--profile`` or a fresh ``batchpilot profile`` run (pinned like the server with ``--cpus``),
   made before any measured traffic. It holds the batch cost model and the serving path outside the
   batcher (``frontend``); the prediction uses that file (with ``--speed-check``, rechecked before
   each point, step 4) and nothing else. Nothing is fitted on the traffic being measured. Each point is
   replayed ``--live-repeats`` times (default 3; the points' replays round-robin: A, B, A, B, ...) and
   its prediction scored against their median and widened [min, max] (``score_spread``), beside the
   first replay's table with its targets.
2. Deployment: the flags (``--config``, ``--latency-sla``, ``--max-concurrency``, ...) go through
   ``core.deployment.resolve_deployment`` for the simulator and, unchanged, to ``batchpilot serve``.
3. Capacity from the simulator: the highest rate scale of the rows whose predicted P99 meets ``--sla``
   (the tuner's own search). Each load point (default 50% and 80% of it) is the same rows at that rate.
4. Per point: with ``--speed-check``, the profile's own grid batches are timed again first (``batchpilot
   profile --recheck``, pinned like the server, before any of the point's traffic) and the point is predicted
   from the profile at the machine's speed now (the table shows the profile alone's error beside; server and
   simulator keep scheduling by the first). Then the prediction (each metric's median over ``--draws``
   service-noise draws, with the 5-95% band one live run should fall in: ``sim.draws``) and the live replay of
   the same rows at the same times, from a load generator that keeps its idle connections while the server
   does (``serverproc.client_keepalive_s``). The table: P50, P99, throughput, rejected count and mean batch
   size with their targets, and beside each point the run's own batches against the profile (``serve
   --batch-log``: the machine's speed during the run), reported, never used to correct the prediction.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from batchpilot.bench.capacity import wait_idle
from batchpilot.bench.loadgen import KEEPALIVE_EXPIRY_S, LoadGenConfig, build_plan, load_tokenizer, replay
from batchpilot.bench.records import (
    RequestRecord,
    Summary,
    format_summary,
    summarize,
    tail_seconds,
    write_csv,
)
from batchpilot.bench.report import RunData, html_table, write_report
from batchpilot.bench.scrape import MetricsSeries
from batchpilot.bench.serverproc import client_keepalive_s, pin_load_generator, pinned, serve
from batchpilot.core.config import SchedulerConfig
from batchpilot.core.costmodel import CostModel
from batchpilot.core.deployment import DeploymentSpec, ModelLimits, resolve_deployment
from batchpilot.runtime.journal import LoggedBatch, read_batches, wait_written
from batchpilot.sim.draws import DEFAULT_DRAWS
from batchpilot.sim.service import BUSY_EDGES, IDLE_EDGES_S, FrontEnd, busy_shares, idle_times, rates_before
from batchpilot.sim.traces import Workload

# ``batchpilot profile`` in a subprocess, pinned as the server it predicts will be.
#
# ``bench fidelity`` (encoder and LLM), ``bench tuner`` and benchmarks profile the machine before any
# measured traffic: ``run_profile`` writes a fresh profile (``run_llm_profile`` an LLM one), ``run_recheck``
# times the profile's own grid again right before a load point (``batchpilot profile --recheck``) and
# returns the machine's speed against it. All run with the server's pinning (``serverproc.pinned``), so
# that the profile sees the cores the server will have. A subprocess, not an import: nothing but the
# top-level command line imports ``profile/``.

def run_profile(out: Path, padding: str, extra: str = "", cpus: str | None = None,
                name: str = "profile.json") -> Path:
    """``batchpilot profile -o out/name`` in a subprocess, pinned like the server (before any traffic)."""
    path = out / name
    cmd = [*pinned(cpus), sys.executable, "-m", "batchpilot.cli", "profile", "--output", str(path),
           "--padding", "none" if padding == "none" else "dynamic", *shlex.split(extra)]
    print("profiling:", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    return path


def run_recheck(out: Path, profile: Path, cpus: str | None, name: str) -> float:
    """``batchpilot profile --recheck`` in a subprocess pinned like the server: the machine's speed
    against ``profile`` right now (``SpeedCheck.speed``), its rescaled profile written to out/name."""
    path = out / name
    cmd = [*pinned(cpus), sys.executable, "-m", "batchpilot.cli", "profile", "--recheck", str(profile),
           "--output", str(path)]
    subprocess.run(cmd, check=True, stderr=subprocess.DEVNULL)
    return float(json.loads(path.read_text())["speed_check"]["ratio"]) - 1.0


def run_llm_profile(out: Path, model: str | None, device: str, dtype: str, threads: int,
                    cpus: str | None, name: str = "llm_profile.json") -> Path:
    """``batchpilot profile --llm -o out/name`` in a subprocess pinned like the server (before any
    traffic): the step cost model and the serving path of ``model`` on ``device`` at ``dtype``, timed with
    the step grid's own repeats."""
    path = out / name
    cmd = [*pinned(cpus), sys.executable, "-m", "batchpilot.cli", "profile", "--llm", "--output", str(path),
           "--device", device, "--dtype", dtype, "--repeats", "7", *(["--model", model] if model else []),
           *(["--threads", str(threads)] if threads else [])]
    print("profiling:", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    return path


# One live run of the fidelity check: warm the server, replay a slice, read its own histograms.

@dataclass
class Measurement:
    summary: Summary
    records: list[RequestRecord]
    metrics: MetricsSeries | None
    server: dict[str, float] = field(default_factory=dict)  # means from the server's histograms
    origin_s: float = math.nan  # ``time.monotonic()`` of the replay's zero (``ReplayResult.origin_s``)

    def sent_monotonic(self) -> list[float]:
        """Every sent request's send time on ``time.monotonic()`` (the server's batch-log clock)."""
        return [self.origin_s + r.sent_s for r in self.records if math.isfinite(r.sent_s)]


# server histogram -> the name used in the diagnosis
SERVER_HISTOGRAMS = {
    "batch_size": "batchpilot_batch_size",
    "batch_run_s": "batchpilot_batch_run_seconds",
    "queue_s": "batchpilot_queue_time_seconds",
    "batcher_latency_s": "batchpilot_request_latency_seconds",
    "http_handler_s": "batchpilot_http_request_duration_seconds{route=/v1/embeddings}",
}


def histogram_mean(series: MetricsSeries, name: str) -> float:
    base, _, labels = name.partition("{")
    return series.histogram_mean(base, labels.rstrip("}"))


def measure(url: str, workload: Workload, texts: list[str], sla_s: float, warmup_requests: int,
            progress: bool, label: str, keepalive_s: float = KEEPALIVE_EXPIRY_S) -> Measurement:
    """Warm the server with a few unmeasured requests, let it drain, then replay ``workload`` exactly
    (idle pooled connections closed after ``keepalive_s``: ``LoadGenConfig.keepalive_s``)."""
    if warmup_requests:
        warm_up(url, workload, texts, warmup_requests, keepalive_s)
    plan = build_plan(workload, texts=texts[: len(workload)])  # a cut slice is a prefix of the texts' rows
    res = replay(plan, LoadGenConfig(url, progress=progress, keepalive_s=keepalive_s), description=label)
    m = Measurement(summarize(res.records, sla_s), res.records, res.metrics, origin_s=res.origin_s)
    if res.metrics is not None:
        m.server = {k: histogram_mean(res.metrics, v) for k, v in SERVER_HISTOGRAMS.items()}
        batches = res.metrics.delta("batchpilot_batch_size_count")
        for key, counter in (("computed_tokens_per_batch", "batchpilot_computed_tokens_total"),
                             ("useful_tokens_per_batch", "batchpilot_useful_tokens_total")):
            m.server[key] = res.metrics.delta(counter) / batches if batches > 0 else math.nan
    return m


def warm_up(url: str, workload: Workload, texts: list[str], n: int,
            keepalive_s: float = KEEPALIVE_EXPIRY_S) -> None:
    """Send the first ``n`` rows (unmeasured) and wait for the queue to drain: the first calls of a fresh
    server are slow (allocator, kernels for new shapes), which is not what a fidelity check measures."""
    warm = workload.slice(0, min(n, len(workload)))
    replay(build_plan(warm, texts=texts[: len(warm)], warmup_requests=len(warm)),
           LoadGenConfig(url, progress=False, scrape_interval_s=0, keepalive_s=keepalive_s))
    wait_idle(url, 10.0)


# How fast a live run's batches ran against the profile: the machine's speed, reported beside an error.
#
# The server's batch log (``serve --batch-log``) holds every batch's slot seconds and features. The
# profile prices each of them as the simulator does: ``FrontEnd.batch_seconds`` of the cost model's
# prediction at the request rate of the second before the batch started (``rates_before``), counted from
# the requests' arrivals at the scheduler that the log holds (as the profile counts it; an older log
# without them: the load generator's send times, the same monotonic clock), after the time no batch
# ran before it (``idle_before``) and at its busy share (``sim.service``). ``RunSpeed`` is the
# ratio of the totals, minus 1 (+5%: the batches took 5% longer than the profile says), and the same ratio
# over
# ``WINDOW_S`` windows of the run, so a drift within the run shows as a spread between its windows.
#
# It is a report, never an input of the prediction: a prediction uses the profile file only.

WINDOW_S = 15.0
MIN_WINDOW_BATCHES = 10  # a window with fewer batches is left out of the spread
IDLE_BINS_S = (0.0, *IDLE_EDGES_S, math.inf)  # idle before a batch, for ``by_idle`` (the profile's bins)
SIZE_BINS = ((1, 1), (2, 2), (3, 4), (5, 8), (9, 10**9))  # requests in a batch, for ``by_size``
RATE_BINS = (0.0, 5.0, 10.0, 20.0, 30.0, 45.0, 60.0, 75.0, math.inf)  # req/s in the second before a batch


@dataclass(frozen=True)
class RunSpeed:
    speed: float  # total slot seconds / total priced seconds - 1
    batches: int
    windows: tuple[float, ...] = field(default=())  # the same ratio - 1 per WINDOW_S window, in order
    by_idle: tuple[tuple[str, int, float], ...] = ()  # (idle bin, batches, ratio - 1) per IDLE_BINS_S bin
    by_size: tuple[tuple[str, int, float], ...] = ()  # (size bin, batches, ratio - 1) per SIZE_BINS bin
    by_rate: tuple[tuple[str, int, float], ...] = ()  # (rate bin, batches, ratio - 1) per RATE_BINS bin
    by_busy: tuple[tuple[str, int, float], ...] = ()  # (busy bin, batches, ratio - 1) per BUSY_EDGES bin

    @property
    def spread(self) -> str:
        """The windows' lowest and highest speed, e.g. ``-4.0% .. +31.2%`` (``-`` without windows)."""
        if not self.windows:
            return "-"
        return f"{min(self.windows):+.1%} .. {max(self.windows):+.1%}"

    def to_dict(self) -> dict[str, object]:
        return {"speed_vs_profile": self.speed, "batches": self.batches, "window_s": WINDOW_S,
                "windows": list(self.windows), "by_idle": [list(b) for b in self.by_idle],
                "by_size": [list(b) for b in self.by_size], "by_rate": [list(b) for b in self.by_rate],
                "by_busy": [list(b) for b in self.by_busy]}


def priced_seconds(batches: Sequence[LoggedBatch], cost_model: CostModel, frontend: FrontEnd | None,
                   rates: Sequence[float], idle: Sequence[float] | None = None,
                   busy: Sequence[float] | None = None) -> list[float]:
    """What the profile says each batch takes (``batches`` in start order): under serving load at its
    rate, after its idle time (``idle_before``), at its size and busy share (``busy_before``) with
    ``frontend``, else the bare cost model."""
    if frontend is None:
        return [cost_model.latency(b.features) for b in batches]
    idle = idle_before(batches) if idle is None else idle
    busy = busy_before(batches) if busy is None else busy
    return [frontend.batch_seconds(cost_model.latency(b.features), r, t, b.features.get("tokens", 0.0), s)
            for b, r, t, s in zip(batches, rates, idle, busy, strict=True)]


def logged_rates(batches: Sequence[LoggedBatch]) -> list[float]:
    """Per batch (in start order), the request rate of the second before it from the arrivals the batch
    log holds (``rates_before``); a log without them counts each batch's requests at its start."""
    arrivals = ([a for b in batches for a in b.arrivals] if all(b.arrivals for b in batches)
                else [b.start for b in batches for _ in range(b.n)])
    return rates_before([b.start for b in batches], arrivals)


def speed_of(batches: Sequence[LoggedBatch], priced: Sequence[float]) -> RunSpeed:
    """The ratio of the totals, and per ``WINDOW_S`` window from the first batch's start."""
    took, want = sum(b.slot_s for b in batches), sum(priced)
    if not batches or want <= 0:
        return RunSpeed(math.nan, len(batches))
    t0 = batches[0].start
    sums: dict[int, list[float]] = {}
    for b, p in zip(batches, priced, strict=True):
        cell = sums.setdefault(int((b.start - t0) // WINDOW_S), [0.0, 0.0, 0.0])
        cell[0] += b.slot_s
        cell[1] += p
        cell[2] += 1
    windows = tuple(s / p - 1.0 for _, (s, p, n) in sorted(sums.items()) if n >= MIN_WINDOW_BATCHES and p > 0)
    return RunSpeed(took / want - 1.0, len(batches), windows)


def idle_before(batches: Sequence[LoggedBatch]) -> list[float]:
    """Per batch, in start order, how long the server sat with no batch running before it started
    (the first batch's is infinite): ``sim.service.idle_times``."""
    return idle_times([b.start for b in batches], [b.slot_s for b in batches])


def split(batches: Sequence[LoggedBatch], priced: Sequence[float], keys: Sequence[float],
          bins: Sequence[tuple[float, float, str]]) -> tuple[tuple[str, int, float], ...]:
    """The ratio of the totals - 1 per bin ``(lo, hi, label)`` of the batches' ``keys`` (``lo <= key <
    hi``; an infinite ``hi`` takes infinite keys too), for the bins that hold a batch."""
    out = []
    for lo, hi, label in bins:
        cell = [(b.slot_s, p) for b, p, k in zip(batches, priced, keys, strict=True)
                if lo <= k and (k < hi or math.isinf(hi))]
        want = sum(p for _, p in cell)
        if cell and want > 0:
            out.append((label, len(cell), sum(t for t, _ in cell) / want - 1.0))
    return tuple(out)


def by_idle(batches: Sequence[LoggedBatch], priced: Sequence[float]) -> tuple[tuple[str, int, float], ...]:
    """Per ``IDLE_BINS_S`` bin of the idle time before the batch: flat when the profile's idle factors
    price how much slower a batch after an idle server runs than one right behind another."""
    bins = [(lo, hi, f">= {lo * 1e3:g} ms" if math.isinf(hi) else f"{lo * 1e3:g}-{hi * 1e3:g} ms")
            for lo, hi in zip(IDLE_BINS_S, IDLE_BINS_S[1:], strict=False)]
    return split(batches, priced, idle_before(batches), bins)  # the first batch (inf) in the last bin


def by_size(batches: Sequence[LoggedBatch], priced: Sequence[float]) -> tuple[tuple[str, int, float], ...]:
    """Per ``SIZE_BINS`` bin of requests in the batch: flat when the cost model prices a live batch of
    many inputs as well as a lone one."""
    bins = [(lo, hi + 0.5, str(lo) if lo == hi else (f"{lo}+" if hi >= 10**9 else f"{lo}-{hi}"))
            for lo, hi in SIZE_BINS]
    return split(batches, priced, [b.n for b in batches], bins)


def by_rate(batches: Sequence[LoggedBatch], priced: Sequence[float],
            rates: Sequence[float]) -> tuple[tuple[str, int, float], ...]:
    """Per ``RATE_BINS`` bin of the request rate of the second before the batch: flat when the profile
    prices how the serving load slows (or warms) the model."""
    bins = [(lo, hi, f">= {lo:g}/s" if math.isinf(hi) else f"{lo:g}-{hi:g}/s")
            for lo, hi in zip(RATE_BINS, RATE_BINS[1:], strict=False)]
    return split(batches, priced, rates, bins)


def busy_before(batches: Sequence[LoggedBatch]) -> list[float]:
    """Per batch, in start order, the busy share of the second before it (``sim.service``)."""
    return busy_shares([b.start for b in batches], [b.slot_s for b in batches])


def by_busy(batches: Sequence[LoggedBatch], priced: Sequence[float],
            busy: Sequence[float] | None = None) -> tuple[tuple[str, int, float], ...]:
    """Per ``BUSY_EDGES`` bin of the busy share of the second before the batch (``busy_before``, or
    ``busy``): flat when the profile's busy factors price how a busy second speeds the next batch."""
    edges = (0.0, *BUSY_EDGES, math.inf)
    bins = [(lo, hi, f">= {lo:g}" if math.isinf(hi) else f"{lo:g}-{hi:g}")
            for lo, hi in zip(edges, edges[1:], strict=False)]
    return split(batches, priced, busy_before(batches) if busy is None else busy, bins)


def run_speed(batch_log: Path, offset: int, cost_model: CostModel, frontend: FrontEnd | None,
              sent_s: Sequence[float]) -> RunSpeed:
    """The batches logged from byte ``offset`` on against the profile, each at the request rate of the
    second before it: from the arrivals at the scheduler the log holds (``logged_rates``: the clock
    the profile counts its rate on), else from ``sent_s`` (the run's send times, warm-up included);
    by idle time before the batch, by batch size and by rate too."""
    if not batch_log.exists():
        return RunSpeed(math.nan, 0)
    batches, _ = read_batches(batch_log, offset)
    batches.sort(key=lambda b: b.start)  # logged as they finish: with several slots not in start order
    rates = (logged_rates(batches) if batches and all(b.arrivals for b in batches)
             else rates_before([b.start for b in batches], sent_s))
    busy = busy_before(batches)
    priced = priced_seconds(batches, cost_model, frontend, rates, busy=busy)
    return dataclasses.replace(speed_of(batches, priced), by_idle=by_idle(batches, priced),
                               by_size=by_size(batches, priced), by_rate=by_rate(batches, priced, rates),
                               by_busy=by_busy(batches, priced, busy))


# The fidelity check's table: the prediction against the live run, cell by cell, with its targets.

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


# Scoring against the replays' spread: the live server does not reproduce itself on a shared machine (the
# same rows replayed twice differ by tens of percent in P99), so each point is replayed ``--live-repeats``
# times and its prediction scored against the median and the [min, max] of those replays. Pure functions:
# the commands (encoder and LLM) gather the numbers, print and write what these return.

WIDEN = 0.10  # the replays' [min, max] widened by this share each way: ``inside`` is min*0.9 <= p <= max*1.1
SPREAD_METRICS = METRICS[:4]  # the metrics scored against the replays' spread (all but mean batch size)
SPREAD_HEAD = ["load", "metric", "predicted", "replays' median", "replays' min .. max", "error vs median",
               "inside"]


@dataclass(frozen=True)
class SpreadCell:
    """One metric of one point: the prediction against the replays' median and range."""

    metric: str
    predicted: float
    median: float  # of the replays' values
    lo: float  # the replays' lowest
    hi: float  # and highest
    error: float  # ``relative_error(predicted, median)``
    inside: bool  # within [lo * 0.9, hi * 1.1]; rejected counts: within 10% or 5 requests of the median
    load: float = math.nan

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def score_spread(metric: str, predicted: float, replays: Sequence[float],
                 load: float = math.nan) -> SpreadCell:
    """``predicted`` against the finite ones of ``replays`` (one value per replay): ``SpreadCell``; a
    metric without a finite replay is never inside."""
    vals = sorted(v for v in replays if math.isfinite(v))
    if not vals:
        return SpreadCell(metric, predicted, math.nan, math.nan, math.nan, math.nan, False, load)
    med, lo, hi = statistics.median(vals), vals[0], vals[-1]
    if metric == "rejected":
        inside = abs(predicted - med) <= max(5, 0.10 * med)
    else:
        inside = lo * (1.0 - WIDEN) <= predicted <= hi * (1.0 + WIDEN)
    return SpreadCell(metric, predicted, med, lo, hi, relative_error(predicted, med), bool(inside), load)


def spread_cells(load: float, metrics: Sequence[str], predicted: Sequence[float],
                 replays: Sequence[Sequence[float]]) -> list[SpreadCell]:
    """Per metric, ``score_spread`` of its predicted value against its value in each replay (``replays``:
    one sequence per replay, in ``metrics``' order)."""
    return [score_spread(m, p, [r[i] for r in replays], load)
            for i, (m, p) in enumerate(zip(metrics, predicted, strict=True))]


def is_latency(metric: str) -> bool:
    """A latency metric (``P99 ms``, ``TTFT P50 ms``, ...): the cells ``matrix_score`` counts inside."""
    return metric.endswith(" ms")


def matrix_score(cells: Sequence[SpreadCell]) -> dict[str, Any]:
    """Across a matrix of points: per metric, the mean signed relative error against the replays' median
    (``bias``: + the prediction is high), and how many latency cells lie inside the widened range."""
    bias: dict[str, float] = {}
    for metric in dict.fromkeys(c.metric for c in cells):
        errs = [c.error for c in cells if c.metric == metric and math.isfinite(c.error)]
        bias[metric] = statistics.fmean(errs) if errs else math.nan
    latency = [c for c in cells if is_latency(c.metric)]
    inside = sum(c.inside for c in latency)
    return {"bias": bias, "latency_inside": inside, "latency_cells": len(latency),
            "latency_inside_share": inside / len(latency) if latency else math.nan}


def spread_rows(cells: Sequence[SpreadCell]) -> list[list[Any]]:
    """``SPREAD_HEAD`` rows of ``cells`` (counts as integers, the rest to two decimals)."""
    def fmt(v: float, metric: str) -> str:
        return "-" if not math.isfinite(v) else (f"{v:.0f}" if metric == "rejected" else f"{v:.2f}")
    return [[f"{c.load:.0%}" if math.isfinite(c.load) else "-", c.metric, fmt(c.predicted, c.metric),
             fmt(c.median, c.metric), f"{fmt(c.lo, c.metric)} .. {fmt(c.hi, c.metric)}",
             f"{c.error:+.1%}" if math.isfinite(c.error) else "-", "yes" if c.inside else "no"]
            for c in cells]


def format_matrix(score: dict[str, Any]) -> str:
    """``matrix_score`` in two lines."""
    bias = ", ".join(f"{m} {b:+.1%}" if math.isfinite(b) else f"{m} -" for m, b in score["bias"].items())
    return (f"bias (mean signed error against the replays' median): {bias}\n"
            f"latency cells inside the replays' range widened by {WIDEN:.0%}: {score['latency_inside']} of "
            f"{score['latency_cells']}")


def print_spread(cells: Sequence[SpreadCell]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Print the spread table and the matrix score of ``cells``; both returned for the results JSON."""
    rows, score = spread_rows(cells), matrix_score(cells)
    print(f"\nThe prediction against the spread of the live replays (median, min .. max; inside: within "
          f"min-{WIDEN:.0%} .. max+{WIDEN:.0%}, rejected within 10% or 5 of the median)\n"
          f"{text_table(SPREAD_HEAD, rows)}\n{format_matrix(score)}", flush=True)
    return {"head": SPREAD_HEAD, "rows": rows}, score


def combine_results(folders: Sequence[Path]) -> dict[str, Any]:
    """``matrix_score`` over the points of several ``bench fidelity`` output folders (their
    ``fidelity.json``)."""
    points = [pt for f in folders for pt in json.loads((Path(f) / "fidelity.json").read_text())["points"]]
    cells = [SpreadCell(**c) for pt in points for c in pt.get("spread", [])]
    return matrix_score(cells)


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


DEFAULT_REQUESTS = 1000  # rows replayed when --requests is not given


@dataclass(frozen=True)
class FidelityOptions:
    """What ``bench fidelity`` was asked (``bench/cli.py`` reads it off the flags); the LLM half
    (``bench.llm_fidelity``) reads the same options."""

    out: Path
    spec: DeploymentSpec  # the deployment the simulator resolves
    serve_flags: tuple[str, ...] = ()  # the deployment flags and --serve-args, handed to `serve` unchanged
    sla_s: float = 1.0
    loads: tuple[float, ...] = (0.5, 0.8)  # fractions of the predicted capacity
    profile: str | None = None  # None: profile first (`batchpilot profile`, pinned like the server)
    profile_args: str = ""
    cpus: str | None = None
    speed_check: bool = False
    batcher_only: bool = False
    warmup_requests: int = 30
    live_repeats: int = 3
    draws: int = DEFAULT_DRAWS
    noop_delay_ms: float | None = None
    tokenizer: str | None = None
    seed: int = 0
    keepalive_s: float | None = None
    progress: bool = True
    llm_model: str | None = None  # conv-llm: the served model folder (default: the built-in tiny Llama)
    max_live_s: float | None = None  # conv-llm: cut each point's rows to this many seconds of arrivals


@dataclass
class Prediction:
    summary: Summary  # the medians over the draws
    report: Any  # sim.metrics.SimReport: the draw whose P99 is the median
    drawn: Any  # sim.draws.Drawn: every draw, for the medians and bands


def simulate(workload: Workload, config: SchedulerConfig, cost_model: CostModel, sla_s: float,
             frontend: FrontEnd | None, speed: float = 0.0, draws: int = 1) -> Prediction:
    """The simulator's prediction of one replay: each metric's median over ``draws`` service-noise draws
    (``sim.draws``; one draw when batch times are not drawn), as a ``Summary`` beside the central draw's
    report. ``speed``: batches take ``1 + speed`` times the profile's time while the scheduler still
    believes the profile, as the live server does (the speed checked before the point, or in hindsight
    the run's own)."""
    from batchpilot.sim.draws import encoder_draws
    from batchpilot.sim.target import draws_batch_times

    service = None
    if speed and frontend is not None:  # every served batch (1 + speed) times what the profile says
        frontend = dataclasses.replace(frontend, loaded_alpha=frontend.loaded_alpha * (1.0 + speed),
                                       loaded_rate_coef=frontend.loaded_rate_coef * (1.0 + speed),
                                       loaded_const_s=frontend.loaded_const_s * (1.0 + speed))
    elif speed:
        service = dataclasses.replace(cost_model, latency_coef=tuple(c * (1.0 + speed)
                                                                       for c in cost_model.latency_coef))
    noisy = draws_batch_times(False, frontend, service or cost_model)
    drawn = encoder_draws(workload, config, cost_model, draws if noisy else 1,
                          sla_s=sla_s, frontend=frontend, service_model=service)
    rep = drawn.central
    lat = {k: drawn.median(k) for k in ("p50", "p90", "p99", "p99.9")}
    failed = round(drawn.median("failed"))
    thr = drawn.median("throughput_rps")
    s = Summary(num_requests=rep.num_measured, num_ok=rep.num_measured - failed, num_warmup=0,
                duration_s=(rep.num_measured - failed) / thr if thr else 0.0,
                offered_rps=rep.offered_rps, throughput_rps=thr, goodput_rps=drawn.median("goodput_rps"),
                sla_s=sla_s, sla_met=bool(drawn.median("p99_all") <= sla_s), latency=lat,
                latency_mean_s=drawn.median("mean"), latency_max_s=math.nan,
                send_lag={"p50": 0.0, "p99": 0.0}, send_lag_max_s=0.0,
                errors={"rejected/dropped/unfinished": failed} if failed else {})
    return Prediction(s, rep, drawn)


def predicted_capacity(workload: Workload, cost_model: CostModel, spec: Any, frontend: FrontEnd | None,
                       sla_s: float) -> Any:
    """The tuner's capacity search for the deployment: a ``sim.tune.Candidate`` (``capacity``, ``rps``)."""
    from batchpilot.sim.tune import Candidate, TuneConfig, Tuner

    tuner = Tuner(workload, cost_model, TuneConfig(sla_p99_s=sla_s), spec=spec, frontend=frontend)
    cand = Candidate("config", spec.encoder)
    tuner.capacity(cand, workload, rel_tol=0.02, start=1.0)
    return cand


def encoder_profile(opts: FidelityOptions) -> tuple[Path, list[str]]:
    """The profile the prediction uses, and the serve flags of a no-op model: ``--noop-delay-ms`` writes
    an exact one (a fixed time per batch), else ``--profile``, else a fresh ``batchpilot profile``."""
    if opts.noop_delay_ms is not None:
        profile = opts.out / "noop_profile.json"
        CostModel(latency_coef=(opts.noop_delay_ms / 1e3, 0.0, 0.0, 0.0),
                  meta={"source": f"noop {opts.noop_delay_ms:g} ms per batch"}).save(profile)
        return profile, ["--noop", "--noop-delay-ms", str(opts.noop_delay_ms)]
    if opts.profile:
        return Path(opts.profile), []
    return run_profile(opts.out, opts.spec.encoder.planner.padding, opts.profile_args, opts.cpus), []


def check_fidelity(wl: Workload, opts: FidelityOptions) -> int:
    """``bench fidelity`` on an encoder workload: predict, serve, replay and compare each load point."""
    if opts.draws < 1:
        print(f"--draws must be >= 1, got {opts.draws}", file=sys.stderr)
        return 2
    out = opts.out
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.monotonic()
    profile, noop = encoder_profile(opts)
    cost_model = CostModel.load(profile)
    frontend = None if opts.batcher_only else FrontEnd.from_profile(profile)
    frontend = frontend and frontend.serving(opts.spec.server.tokenizer_workers)
    deployment = resolve_deployment(opts.spec, cost_model, ModelLimits.from_meta(cost_model.meta))
    print(f"workload {wl.name}: {len(wl)} requests over {wl.duration_s:.1f} s ({wl.mean_rate:.2f} req/s); "
          f"profile {profile}; serving path {'from the profile' if frontend else 'left out'}\n"
          f"deployment: {deployment.describe()}", flush=True)
    cap = predicted_capacity(wl, cost_model, opts.spec, frontend, opts.sla_s)
    print(f"predicted capacity: rate scale {cap.capacity:.3f} = {cap.rps:.2f} req/s "
          f"(P99 <= {opts.sla_s:g} s)", flush=True)
    if cap.capacity <= 0:
        print(f"no rate meets P99 <= {opts.sla_s:g} s in simulation; was the machine busy while profiling?",
              file=sys.stderr)
        return 1
    pin_load_generator(opts.cpus)
    tok = load_tokenizer(opts.tokenizer)
    texts = [p.body["input"] for p in build_plan(wl, tokenizer=tok, seed=opts.seed)]
    batch_log = (out / "batches.jsonl").resolve()
    batch_log.unlink(missing_ok=True)
    serve_args = ["--profile", str(profile), "--log-level", "warning", "--batch-log", str(batch_log), *noop,
                  *opts.serve_flags]
    keep = client_keepalive_s(serve_args, opts.keepalive_s)  # pooled as a gateway pools them
    run = LivePoints(opts, profile, cost_model, frontend, deployment.scheduler, texts, batch_log, keep,
                     check=opts.speed_check and opts.noop_delay_ms is None)  # a no-op profile is exact
    result: dict[str, Any] = {"workload": wl.name, "requests": len(wl), "profile": str(profile),
                              "deployment": deployment.describe(), "capacity_scale": cap.capacity,
                              "capacity_rps": cap.rps, "cpus": opts.cpus, "points": []}
    with serve(serve_args, log_path=out / "serve.log", cpus=opts.cpus) as url:
        points = []
        for load in opts.loads:  # each point's first replay, its prediction made right before it
            points.append(run.point(url, wl, load, load * cap.capacity))
            wait_idle(url, 10.0)
        for j in range(2, opts.live_repeats + 1):  # round-robin: A #2, B #2, A #3, B #3, ...
            for p in points:
                run.again(url, p, j)
                wait_idle(url, 10.0)
    result["points"] = [run.finish(p) for p in points]
    report = write_results(out, wl, run, result, opts.sla_s)
    print(f"fidelity.json and {report} written to {out}/ in {time.monotonic() - t_start:.0f} s")
    return 0


class LivePoints:
    """The load points of one fidelity check against one server: each predicted, replayed, compared,
    the rows of its tables gathered here."""

    def __init__(self, opts: FidelityOptions, profile: Path, cost_model: CostModel, frontend: FrontEnd | None,
                 scheduler: SchedulerConfig, texts: list[str], batch_log: Path, keepalive_s: float,
                 check: bool) -> None:
        self.opts, self.profile, self.cost_model, self.frontend = opts, profile, cost_model, frontend
        self.scheduler, self.texts, self.batch_log, self.keep, self.check = (scheduler, texts, batch_log,
                                                                             keepalive_s, check)
        self.rows: list[list[Any]] = []
        self.repeats: list[list[Any]] = []
        self.spread: list[SpreadCell] = []
        self.runs: list[RunData] = []

    def predict(self, scaled: Workload, speed: float = 0.0) -> Prediction:
        o = self.opts
        return simulate(scaled, self.scheduler, self.cost_model, o.sla_s, self.frontend, speed, o.draws)

    def replay(self, url: str, scaled: Workload, label: str) -> tuple[Measurement, RunSpeed]:
        """One replay of the point's rows, and its batches against the profile (the run's speed)."""
        wait_written()  # what ran before is in the log: this replay's batches start after it
        offset = self.batch_log.stat().st_size if self.batch_log.exists() else 0
        live = measure(url, scaled, self.texts, self.opts.sla_s, 0, self.opts.progress, label, self.keep)
        wait_written()
        return live, run_speed(self.batch_log, offset, self.cost_model, self.frontend, live.sent_monotonic())

    def point(self, url: str, wl: Workload, load: float, k: float) -> LivePoint:
        """The point's prediction and its first replay (the rest: ``again``, then ``finish``)."""
        o = self.opts
        scaled = wl.scale_rate(k)
        alone = self.predict(scaled)
        checked = math.nan
        pred = alone
        if self.check:  # the machine's speed now, before any of the point's traffic: the prediction's
            checked = run_recheck(o.out, self.profile, o.cpus, f"profile-now-{int(load * 100)}.json")
            pred = self.predict(scaled, checked)
        if o.warmup_requests:
            warm_up(url, scaled, self.texts, o.warmup_requests, self.keep)
        live, rs = self.replay(url, scaled, f"{load:.0%} live")
        print(format_summary(pred.summary, f"predicted at {load:.0%} of capacity (x{k:.3f}), medians "
                                           f"over {len(pred.drawn.reports)} draws"
                             + (f", at the speed checked before it ({checked:+.1%})" if self.check else "")))
        print(format_summary(live.summary, f"live at {load:.0%} of capacity (x{k:.3f})"))
        print(describe_speed(rs), flush=True)
        later = self.predict(scaled, rs.speed) if math.isfinite(rs.speed) else None
        self.rows += comparison_rows(load, k, pred, live, rs.speed, later, rs.spread, checked,
                                     alone if self.check else None)
        point: dict[str, Any] = {"load": load, "rate_scale": k, "speed_vs_profile": rs.speed,
                                 "speed_checked_before": checked,
                                 "predicted_profile_alone": alone.summary.to_dict(),
                                 "run_speed": rs.to_dict(), "predicted": pred.summary.to_dict(),
                                 "predicted_rejected": pred.drawn.median("failed"),
                                 "predicted_mean_batch_size": pred.drawn.median("mean_batch_size"),
                                 "predicted_bands": predicted_bands(pred),
                                 "measured": live.summary.to_dict(), "server": live.server, "repeats": []}
        write_csv(live.records, o.out / f"records-{int(load * 100)}.csv")
        self.runs.append(RunData(f"live {load:.0%}", live.records, live.summary, live.metrics,
                                 {"rate_scale": k}))
        return LivePoint(load, scaled, pred, live, rs.speed, point)

    def again(self, url: str, p: LivePoint, j: int) -> None:
        """Replay #``j`` of the point's rows: compared with the first (``repeat_rows``) and part of the
        spread the prediction is scored against (``finish``)."""
        again, rs_again = self.replay(url, p.scaled, f"{p.load:.0%} live #{j}")
        self.repeats += repeat_rows(p.load, p.first, again, (p.speed, rs_again.speed))
        p.replays.append(again)
        p.point["repeats"].append({"measured": again.summary.to_dict(), "server": again.server,
                                   "run_speed": rs_again.to_dict()})
        write_csv(again.records, self.opts.out / f"records-{int(p.load * 100)}-again{j}.csv")

    def finish(self, p: LivePoint) -> dict[str, Any]:
        """The point scored against the spread of all its replays (``spread_cells``): its result."""
        cells = spread_cells(p.load, SPREAD_METRICS, _metrics(p.pred)[:len(SPREAD_METRICS)],
                             [measured_metrics(m)[:len(SPREAD_METRICS)] for m in [p.first, *p.replays]])
        self.spread += cells
        p.point["spread"] = [c.to_dict() for c in cells]
        return p.point


@dataclass
class LivePoint:
    """One load point between its first replay and its score: the prediction and every replay."""

    load: float
    scaled: Workload
    pred: Prediction
    first: Measurement
    speed: float  # the first replay's speed against the profile
    point: dict[str, Any]  # its entry of fidelity.json's points
    replays: list[Measurement] = field(default_factory=list)  # the replays after the first


def describe_speed(rs: RunSpeed) -> str:
    """The run's batches against the profile, in all and split each way ``RunSpeed`` holds."""
    splits = (("idle time before the batch", rs.by_idle), ("requests in the batch", rs.by_size),
              ("request rate before the batch", rs.by_rate), ("busy share before it", rs.by_busy))
    return (f"the run's {rs.batches} batches took {rs.speed:+.1%} against the profile "
            f"({WINDOW_S:g} s windows: {rs.spread}); "
            + "; ".join(f"by {what}: " + ", ".join(f"{lab} {r:+.1%} ({n})" for lab, n, r in cells)
                        for what, cells in splits))


def write_results(out: Path, wl: Workload, run: LivePoints, result: dict[str, Any], sla_s: float) -> Path:
    """The comparison tables printed, and fidelity.json and report.html written."""
    rows, repeats = run.rows, run.repeats
    table = text_table(HEAD, rows)
    within = sum(r[7] == "yes" for r in rows)
    scored = sum(r[7] in ("yes", "no") for r in rows)
    made = "the profile rechecked before each point" if run.check else "the profile alone"
    print(f"\nFidelity: prediction ({made}) vs live measurement, {within} of {scored} cells within "
          f"target\n{table}", flush=True)
    result["table"] = {"head": HEAD, "rows": rows}
    if repeats:
        hits = sum(r[5] == "yes" for r in repeats)
        print(f"\nThe live run against itself (the same rows replayed again on the same server): {hits} of "
              f"{sum(r[5] in ('yes', 'no') for r in repeats)} cells within the prediction's targets\n"
              f"{text_table(REPEAT_HEAD, repeats)}", flush=True)
        result["repeat_table"] = {"head": REPEAT_HEAD, "rows": repeats}
    result["spread_table"], result["matrix"] = print_spread(run.spread)
    (out / "fidelity.json").write_text(json.dumps(result, indent=2, default=str))
    return write_report(out, run.runs, title=f"fidelity: {wl.name}", sla_s=sla_s,
                        sections=[("Fidelity: predicted vs measured", html_table(HEAD, rows))])
