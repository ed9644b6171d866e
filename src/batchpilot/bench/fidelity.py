"""Does the simulator predict the live server? profile -> predict -> serve -> replay -> compare.

    batchpilot bench fidelity --workload conv-embed [--profile p.json] [--cpus 1] [deployment flags]
    batchpilot bench fidelity --workload mmpp:rate_on=40,rate_off=4,on_s=10,off_s=30 --lengths bimodal:...

1. Profile: ``--profile`` or a fresh ``batchpilot profile`` run (pinned like the server with ``--cpus``),
   made before any measured traffic. It holds the batch cost model and the serving path outside the
   batcher (``frontend``); the prediction uses that file (with ``--speed-check``, rechecked before
   each point, step 4) and nothing else. Nothing is fitted on the traffic being measured, and each
   point is scored on its first replay (``--live-repeats`` replays it again only to show how far the
   live run agrees with itself).
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

import argparse
import dataclasses
import json
import math
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from batchpilot.bench.capacity import wait_idle
from batchpilot.bench.fidelity_table import (
    HEAD,
    REPEAT_HEAD,
    comparison_rows,
    predicted_bands,
    repeat_rows,
    text_table,
)
from batchpilot.bench.live_run import measure, warm_up
from batchpilot.bench.loadgen import build_plan, load_tokenizer
from batchpilot.bench.profile_run import run_profile, run_recheck
from batchpilot.bench.records import Summary, format_summary, write_csv
from batchpilot.bench.report import RunData, html_table, write_report
from batchpilot.bench.run_speed import WINDOW_S, run_speed
from batchpilot.bench.serverproc import client_keepalive_s, pin_load_generator, serve
from batchpilot.config_file import add_deployment_args, deployment_flags, spec_from_args
from batchpilot.core.config import SchedulerConfig
from batchpilot.core.costmodel import CostModel
from batchpilot.runtime.json_lines import wait_written
from batchpilot.sim.draws import DEFAULT_DRAWS
from batchpilot.sim.frontend import FrontEnd
from batchpilot.sim.traces import Workload

DEFAULT_REQUESTS = 1000


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_deployment_args(p)
    p.add_argument("--profile", default=None, help="profile JSON (default: run `batchpilot profile` first)")
    p.add_argument("--profile-args", default="", help="extra args for `batchpilot profile`")
    p.add_argument("--loads", type=float, nargs="*", default=[0.5, 0.8],
                   help="fractions of the predicted capacity")
    p.add_argument("--lengths", default="lognormal:median=128,sigma=0.8",
                   help="synthetic workloads: input lengths (as `simulate --lengths`)")
    p.add_argument("--speed-check", action="store_true",
                   help="before each point, `batchpilot profile --recheck` times the profile's batches "
                        "again and the point is predicted at that speed, the profile-alone error beside "
                        "(models/speed_check.py; on a shared VM it did worse than the profile alone: "
                        "docs/benchmarks.md)")
    p.add_argument("--batcher-only", action="store_true",
                   help="predict without the profile's serving path (HTTP, JSON, tokenisation)")
    p.add_argument("--warmup-requests", type=int, default=30, help="unmeasured requests before each point")
    p.add_argument("--live-repeats", type=int, default=1,
                   help="replay each point this many times on the same server; the repeats are compared "
                        "with the first run (how far the live run agrees with itself), never predicted")
    p.add_argument("--draws", type=int, default=DEFAULT_DRAWS,
                   help="service-noise draws per prediction: each metric is predicted as its median over "
                        "them, with the 5-95%% band beside it (sim.draws)")
    p.add_argument("--noop-delay-ms", type=float, default=None,
                   help="serve the no-op model with this fixed time per batch, profiled as exactly that: "
                        "checks the serving path (HTTP, tokenise, batcher, loop) without model noise")
    p.add_argument("--cpus", default=None,
                   help="pin the profiler and the server to these cores (taskset -c syntax, e.g. 1); the "
                        "load generator runs on the others")
    from batchpilot.bench.llm_fidelity import add_llm_arguments

    add_llm_arguments(p)


def load_workload(args: argparse.Namespace) -> Workload:
    """A standard workload or trace (rows ``--start``..), or a synthetic spec with ``--lengths``."""
    from batchpilot.sim.cli import resolve_workload

    ns = argparse.Namespace(workload=args.workload, trace=args.trace, rate_scale=1.0, start=args.start,
                            requests=args.requests or DEFAULT_REQUESTS, lengths=args.lengths, priorities="",
                            seed=args.seed)
    return resolve_workload(ns)


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


def main(args: argparse.Namespace) -> int:
    from batchpilot.sim.cli import resolve

    if args.workload == "conv-llm":
        from batchpilot.bench.llm_fidelity import main as llm_main

        return llm_main(args)
    if args.draws < 1:
        print(f"--draws must be >= 1, got {args.draws}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.monotonic()
    spec = spec_from_args(args)
    noop: list[str] = []
    if args.noop_delay_ms is not None:  # the profile is exact by construction: a fixed time per batch
        profile = out / "noop_profile.json"
        CostModel(latency_coef=(args.noop_delay_ms / 1e3, 0.0, 0.0, 0.0),
                  meta={"source": f"noop {args.noop_delay_ms:g} ms per batch"}).save(profile)
        noop = ["--noop", "--noop-delay-ms", str(args.noop_delay_ms)]
    elif args.profile:
        profile = Path(args.profile)
    else:
        profile = run_profile(out, spec.encoder.planner.padding, args.profile_args, args.cpus)
    cost_model = CostModel.load(profile)
    frontend = None if args.batcher_only else FrontEnd.from_profile(profile)
    frontend = frontend and frontend.serving(spec.server.tokenizer_workers)
    deployment = resolve(spec, cost_model)
    check = args.speed_check and args.noop_delay_ms is None  # a no-op profile is exact
    wl = load_workload(args)
    print(f"workload {wl.name}: {len(wl)} requests over {wl.duration_s:.1f} s ({wl.mean_rate:.2f} req/s); "
          f"profile {profile}; serving path {'from the profile' if frontend else 'left out'}\n"
          f"deployment: {deployment.describe()}", flush=True)
    cap = predicted_capacity(wl, cost_model, spec, frontend, args.sla)
    print(f"predicted capacity: rate scale {cap.capacity:.3f} = {cap.rps:.2f} req/s (P99 <= {args.sla:g} s)",
          flush=True)
    if cap.capacity <= 0:
        print(f"no rate meets P99 <= {args.sla:g} s in simulation; was the machine busy while profiling?",
              file=sys.stderr)
        return 1
    pin_load_generator(args.cpus)
    tok = load_tokenizer(args.tokenizer)
    texts = [p.body["input"] for p in build_plan(wl, tokenizer=tok, seed=args.seed)]
    batch_log = (out / "batches.jsonl").resolve()
    batch_log.unlink(missing_ok=True)
    serve_args = ["--profile", str(profile), "--log-level", "warning", "--batch-log", str(batch_log), *noop,
                  *deployment_flags(args), *shlex.split(args.serve_args)]
    rows: list[list[Any]] = []
    repeats: list[list[Any]] = []
    runs: list[RunData] = []
    result: dict[str, Any] = {"workload": wl.name, "requests": len(wl), "profile": str(profile),
                              "deployment": deployment.describe(), "capacity_scale": cap.capacity,
                              "capacity_rps": cap.rps, "cpus": args.cpus, "points": []}
    keep = client_keepalive_s(serve_args, args.keepalive_s)  # pooled as a gateway pools them
    with serve(serve_args, log_path=out / "serve.log", cpus=args.cpus) as url:
        for load in args.loads:
            k = load * cap.capacity
            scaled = wl.scale_rate(k)
            alone = simulate(scaled, deployment.scheduler, cost_model, args.sla, frontend, draws=args.draws)
            checked = math.nan
            if check:  # the machine's speed now, before any of the point's traffic: the prediction's
                checked = run_recheck(out, profile, args.cpus, f"profile-now-{int(load * 100)}.json")
                pred = simulate(scaled, deployment.scheduler, cost_model, args.sla, frontend, checked,
                                args.draws)
            else:
                pred = alone
            if args.warmup_requests:
                warm_up(url, scaled, texts, args.warmup_requests, keep)
            wait_written()  # the warm-up's batches are in the log: the point's start after them
            offset = batch_log.stat().st_size if batch_log.exists() else 0
            live = measure(url, scaled, texts, args.sla, 0, not args.no_progress, f"{load:.0%} live", keep)
            wait_written()
            rs = run_speed(batch_log, offset, cost_model, frontend, live.sent_monotonic())
            speed = rs.speed
            print(format_summary(pred.summary, f"predicted at {load:.0%} of capacity (x{k:.3f}), medians "
                                               f"over {len(pred.drawn.reports)} draws"
                                 + (f", at the speed checked before it ({checked:+.1%})" if check else "")))
            print(format_summary(live.summary, f"live at {load:.0%} of capacity (x{k:.3f})"))
            splits = (("idle time before the batch", rs.by_idle), ("requests in the batch", rs.by_size),
                      ("request rate before the batch", rs.by_rate), ("busy share before it", rs.by_busy))
            print(f"the run's {rs.batches} batches took {speed:+.1%} against the profile "
                  f"({WINDOW_S:g} s windows: {rs.spread}); "
                  + "; ".join(f"by {what}: " + ", ".join(f"{lab} {r:+.1%} ({n})" for lab, n, r in cells)
                              for what, cells in splits), flush=True)
            later = simulate(scaled, deployment.scheduler, cost_model, args.sla, frontend, speed,
                             args.draws) if math.isfinite(speed) else None
            rows += comparison_rows(load, k, pred, live, speed, later, rs.spread, checked,
                                    alone if check else None)
            point: dict[str, Any] = {"load": load, "rate_scale": k, "speed_vs_profile": speed,
                                     "speed_checked_before": checked,
                                     "predicted_profile_alone": alone.summary.to_dict(),
                                     "run_speed": rs.to_dict(), "predicted": pred.summary.to_dict(),
                                     "predicted_rejected": pred.drawn.median("failed"),
                                     "predicted_mean_batch_size": pred.drawn.median("mean_batch_size"),
                                     "predicted_bands": predicted_bands(pred),
                                     "measured": live.summary.to_dict(), "server": live.server, "repeats": []}
            for j in range(2, args.live_repeats + 1):
                wait_idle(url, 10.0)
                wait_written()
                offset = batch_log.stat().st_size if batch_log.exists() else 0
                again = measure(url, scaled, texts, args.sla, 0, not args.no_progress,
                                f"{load:.0%} live #{j}", keep)
                wait_written()
                rs_again = run_speed(batch_log, offset, cost_model, frontend, again.sent_monotonic())
                repeats += repeat_rows(load, live, again, (rs.speed, rs_again.speed))
                point["repeats"].append({"measured": again.summary.to_dict(), "server": again.server,
                                         "run_speed": rs_again.to_dict()})
                write_csv(again.records, out / f"records-{int(load * 100)}-again{j}.csv")
            result["points"].append(point)
            write_csv(live.records, out / f"records-{int(load * 100)}.csv")
            runs.append(RunData(f"live {load:.0%}", live.records, live.summary, live.metrics,
                                {"rate_scale": k}))
            wait_idle(url, 10.0)
    table = text_table(HEAD, rows)
    within = sum(r[7] == "yes" for r in rows)
    scored = sum(r[7] in ("yes", "no") for r in rows)
    made = "the profile rechecked before each point" if check else "the profile alone"
    print(f"\nFidelity: prediction ({made}) vs live measurement, {within} of {scored} cells within "
          f"target\n{table}", flush=True)
    result["table"] = {"head": HEAD, "rows": rows}
    if repeats:
        hits = sum(r[5] == "yes" for r in repeats)
        print(f"\nThe live run against itself (the same rows replayed again on the same server): {hits} of "
              f"{sum(r[5] in ('yes', 'no') for r in repeats)} cells within the prediction's targets\n"
              f"{text_table(REPEAT_HEAD, repeats)}", flush=True)
        result["repeat_table"] = {"head": REPEAT_HEAD, "rows": repeats}
    (out / "fidelity.json").write_text(json.dumps(result, indent=2, default=str))
    report = write_report(out, runs, title=f"fidelity: {wl.name}", sla_s=args.sla,
                          sections=[("Fidelity: predicted vs measured", html_table(HEAD, rows))])
    print(f"fidelity.json and {report} written to {out}/ in {time.monotonic() - t_start:.0f} s")
    return 0

