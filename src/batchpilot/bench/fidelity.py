"""Does the simulator predict the live server? profile -> simulate -> serve -> replay -> compare.

1. Cost model: ``--profile profile.json`` or a fresh ``batchpilot profile`` run.
2. Capacity from the simulator: the highest rate scale of the slice whose simulated P99 meets the SLA,
   found with the tuner's own capacity search (``sim.tune.Tuner.capacity``).
3. For each load (default 50% and 80% of that capacity): simulate the slice at that rate scale with
   the config and cost model (prediction); start ``batchpilot serve`` with the same config and profile
   on a free port, warm it, and replay the same rows at the same times (measurement).
4. Table: predicted vs measured P50, P99, throughput, mean batch size (the server's
   ``batchpilot_batch_size`` histogram), with the targets (P50/P99 10%, throughput 5%).
5. Diagnosis, from the server's own histograms over the same run: where the measured latency goes
   (client HTTP + tokenisation outside the batcher, queueing, executor) against the simulator's split,
   and the executor's mean time per batch against the cost model's prediction for the same mean shape.
6. Tuner check (``--tuned-config`` or ``--tune``): the tuner's config against the default, both live:
   capacity (highest rate with P99 <= SLA, the DESIGN's goodput) by a bounded live search, and the
   goodput (requests within the SLA per second) at one shared rate — ratios beside the simulator's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shlex
import subprocess
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..core.config import SchedulerConfig
from ..core.costmodel import CostModel
from ..sim.frontend import FrontEnd
from ..sim.target import DONE
from ..sim.traces import Workload
from .batch_fit import calibrate_speed, calibration_rows, fit_live_batches, read_batches
from .capacity import probe_workload, wait_idle
from .fidelity_tables import DIAG_HEAD, HEAD, comparison_rows, diagnosis_rows, text_table
from .loadgen import LoadGenConfig, build_plan, load_tokenizer, one_by_one_async, replay
from .records import RequestRecord, Summary, format_summary, summarize, write_csv
from .report import RunData, html_table, write_report
from .scrape import MetricsSeries
from .serverproc import pinned, serve

DEFAULT_REQUESTS = 400


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None, help="scheduler YAML (default: SchedulerConfig())")
    p.add_argument("--profile", default=None,
                   help="cost-model profile JSON (default: run batchpilot profile)")
    p.add_argument("--profile-args", default="", help="extra args for `batchpilot profile`")
    p.add_argument("--loads", type=float, nargs="*", default=[0.5, 0.8],
                   help="fractions of simulated capacity (none: only the tuner check)")
    p.add_argument("--noise", action="store_true", help="simulate with sampled residual noise")
    p.add_argument("--tuned-config", default=None, help="tuner's YAML: measure it live against the default")
    p.add_argument("--baseline-config", default=None,
                   help="tuner check: compare against this YAML instead of SchedulerConfig() (the default)")
    p.add_argument("--tune", action="store_true",
                   help="run `batchpilot tune` on the slice for the tuner check")
    p.add_argument("--tune-args", default="--candidates 32", help="extra args for `batchpilot tune`")
    p.add_argument("--probe-s", type=float, default=20.0, help="tuner check: seconds of arrivals per probe")
    p.add_argument("--warmup-requests", type=int, default=30, help="unmeasured requests before each live run")
    p.add_argument("--noop-delay-ms", type=float, default=None,
                   help="serve the no-op model with this fixed time per batch and simulate exactly that "
                        "cost: checks the serving path (HTTP, tokenise, batcher, loop) without model noise")
    p.add_argument("--max-live-s", type=float, default=150.0,
                   help="cut each live run to the rows arriving in its first S seconds (same rows simulated)")
    p.add_argument("--no-frontend", action="store_true",
                   help="do not calibrate the serving path outside the batcher (sim.frontend); predict the "
                        "batcher alone")
    p.add_argument("--llm-calibration", choices=("live", "lockstep"), default="live",
                   help="conv-llm: fit the step model on the live server's own steps while it replays a "
                        "calibration slice of the trace (rows the measured run does not use) before each "
                        "load point (live), or add a serving overhead measured with lockstep streams to "
                        "the step profile (lockstep)")
    p.add_argument("--calibration-s", type=float, default=45.0,
                   help="seconds of calibration traffic per load point (conv-llm with --llm-calibration "
                        "live; embeddings unless --no-speed-calibration)")
    p.add_argument("--no-speed-calibration", action="store_true",
                   help="embeddings: simulate with the profile as it is, instead of fitting its speed on "
                        "the live server's own batches (serve --batch-log) right before each load point")
    p.add_argument("--frontend-requests", type=int, default=60,
                   help="rows sent one at a time (twice each) to calibrate the front end")
    p.add_argument("--cpus", default=None,
                   help="pin the profiler and the server to these cores (taskset -c syntax, e.g. 1); the "
                        "load generator then runs on the others. On a shared machine one pinned core with "
                        "one torch thread is far steadier than two threads competing with other processes")


def load_config(path: str | None) -> SchedulerConfig:
    if not path:
        return SchedulerConfig()
    import yaml

    return SchedulerConfig.from_dict(yaml.safe_load(Path(path).read_text()))


@dataclass
class Prediction:
    summary: Summary
    report: Any  # sim.metrics.SimReport
    mean_batch_s: float  # mean simulated executor time per batch
    mean_queue_s: float
    mean_tokens: float  # mean computed tokens per batch
    records: list[RequestRecord] = field(default_factory=list)  # the simulated requests, for the plots


def simulate(workload: Workload, config: SchedulerConfig, cost_model: CostModel, sla_s: float,
             noise: bool = False, seed: int = 0, frontend: FrontEnd | None = None,
             service_model: CostModel | None = None) -> Prediction:
    """Simulate ``workload`` and express the result as a ``Summary`` (plus the simulator's own report).
    The scheduler decides with ``cost_model`` (the profile the server was given); batches take
    ``service_model``'s time (default the same: the live-calibrated one when there is one)."""
    from ..sim.metrics import summarize as sim_summarize
    from ..sim.target import simulate_encoder

    run = simulate_encoder(workload, config, cost_model, service_model=service_model, noise=noise, seed=seed,
                           frontend=frontend)
    rep = sim_summarize(run, sla_s)

    done = np.asarray(run.record.status) == DONE
    finish = np.asarray(run.record.finish_s, dtype=float)
    if frontend is not None:
        finish = finish - frontend.delay(workload.input_tokens)
    at = workload.arrival_s if run.batcher_arrival_s is None else run.batcher_arrival_s
    rep.extra["batcher_latency_mean_s"] = float(np.mean((finish - at)[done])) if done.any() else math.nan
    lat = {k: rep.latency[k] for k in ("p50", "p90", "p99", "p99.9")}
    failed = rep.num_measured - rep.num_completed
    s = Summary(num_requests=rep.num_measured, num_ok=rep.num_completed, num_warmup=0,
                duration_s=rep.num_completed / rep.throughput_rps if rep.throughput_rps else 0.0,
                offered_rps=rep.offered_rps, throughput_rps=rep.throughput_rps, goodput_rps=rep.goodput_rps,
                sla_s=sla_s, sla_met=bool(rep.p99_all <= sla_s), latency=lat,
                latency_mean_s=rep.latency["mean"], latency_max_s=math.nan,
                send_lag={"p50": 0.0, "p99": 0.0}, send_lag_max_s=0.0,
                errors={"rejected/dropped/unfinished": failed} if failed else {})
    dur, tok = run.record.b_duration, run.record.b_tokens
    recs = [RequestRecord(i, t, int(n), sent_s=t, done_s=f, status=200 if st == DONE else 0, latency_s=f - t)
            for i, (t, n, f, st) in enumerate(zip(workload.arrival_s.tolist(), workload.input_tokens.tolist(),
                                                  run.record.finish_s, run.record.status, strict=True))]
    return Prediction(s, rep, sum(dur) / len(dur) if dur else math.nan, rep.queue["mean"],
                      sum(tok) / len(tok) if tok else math.nan, recs)


def sim_capacity(workload: Workload, config: SchedulerConfig, cost_model: CostModel, sla_s: float,
                 noise: bool = False) -> Any:
    """The tuner's capacity search for one config: a ``sim.tune.Candidate`` with ``capacity`` (rate
    scale), ``rps`` and the passing ``report`` at capacity."""
    from ..sim.tune import Candidate, TuneConfig, Tuner

    tuner = Tuner(workload, cost_model, TuneConfig(sla_p99_s=sla_s, noise=noise))
    cand = Candidate("config", config)
    tuner.capacity(cand, workload, rel_tol=0.02, start=1.0)
    return cand


def served_config(config: SchedulerConfig, serve_args: str) -> SchedulerConfig:
    """The config as ``batchpilot serve`` runs it: with the SLA queue bounds (``core.overload``) unless
    the server is told ``--no-overload-limits`` or the config has limits of its own, so the simulator
    refuses what the server refuses."""
    if "--no-overload-limits" in shlex.split(serve_args):
        return config
    from ..core.overload import with_sla_queue_bounds

    return with_sla_queue_bounds(config)


def run_profile(out: Path, padding: str, extra: str = "", cpus: str | None = None) -> Path:
    """``batchpilot profile -o PATH`` (the models team's profiler) in a subprocess, pinned like the server."""
    path = out / "profile.json"
    cmd = [*pinned(cpus), sys.executable, "-m", "batchpilot.cli", "profile", "--output", str(path),
           "--padding", "none" if padding == "none" else "dynamic", *shlex.split(extra)]
    print("profiling:", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    return path


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


def _histogram_mean(series: MetricsSeries, name: str) -> float:
    base, _, labels = name.partition("{")
    return series.histogram_mean(base, labels.rstrip("}"))


def measure(url: str, workload: Workload, texts: list[str], sla_s: float, warmup_requests: int,
            progress: bool, label: str) -> Measurement:
    """Warm the server with a few unmeasured requests, let it drain, then replay ``workload`` exactly."""
    if warmup_requests:
        warm_up(url, workload, texts, warmup_requests)
    plan = build_plan(workload, texts=texts[: len(workload)])  # a cut slice is a prefix of the texts' rows
    res = replay(plan, LoadGenConfig(url, progress=progress), description=label)
    m = Measurement(summarize(res.records, sla_s), res.records, res.metrics)
    if res.metrics is not None:
        m.server = {k: _histogram_mean(res.metrics, v) for k, v in SERVER_HISTOGRAMS.items()}
        batches = res.metrics.delta("batchpilot_batch_size_count")
        for key, counter in (("computed_tokens_per_batch", "batchpilot_computed_tokens_total"),
                             ("useful_tokens_per_batch", "batchpilot_useful_tokens_total")):
            m.server[key] = res.metrics.delta(counter) / batches if batches > 0 else math.nan
    return m


def warm_up(url: str, workload: Workload, texts: list[str], n: int) -> None:
    """Send the first ``n`` rows (unmeasured) and wait for the queue to drain: the first calls of a fresh
    server are slow (allocator, kernels for new shapes), which is not what a fidelity check measures."""
    warm = workload.slice(0, min(n, len(workload)))
    replay(build_plan(warm, texts=texts[: len(warm)], warmup_requests=len(warm)),
           LoadGenConfig(url, progress=False, scrape_interval_s=0))
    wait_idle(url, 10.0)


def calibrate_frontend(url: str, workload: Workload, texts: list[str], n: int = 60,
                       rounds: int = 2) -> tuple[FrontEnd, list[RequestRecord]]:
    """Fit the simulator's front end (``sim.frontend.FrontEnd``) on this server: ``n`` rows spread over
    the slice's lengths, sent one at a time (``rounds`` times each, no queueing anywhere), with the
    server's ``Server-Timing`` split of each request."""
    order = np.argsort(workload.input_tokens, kind="stable")
    pick = sorted({int(order[int(q)]) for q in np.linspace(0, len(order) - 1, min(n, len(order)))})
    plan_all = build_plan(workload, texts=texts[: len(workload)])
    plan = [plan_all[i] for i in pick] * rounds
    recs = asyncio.run(one_by_one_async(plan, LoadGenConfig(url, progress=False, scrape_interval_s=0)))
    ok = [r for r in recs if r.ok]
    fe = FrontEnd.fit(np.array([r.input_tokens for r in ok]), np.array([r.latency_s for r in ok]),
                      np.array([r.server_tokenize_s for r in ok]), np.array([r.server_batcher_s for r in ok]))
    return fe, recs


def main(args: argparse.Namespace) -> int:
    from ..sim.workloads import load_workload

    if args.workload == "conv-llm":
        from .llm_fidelity import main as llm_main

        return llm_main(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.monotonic()
    config = load_config(args.config)
    noop: list[str] = []
    if args.noop_delay_ms is not None:  # the cost model is exact by construction: a fixed time per batch
        profile = out / "noop_profile.json"
        CostModel(latency_coef=(args.noop_delay_ms / 1e3, 0.0, 0.0, 0.0),
                  meta={"source": f"noop {args.noop_delay_ms:g} ms per batch"}).save(profile)
        noop = ["--noop", "--noop-delay-ms", str(args.noop_delay_ms)]
    elif args.profile:
        profile = Path(args.profile)
    else:
        profile = run_profile(out, config.planner.padding, args.profile_args, args.cpus)
    cost_model = CostModel.load(profile)
    wl = load_workload(args.workload, 1.0, args.start, args.requests or DEFAULT_REQUESTS, trace=args.trace)
    print(f"workload {args.workload} rows [{args.start}, {args.start + len(wl)}) over {wl.duration_s:.1f} s "
          f"({wl.mean_rate:.2f} req/s); config {args.config or 'default'}; profile {profile}", flush=True)
    cap = sim_capacity(wl, config, cost_model, args.sla, args.noise)
    print(f"simulated capacity: rate scale {cap.capacity:.3f} = {cap.rps:.2f} req/s (P99 <= {args.sla:g} s)",
          flush=True)
    if cap.capacity <= 0:
        one = cost_model.latency({"const": 1.0, "n": 1.0, "tokens": 128.0, "attn": 128.0**2})
        print(f"no rate meets P99 <= {args.sla:g} s in simulation: the profile predicts {one * 1e3:.0f} ms "
              "for one 128-token input. Was the machine busy while profiling? Re-profile (try --cpus 1).",
              file=sys.stderr)
        return 1
    as_served = served_config(config, args.serve_args)
    adm = as_served.admission
    work = f"{adm.max_backlog_s * 1e3:.0f} ms" if adm.max_backlog_s else "inf"
    print(f"simulating the server's admission: queue <= {adm.max_queued_requests or 'inf'} inputs / "
          f"{adm.max_queued_tokens or 'inf'} tokens, predicted backlog <= {work}", flush=True)
    _pin_self(args.cpus)
    tok = load_tokenizer(args.tokenizer)
    texts = [p.body["input"] for p in build_plan(wl, tokenizer=tok, seed=args.seed)]
    serve_args = ["--profile", str(profile), "--log-level", "warning", *noop,
                  *(["--config", args.config] if args.config else []), *shlex.split(args.serve_args)]
    speed_cal = not args.no_speed_calibration and args.noop_delay_ms is None and bool(args.loads)
    batch_log = (out / "batches.jsonl").resolve()
    batch_log.unlink(missing_ok=True)
    if speed_cal:
        serve_args += ["--batch-log", str(batch_log)]
    rows: list[list[Any]] = []
    diag: list[list[Any]] = []
    runs: list[RunData] = []
    result: dict[str, Any] = {"workload": args.workload, "start": args.start, "requests": len(wl),
                              "config": args.config, "profile": str(profile), "capacity_scale": cap.capacity,
                              "capacity_rps": cap.rps, "points": []}
    server = serve(serve_args, log_path=out / "serve.log", cpus=args.cpus) if args.loads else nullcontext("")
    frontend: FrontEnd | None = None
    with server as url:
        if args.loads and not args.no_frontend:
            warm_up(url, wl, texts, args.warmup_requests)
            frontend, cal = calibrate_frontend(url, wl, texts, args.frontend_requests)
            write_csv(cal, out / "records-frontend.csv")
            result["frontend"] = frontend.to_dict()
            print(f"front end (one request at a time, {len(cal)} requests): serial (tokenizer thread) "
                  f"{frontend.serial_const_s * 1e3:.2f} ms + "
                  f"{frontend.serial_per_token_s * 1e6:.2f} us/token, "
                  f"delay (HTTP, JSON, client) {frontend.delay_const_s * 1e3:.2f} ms + "
                  f"{frontend.delay_per_token_s * 1e6:.2f} us/token; mean outside the batcher "
                  f"{frontend.mean_s(wl.input_tokens) * 1e3:.2f} ms", flush=True)
        service = cost_model  # what batches cost now: the profile, or its speed fitted on live batches

        def speed_fit(k: float, measured: int, label: str) -> CostModel:
            rows, cal_texts = calibration_rows(wl, texts, measured, k, args.calibration_s, args.seed)
            model, batches = calibrate_speed(url, cost_model, batch_log, rows, cal_texts)
            fit = model.meta["live_fit"]
            print(f"{label}: live batches = {fit['alpha']:.3f} x profile + {fit['const_s'] * 1e3:.2f} ms "
                  f"({len(batches)} batches of {len(rows)} calibration requests, median error "
                  f"{fit['median_rel_error']:.1%})", flush=True)
            result.setdefault("speed_fits", []).append({"label": label, "rate_scale": k, **fit})
            return model

        if speed_cal:  # at a rate the profile calls busy but not saturated; then the capacity again
            k0 = 0.65 * cap.capacity
            service = speed_fit(k0, len(probe_workload(wl, k0, args.max_live_s)), "capacity")
            cap = sim_capacity(wl, config, service, args.sla, args.noise)
            print(f"simulated capacity at the live speed: rate scale {cap.capacity:.3f} = "
                  f"{cap.rps:.2f} req/s", flush=True)
            result.update(capacity_scale=cap.capacity, capacity_rps=cap.rps)
        for load in args.loads:
            k = load * cap.capacity
            scaled = probe_workload(wl, k, args.max_live_s)  # the same rows for the simulator and live
            if len(scaled) < len(wl):
                print(f"{load:.0%}: replaying the first {len(scaled)} of {len(wl)} rows (--max-live-s "
                      f"{args.max_live_s:g})", flush=True)
            if speed_cal:  # right before the measured run: this CPU's speed moves within minutes
                service = speed_fit(k, len(scaled), f"{load:.0%}")
            core = simulate(scaled, as_served, cost_model, args.sla, args.noise, args.seed, None, service)
            pred = core if frontend is None else simulate(scaled, as_served, cost_model, args.sla, args.noise,
                                                          args.seed, frontend, service)
            log_from = batch_log.stat().st_size if batch_log.exists() else 0
            live = measure(url, scaled, texts, args.sla, args.warmup_requests, not args.no_progress,
                           f"{load:.0%} live")
            print(format_summary(pred.summary, f"simulated at {load:.0%} of capacity (x{k:.3f})"))
            print(format_summary(live.summary, f"live at {load:.0%} of capacity (x{k:.3f})"), flush=True)
            rows += comparison_rows(load, k, pred, live, core)
            diag += diagnosis_rows(load, pred, live, service)
            if speed_cal:
                diag += speed_rows(load, service, cost_model, read_batches(batch_log, log_from)[0])
            write_csv(live.records, out / f"records-{int(load * 100)}.csv")
            load_avg = os.getloadavg()[0]
            print(f"machine load average (1 min) after the run: {load_avg:.1f} on {os.cpu_count()} cores",
                  flush=True)
            runs.append(RunData(f"live {load:.0%}", live.records, live.summary, live.metrics,
                                {"rate_scale": k}))
            runs.append(RunData(f"simulated {load:.0%}", pred.records, pred.summary, None, {"rate_scale": k}))
            result["points"].append({"load": load, "rate_scale": k, "rows": len(scaled),
                                     "predicted": pred.summary.to_dict(),
                                     "predicted_core_only": core.summary.to_dict(),
                                     "predicted_mean_batch_size": pred.report.mean_batch_size,
                                     "predicted_mean_batch_s": pred.mean_batch_s,
                                     "predicted_mean_queue_s": pred.mean_queue_s,
                                     "measured": live.summary.to_dict(), "server": live.server,
                                     "load_average_1m": load_avg})
            wait_idle(url, 10.0)
    table = text_table(HEAD, rows) if rows else ""
    diag_table = text_table(DIAG_HEAD, diag)
    print("\nFidelity: simulator prediction vs live measurement\n" + table)
    print("\nWhere the time goes (means; server histograms over the same runs)\n" + diag_table, flush=True)
    sections = [("Fidelity: predicted vs measured", html_table(HEAD, rows)),
                ("Where the time goes", html_table(DIAG_HEAD, diag))]
    tuned_path = None
    if args.tuned_config or args.tune:
        from .tuner_check import run_tune, tuner_check

        tuned_path = args.tuned_config or run_tune(out, args, profile)
    if tuned_path:
        tuned = tuner_check(args, wl, texts, cost_model, profile, tuned_path)
        result["tuner"] = tuned
        sections.append(("Tuner check", f"<pre>{json.dumps(tuned, indent=2, default=str)}</pre>"))
    (out / "fidelity.json").write_text(json.dumps(result, indent=2, default=str))
    report = write_report(out, runs, title=f"fidelity: {args.workload}", sla_s=args.sla, sections=sections)
    print(f"fidelity.json and {report} written to {out}/ in {time.monotonic() - t_start:.0f} s")
    return 0


def speed_rows(load: float, service: CostModel, profile: CostModel, run: list[Any]) -> list[list[Any]]:
    """The speed fitted before the run against the same fit on the measured run's own batches (hindsight,
    not a prediction: how far the CPU moved between calibration and run)."""
    fit = service.meta["live_fit"]
    try:
        own = fit_live_batches(profile, run).meta["live_fit"]
    except ValueError:
        own = {"alpha": math.nan, "const_s": math.nan}
    return [[f"{load:.0%}", "live speed: alpha x profile (calibration | the run's own batches)",
             round(fit["alpha"], 3), round(own["alpha"], 3)],
            [f"{load:.0%}", "  + per-batch serving cost", round(fit["const_s"] * 1e3, 2),
             round(own["const_s"] * 1e3, 2)]]


def _cores(cpus: str) -> set[int]:
    """``taskset -c`` syntax (``1``, ``0,2``, ``1-3``) as a set of core numbers."""
    out: set[int] = set()
    for part in cpus.split(","):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def _pin_self(cpus: str | None) -> None:
    """Move the load generator off the server's cores (when the server is pinned and others remain)."""
    if not cpus or not hasattr(os, "sched_setaffinity"):
        return
    server = _cores(cpus)
    rest = set(os.sched_getaffinity(0)) - server
    if rest:
        os.sched_setaffinity(0, rest)
        print(f"load generator pinned to cores {sorted(rest)}, server and profiler to {sorted(server)}")
