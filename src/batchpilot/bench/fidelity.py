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
from .batch_fit import (
    calibrate_speed,
    calibration_rows,
    delay_under_load,
    fit_live_batches,
    measure_again,
    read_batches,
    speed_moved,
)
from .capacity import probe_workload, wait_idle
from .fidelity_tables import (
    ATTEMPT_HEAD,
    DIAG_HEAD,
    HEAD,
    attempt_row,
    comparison_rows,
    diagnosis_rows,
    speed_rows,
    text_table,
)
from .live_run import calibrate_frontend, measure, warm_up
from .loadgen import build_plan, load_tokenizer
from .records import RequestRecord, Summary, format_summary, write_csv
from .report import RunData, html_table, write_report
from .serverproc import pin_load_generator, pinned, serve

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
    p.add_argument("--calibration-requests", type=int, default=40,
                   help="conv-llm: make each calibration at least this many requests (longer than "
                        "--calibration-s at low rates: 45 s at 50%% load were 14 requests, too few to "
                        "fit the step speed on)")
    p.add_argument("--attempts", type=int, default=3,
                   help="measure a load point again (fresh calibration) when the run's own batches "
                        "(conv-llm: busy steps) took more than --speed-tolerance off the calibrated model, "
                        "up to this many times; every attempt is printed and kept in the JSON")
    p.add_argument("--speed-tolerance", type=float, default=0.05,
                   help="how far the run's total batch (step) time may be from the calibrated model's "
                        "before the CPU is said to have moved (default 5%%)")
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
    pin_load_generator(args.cpus)
    tok = load_tokenizer(args.tokenizer)
    texts = [p.body["input"] for p in build_plan(wl, tokenizer=tok, seed=args.seed)]
    serve_args = ["--profile", str(profile), "--log-level", "warning", *noop,
                  *(["--config", args.config] if args.config else []), *shlex.split(args.serve_args)]
    speed_cal = not args.no_speed_calibration and bool(args.loads)
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
        idle_frontend = frontend

        def speed_fit(k: float, measured: int, label: str) -> tuple[CostModel, FrontEnd | None]:
            rows, cal_texts = calibration_rows(wl, texts, measured, k, args.calibration_s, args.seed)
            cal = calibrate_speed(url, cost_model, batch_log, rows, cal_texts)
            fit = cal.model.meta["live_fit"]
            fe = delay_under_load(idle_frontend, cal.records) if idle_frontend is not None else None
            print(f"{label}: live batches = {fit['alpha']:.3f} x profile + {fit['const_s'] * 1e3:.2f} ms "
                  f"({len(cal.batches)} batches of {len(rows)} calibration requests, median error "
                  f"{fit['median_rel_error']:.1%})"
                  + (f"; delay outside the batcher under load {fe.delay_const_s * 1e3:.2f} ms + "
                     f"{fe.delay_per_token_s * 1e6:.2f} us/token" if fe is not None else ""), flush=True)
            result.setdefault("speed_fits", []).append({"label": label, "rate_scale": k, **fit,
                                                        "frontend": fe.to_dict() if fe else None})
            return cal.model, fe

        if speed_cal:  # at a rate the profile calls busy but not saturated; then the capacity again
            k0 = 0.65 * cap.capacity
            service, _ = speed_fit(k0, len(probe_workload(wl, k0, args.max_live_s)), "capacity")
            cap = sim_capacity(wl, config, service, args.sla, args.noise)
            print(f"simulated capacity at the live speed: rate scale {cap.capacity:.3f} = "
                  f"{cap.rps:.2f} req/s", flush=True)
            result.update(capacity_scale=cap.capacity, capacity_rps=cap.rps)
        attempts_rows: list[list[Any]] = []
        for load in args.loads:
            k = load * cap.capacity
            scaled = probe_workload(wl, k, args.max_live_s)  # the same rows for the simulator and live
            if len(scaled) < len(wl):
                print(f"{load:.0%}: replaying the first {len(scaled)} of {len(wl)} rows (--max-live-s "
                      f"{args.max_live_s:g})", flush=True)
            tries = args.attempts if speed_cal else 1
            for attempt in range(1, tries + 1):
                if speed_cal:  # right before the measured run: this CPU's speed moves within minutes
                    service, frontend = speed_fit(k, len(scaled), f"{load:.0%}")
                core = simulate(scaled, as_served, cost_model, args.sla, args.noise, args.seed, None, service)
                pred = core if frontend is None else simulate(scaled, as_served, cost_model, args.sla,
                                                              args.noise, args.seed, frontend, service)
                log_from = batch_log.stat().st_size if batch_log.exists() else 0
                live = measure(url, scaled, texts, args.sla, args.warmup_requests, not args.no_progress,
                               f"{load:.0%} live")
                print(format_summary(pred.summary, f"simulated at {load:.0%} of capacity (x{k:.3f})"))
                print(format_summary(live.summary, f"live at {load:.0%} of capacity (x{k:.3f})"), flush=True)
                run_batches = read_batches(batch_log, log_from)[0] if speed_cal else []
                moved = speed_moved(service, run_batches) if run_batches else math.nan
                held = not speed_cal or abs(moved) <= args.speed_tolerance
                load_avg = os.getloadavg()[0]
                print(f"machine load average (1 min) after the run: {load_avg:.1f} on {os.cpu_count()} cores"
                      + (f"; the run's batches took {moved:+.1%} against the calibration's model" if speed_cal
                         else ""), flush=True)
                attempts_rows.append(attempt_row(load, attempt, moved, held or attempt == tries, pred, live))
                result["points"].append({"load": load, "rate_scale": k, "rows": len(scaled),
                                         "attempt": attempt, "speed_moved": moved, "speed_held": held,
                                         "predicted": pred.summary.to_dict(),
                                         "predicted_core_only": core.summary.to_dict(),
                                         "predicted_mean_batch_size": pred.report.mean_batch_size,
                                         "predicted_mean_batch_s": pred.mean_batch_s,
                                         "predicted_mean_queue_s": pred.mean_queue_s,
                                         "measured": live.summary.to_dict(), "server": live.server,
                                         "load_average_1m": load_avg})
                write_csv(live.records, out / f"records-{int(load * 100)}-{attempt}.csv")
                wait_idle(url, 10.0)
                if held or not measure_again(load, moved, args.speed_tolerance, attempt, tries, "batches"):
                    break
            own = None
            if speed_cal and len(run_batches) >= 30:  # hindsight: the simulator with the run's own costs
                own = simulate(scaled, as_served, cost_model, args.sla, args.noise, args.seed, frontend,
                               fit_live_batches(cost_model, run_batches))
            rows += comparison_rows(load, k, pred, live, core, own)
            diag += diagnosis_rows(load, pred, live, service)
            if speed_cal:
                diag += speed_rows(load, service, cost_model, run_batches)
            runs.append(RunData(f"live {load:.0%}", live.records, live.summary, live.metrics,
                                {"rate_scale": k}))
            runs.append(RunData(f"simulated {load:.0%}", pred.records, pred.summary, None, {"rate_scale": k}))
    table = text_table(HEAD, rows) if rows else ""
    diag_table = text_table(DIAG_HEAD, diag)
    print("\nFidelity: simulator prediction vs live measurement\n" + table)
    print("\nWhere the time goes (means; server histograms over the same runs)\n" + diag_table, flush=True)
    sections = [("Fidelity: predicted vs measured", html_table(HEAD, rows)),
                ("Where the time goes", html_table(DIAG_HEAD, diag))]
    if speed_cal and args.loads:
        print("\nEvery attempt (the table above shows the last of each load)\n"
              + text_table(ATTEMPT_HEAD, attempts_rows), flush=True)
        sections.append(("Every attempt", html_table(ATTEMPT_HEAD, attempts_rows)))
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
