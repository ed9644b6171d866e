"""Does the simulator predict the live server? profile -> predict -> serve -> replay -> score.

    batchpilot bench fidelity --workload conv-embed [--profile p.json] [--cpus 1] [deployment flags]
    batchpilot bench fidelity --workload mmpp:rate_on=40,rate_off=4,on_s=10,off_s=30 --lengths bimodal:...
    batchpilot bench fidelity <the same workload flags> --rescore OUT [--ablate]

1. Profile: ``--profile`` or a fresh ``batchpilot profile`` run (pinned like the server with ``--cpus``),
   made before any measured traffic. It holds the batch cost model and the service model
   (``sim.service.ServiceModel``); the prediction uses that file and nothing else. Nothing is fitted on
   the traffic being measured.
2. Deployment: the flags (``--config``, ``--latency-sla``, ``--max-concurrency``, ...) go through
   ``core.deployment.resolve_deployment`` for the simulator and, unchanged, to ``batchpilot serve``.
3. Capacity from the simulator: the highest rate scale of the rows whose predicted P99 meets ``--sla``
   (the tuner's own search). Each load point (default 50% and 80% of it) is the same rows at that rate.
4. Per point, the prediction (each metric's median over ``--draws`` service-noise draws, with the 5-95%
   band: ``sim.draws``), made before the server starts; then the live replays of the same rows at the
   same times, ``--live-repeats`` per point (default 3), round-robin over the points (A, B, A, B, ...),
   from a load generator that keeps its idle connections while the server does
   (``serverproc.client_keepalive_s``).
5. The score (``score_spread``): on a shared machine the live server does not reproduce itself, so the
   prediction is scored against the replays' median (its error) and their [min, max] widened by 10%
   (inside or not); across the points, the mean signed error per metric (``matrix_score``: the bias)
   and the share of latency cells inside.

``--rescore OUT`` predicts an earlier run's points again from its own profile with today's simulator and
scores them against its replays, with no server; ``--ablate`` adds a prediction with each term of the
service model removed (``ServiceModel.without``) — the ablation table of ``docs/simulator.md``.
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
    write_csv,
)
from batchpilot.bench.report import RunData, html_table, write_report
from batchpilot.bench.scrape import MetricsSeries
from batchpilot.bench.serverproc import client_keepalive_s, pin_load_generator, pinned, serve
from batchpilot.core.config import SchedulerConfig
from batchpilot.core.costmodel import CostModel
from batchpilot.core.deployment import DeploymentSpec, ModelLimits, resolve_deployment
from batchpilot.sim.draws import DEFAULT_DRAWS
from batchpilot.sim.service import ServiceModel
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
    m = Measurement(summarize(res.records, sla_s), res.records, res.metrics)
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


METRICS = ("P50 ms", "P99 ms", "throughput req/s", "rejected", "mean batch size")  # what each point reports
_DRAWN = ("p50", "p99", "throughput_rps", "failed", "mean_batch_size")  # sim.draws names of METRICS
_SCALE = (1e3, 1e3, 1.0, 1.0, 1.0)


def relative_error(pred: float, meas: float) -> float:
    """``(pred - meas) / meas``; NaN where either is not finite or ``meas`` is 0."""
    return (pred - meas) / meas if meas and math.isfinite(meas) and math.isfinite(pred) else math.nan


def _metrics(pred: Any) -> list[float]:
    """A prediction's value of each of ``METRICS``: its median over the draws (``fidelity.Prediction``)."""
    return [pred.drawn.median(name) * k for name, k in zip(_DRAWN, _SCALE, strict=True)]


def predicted_bands(pred: Any) -> dict[str, list[float]]:
    """Per metric of ``METRICS``, the 5th and 95th percentiles of its value over the prediction's draws."""
    return {m: [lo * k, hi * k] for m, name, k in zip(METRICS, _DRAWN, _SCALE, strict=True)
            for lo, hi in [pred.drawn.band(name)]}


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
    return [*summary_metrics(live.summary.to_dict()), live.server.get("batch_size", math.nan)]


def summary_metrics(summary: dict[str, Any]) -> list[float]:
    """``SPREAD_METRICS`` of a live run from its ``Summary.to_dict()`` (as fidelity.json holds it)."""
    lat = summary["latency"]
    return [lat["p50"] * 1e3, lat["p99"] * 1e3, summary["throughput_rps"],
            summary["num_requests"] - summary["num_ok"]]


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
    rescore: str | None = None  # a folder of an earlier run: predict again against its replays, no server
    ablate: bool = False  # with ``rescore``: also predict with each term of the service model removed


@dataclass
class Prediction:
    summary: Summary  # the medians over the draws
    report: Any  # sim.metrics.SimReport: the draw whose P99 is the median
    drawn: Any  # sim.draws.Drawn: every draw, for the medians and bands


def simulate(workload: Workload, config: SchedulerConfig, cost_model: CostModel, sla_s: float,
             service: ServiceModel | None, draws: int = 1) -> Prediction:
    """The simulator's prediction of one replay: each metric's median over ``draws`` service-noise draws
    (``sim.draws``; one draw when batch times are not drawn), as a ``Summary`` beside the central draw's
    report."""
    from batchpilot.sim.draws import encoder_draws

    noisy = service is not None and service.draws_batch_times
    drawn = encoder_draws(workload, config, cost_model, draws if noisy else 1, sla_s=sla_s, service=service)
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


def predicted_capacity(workload: Workload, cost_model: CostModel, spec: Any, service: ServiceModel | None,
                       sla_s: float) -> Any:
    """The tuner's capacity search for the deployment: a ``sim.tune.Candidate`` (``capacity``, ``rps``)."""
    from batchpilot.sim.tune import Candidate, TuneConfig, Tuner

    tuner = Tuner(workload, cost_model, TuneConfig(sla_p99_s=sla_s), spec=spec, service=service)
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


def load_prediction_inputs(profile: Path,
                           opts: FidelityOptions) -> tuple[CostModel, ServiceModel | None, Any]:
    """What a prediction is made of, all from the profile file and the deployment flags: the cost
    model, the service model (None with ``--batcher-only`` or a profile without one) and the resolved
    deployment."""
    cost_model = CostModel.load(profile)
    service = None if opts.batcher_only else ServiceModel.from_profile(profile)
    deployment = resolve_deployment(opts.spec, cost_model, ModelLimits.from_meta(cost_model.meta))
    return cost_model, service, deployment


def check_fidelity(wl: Workload, opts: FidelityOptions) -> int:
    """``bench fidelity`` on an encoder workload: predict, serve, replay and score each load point."""
    if opts.draws < 1:
        print(f"--draws must be >= 1, got {opts.draws}", file=sys.stderr)
        return 2
    if opts.rescore:
        return rescore(wl, opts)
    out = opts.out
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.monotonic()
    profile, noop = encoder_profile(opts)
    cost_model, service, deployment = load_prediction_inputs(profile, opts)
    print(f"workload {wl.name}: {len(wl)} requests over {wl.duration_s:.1f} s ({wl.mean_rate:.2f} req/s); "
          f"profile {profile}; service model {'from the profile' if service else 'left out'}\n"
          f"deployment: {deployment.describe()}", flush=True)
    cap = predicted_capacity(wl, cost_model, opts.spec, service, opts.sla_s)
    print(f"predicted capacity: rate scale {cap.capacity:.3f} = {cap.rps:.2f} req/s "
          f"(P99 <= {opts.sla_s:g} s)", flush=True)
    if cap.capacity <= 0:
        print(f"no rate meets P99 <= {opts.sla_s:g} s in simulation; was the machine busy while profiling?",
              file=sys.stderr)
        return 1
    pin_load_generator(opts.cpus)
    tok = load_tokenizer(opts.tokenizer)
    texts = [p.body["input"] for p in build_plan(wl, tokenizer=tok, seed=opts.seed)]
    serve_args = ["--profile", str(profile), "--log-level", "warning", *noop, *opts.serve_flags]
    keep = client_keepalive_s(serve_args, opts.keepalive_s)  # pooled as a gateway pools them
    result: dict[str, Any] = {"workload": wl.name, "requests": len(wl), "profile": str(profile),
                              "deployment": deployment.describe(), "capacity_scale": cap.capacity,
                              "capacity_rps": cap.rps, "cpus": opts.cpus, "points": []}
    points = [LivePoint(load, load * cap.capacity, wl.scale_rate(load * cap.capacity)) for load in opts.loads]
    for p in points:  # every prediction made before the server starts
        p.pred = simulate(p.scaled, deployment.scheduler, cost_model, opts.sla_s, service, opts.draws)
        print(format_summary(p.pred.summary, f"predicted at {p.load:.0%} of capacity (x{p.rate_scale:.3f}), "
                                             f"medians over {len(p.pred.drawn.reports)} draws"), flush=True)
    runs: list[RunData] = []
    with serve(serve_args, log_path=out / "serve.log", cpus=opts.cpus) as url:
        for j in range(1, opts.live_repeats + 1):  # round-robin: A #1, B #1, A #2, B #2, ...
            for p in points:
                if j == 1 and opts.warmup_requests:
                    warm_up(url, p.scaled, texts, opts.warmup_requests, keep)
                label = f"{p.load:.0%} live #{j}"
                live = measure(url, p.scaled, texts, opts.sla_s, 0, opts.progress, label, keep)
                print(format_summary(live.summary, label), flush=True)
                p.replays.append(live)
                write_csv(live.records, out / f"records-{int(p.load * 100)}-{j}.csv")
                runs.append(RunData(label, live.records, live.summary, live.metrics,
                                    {"rate_scale": p.rate_scale}))
                wait_idle(url, 10.0)
    report = write_scored(out, result, [p.result() for p in points], runs, f"fidelity: {wl.name}",
                          opts.sla_s)
    print(f"fidelity.json and {report} written to {out}/ in {time.monotonic() - t_start:.0f} s")
    return 0


def write_scored(out: Path, result: dict[str, Any], points: Sequence[dict[str, Any]], runs: list[RunData],
                 title: str, sla_s: float | None) -> Path:
    """Every point's result into ``result``, the spread table and the matrix score printed and added,
    fidelity.json and report.html written (encoder and LLM alike); returns the report's path."""
    result["points"] = list(points)
    cells = [SpreadCell(**c) for point in points for c in point["spread"]]
    result["spread_table"], result["matrix"] = print_spread(cells)
    (out / "fidelity.json").write_text(json.dumps(result, indent=2, default=str))
    return write_report(out, runs, title=title, sla_s=sla_s,
                        sections=[("The prediction against the replays",
                                   html_table(SPREAD_HEAD, result["spread_table"]["rows"]))])


@dataclass
class LivePoint:
    """One load point: its rows at the point's rate and every live replay of them."""

    load: float
    rate_scale: float
    scaled: Workload
    pred: Prediction | None = None
    replays: list[Measurement] = field(default_factory=list)

    def result(self) -> dict[str, Any]:
        """The point's entry of fidelity.json: the prediction, each replay and the score against them."""
        pred = self.pred
        assert pred is not None
        replays = [m.summary.to_dict() for m in self.replays]
        cells = spread_cells(self.load, SPREAD_METRICS, _metrics(pred)[:len(SPREAD_METRICS)],
                             [summary_metrics(r) for r in replays])
        return {"load": self.load, "rate_scale": self.rate_scale, "predicted": pred.summary.to_dict(),
                "predicted_rejected": pred.drawn.median("failed"),
                "predicted_mean_batch_size": pred.drawn.median("mean_batch_size"),
                "predicted_bands": predicted_bands(pred), "replays": replays,
                "servers": [m.server for m in self.replays], "spread": [c.to_dict() for c in cells]}


# Rescoring: the replays of an earlier run against a prediction made again, from the same profile,
# with today's simulator; with ``--ablate``, also with each term of the service model removed
# (``ServiceModel.without``). The live numbers are read, never fitted on: each prediction still comes
# from the profile alone.



def rescore(wl: Workload, opts: FidelityOptions) -> int:
    """``bench fidelity --rescore DIR``: predict DIR's points again (DIR's profile, the points' rate
    scales, these deployment flags) and score against DIR's replays; writes DIR/rescore.json."""
    folder = Path(str(opts.rescore))
    result = json.loads((folder / "fidelity.json").read_text())
    if result.get("workload") != wl.name or result.get("requests") != len(wl):
        print(f"{folder}/fidelity.json replayed {result.get('requests')} rows of {result.get('workload')}; "
              f"these flags give {len(wl)} of {wl.name}: pass the run's own workload flags", file=sys.stderr)
        return 2
    cost_model, service, deployment = load_prediction_inputs(Path(result["profile"]), opts)
    variants: dict[str, ServiceModel | None] = {"as profiled": service}
    if opts.ablate and service is not None:
        variants |= {f"without {term}": service.without(term) for term in ServiceModel.TERMS}
    scored: dict[str, list[dict[str, Any]]] = {}
    for name, model in variants.items():
        cells: list[SpreadCell] = []
        for pt in result["points"]:
            pred = simulate(wl.scale_rate(pt["rate_scale"]), deployment.scheduler, cost_model, opts.sla_s,
                            model, opts.draws)
            cells += spread_cells(pt["load"], SPREAD_METRICS, _metrics(pred)[:len(SPREAD_METRICS)],
                                  [summary_metrics(r) for r in pt["replays"]])
        scored[name] = [c.to_dict() for c in cells]
        if name == "as profiled":
            print_spread(cells)
    print(f"\n{text_table(*ablation_table(scored, SPREAD_METRICS[:3]))}", flush=True)
    (folder / "rescore.json").write_text(json.dumps({"variants": scored}, indent=2))
    return 0


def ablation_table(scored: dict[str, list[dict[str, Any]]],
                   bias_metrics: Sequence[str]) -> tuple[list[str], list[list[Any]]]:
    """The head and rows of the ablation table: per service-model variant, ``matrix_score`` of its cells
    (the bias of each of ``bias_metrics``, the latency cells and the rejected counts inside)."""
    head = ["service model", *(f"bias {m}" for m in bias_metrics), "latency cells inside", "rejected inside"]
    rows = []
    for name, cells in scored.items():
        spread = [SpreadCell(**c) for c in cells]
        score = matrix_score(spread)
        rejected = [c for c in spread if c.metric == "rejected"]
        bias = [score["bias"].get(m, math.nan) for m in bias_metrics]
        rows.append([name, *(f"{b:+.1%}" if math.isfinite(b) else "-" for b in bias),
                     f"{score['latency_inside']} of {score['latency_cells']}",
                     f"{sum(c.inside for c in rejected)} of {len(rejected)}"])
    return head, rows
