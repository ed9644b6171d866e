"""Fidelity for the LLM half: simulated vs measured TTFT, TPOT and output tokens/s on conv-llm.

``batchpilot bench fidelity --workload conv-llm [--profile llm_profile.json] [--cpus 1]``:

1. The engine the server will run (``build_llm_engine`` with its defaults, not started) gives the
   ``LLMSchedulerConfig`` and, unless ``--profile`` is given, the step cost model
   (``models.llm.profile.profile_llm_steps`` on its runner, pinned like the server).
2. Capacity from the simulator (``sim.llm.simulate_llm``): the highest rate scale of the slice whose
   simulated TTFT P99 meets ``--sla`` (the encoder's end-to-end SLA makes no sense for 256-token outputs).
3. At each load, the simulator and ``batchpilot serve --llm`` replay the same rows (streamed
   ``/v1/completions``, token-id prompts of the trace's length, ``max_tokens`` from the trace,
   ``ignore_eos``); the table holds TTFT and TPOT P50/P99 and output tokens/s.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import time
from pathlib import Path
from typing import Any

from ..core.costmodel import CostModel
from ..sim.traces import Workload
from .capacity import CapacityConfig, probe_workload, search_capacity, wait_idle
from .loadgen import LoadGenConfig, build_plan, replay
from .records import Summary, format_summary, percentiles, summarize, write_csv
from .report import RunData, html_table, write_report
from .serverproc import serve

TARGETS = {"TTFT": 0.10, "TPOT": 0.10, "output": 0.05}
HEAD = ["load", "rate scale", "metric", "predicted", "measured", "error", "target", "within"]


def engine_config_and_profile(out: Path, profile: str | None, cpus: str | None) -> tuple[Any, CostModel]:
    """The live engine's scheduler config, and its step cost model (loaded or measured here)."""
    from ..runtime.llm_engine import build_llm_engine

    saved = os.sched_getaffinity(0) if cpus and hasattr(os, "sched_getaffinity") else None
    if saved is not None:  # profile on the server's cores, like the server will run
        from .fidelity import _cores

        os.sched_setaffinity(0, _cores(cpus))  # type: ignore[arg-type]
    try:
        engine = build_llm_engine(None, start=False, threads=len(os.sched_getaffinity(0)) if saved else 0)
        config = engine.config
        if profile:
            cost_model = CostModel.load(profile)
        else:
            from ..models.llm.profile import profile_llm_steps

            print("profiling LLM steps (models.llm.profile.profile_llm_steps) ...", flush=True)
            cost_model = profile_llm_steps(engine.runner)
            cost_model.save(out / "llm_profile.json")
            coef = ", ".join(f"{n}={c:.3g}" for n, c in zip(cost_model.feature_names, cost_model.latency_coef,
                                                             strict=True))
            print(f"step model: {coef} -> {out / 'llm_profile.json'}", flush=True)
        del engine
    finally:
        if saved is not None:
            os.sched_setaffinity(0, saved)
    return config, cost_model


def simulate(workload: Workload, config: Any, cost_model: CostModel, sla_s: float) -> tuple[Summary, Any]:
    """The simulated run as a ``Summary`` whose latency percentiles are TTFT (what the SLA is on)."""
    from ..sim.llm import simulate_llm

    run = simulate_llm(workload, config, cost_model)
    rep = run.report()
    ttft = {"p50": rep.ttft_p50, "p90": math.nan, "p99": rep.ttft_p99, "p99.9": math.nan}
    n = rep.num_requests
    s = Summary(num_requests=n, num_ok=rep.num_finished, num_warmup=0, duration_s=rep.duration_s,
                offered_rps=workload.mean_rate, throughput_rps=rep.num_finished / rep.duration_s
                if rep.duration_s else 0.0, goodput_rps=math.nan, sla_s=sla_s,
                sla_met=bool(rep.num_finished == n and rep.ttft_p99 <= sla_s), latency=ttft,
                latency_mean_s=math.nan, latency_max_s=math.nan, send_lag={"p50": 0.0, "p99": 0.0},
                send_lag_max_s=0.0, errors={}, ttft=ttft,
                tpot={"p50": rep.tpot_p50, "p99": rep.tpot_p99}, output_tokens_per_s=rep.output_tokens_per_s)
    return s, rep


DIAG_HEAD = ["load", "quantity (mean, ms)", "simulated", "server", "client"]


def diagnosis_rows(load: float, rep: Any, res: Any, m: Summary) -> list[list[Any]]:
    """Server-side TTFT and inter-token means (the engine's own histograms) against the client's: what
    streaming (SSE, JSON per token, the event loop) adds, apart from what the engine's steps cost."""
    ms = lambda x: round(x * 1e3, 2) if math.isfinite(x) else "-"  # noqa: E731
    ser = res.metrics
    s_ttft = ser.histogram_mean("batchpilot_llm_time_to_first_token_seconds") if ser else math.nan
    s_itl = ser.histogram_mean("batchpilot_llm_inter_token_latency_seconds") if ser else math.nan
    ok = [r for r in res.records if r.ok]
    c_ttft = sum(r.ttft_s for r in ok) / len(ok) if ok else math.nan
    gaps = [g for r in ok for g in r.itl_s]
    c_itl = sum(gaps) / len(gaps) if gaps else math.nan
    return [[f"{load:.0%}", "TTFT", "-", ms(s_ttft), ms(c_ttft)],
            [f"{load:.0%}", "inter-token gap (client: per SSE chunk)", "-", ms(s_itl), ms(c_itl)],
            [f"{load:.0%}", "tokens per engine step (not ms)", round(rep.mean_step_tokens, 1), "-", "-"]]


def _row(load: float, k: float, name: str, p: float, m: float, unit: float) -> list[Any]:
    e = (p - m) / m if m and math.isfinite(m) and math.isfinite(p) else math.nan
    tgt = TARGETS.get(name.split()[0])
    ok = "" if tgt is None or not math.isfinite(e) else ("yes" if abs(e) <= tgt else "NO")
    return [f"{load:.0%}", f"{k:.3f}", name, round(p * unit, 2), round(m * unit, 2),
            f"{e:+.1%}" if math.isfinite(e) else "-", f"±{tgt:.0%}" if tgt else "", ok]


def main(args: argparse.Namespace) -> int:
    from ..sim.workloads import load_workload
    from .fidelity import _cores, _pin_self, text_table

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    config, cost_model = engine_config_and_profile(out, args.profile, args.cpus)
    wl = load_workload("conv-llm", 1.0, args.start, args.requests or 200, trace=args.trace)
    print(f"workload conv-llm rows [{args.start}, {args.start + len(wl)}) over {wl.duration_s:.1f} s "
          f"({wl.mean_rate:.2f} req/s); TTFT P99 SLA {args.sla:g} s", flush=True)
    cap = search_capacity(lambda k: simulate(wl.scale_rate(k), config, cost_model, args.sla)[0],
                          CapacityConfig(sla_s=args.sla, rel_tol=0.03, max_probes=30, lo=1e-3, hi=256.0))
    print(f"simulated capacity: rate scale {cap.rate_scale:.3f} = {cap.rps:.2f} req/s", flush=True)
    if cap.rate_scale <= 0:
        print("no rate meets the TTFT SLA in simulation; raise --sla or re-profile", flush=True)
        return 1
    _pin_self(args.cpus)
    rows: list[list[Any]] = []
    diag: list[list[Any]] = []
    runs: list[RunData] = []
    result: dict[str, Any] = {"capacity_scale": cap.rate_scale, "capacity_rps": cap.rps, "points": [],
                              "config": str(config), "cost_model": cost_model.to_dict()}
    serve_args = ["--llm", "--log-level", "warning", "--no-warmup", *shlex.split(args.serve_args)]
    if args.cpus:
        serve_args += ["--threads", str(len(_cores(args.cpus)))]
    with serve(serve_args, log_path=out / "serve-llm.log", cpus=args.cpus) as url:
        for load in args.loads:
            k = load * cap.rate_scale
            rows_wl = probe_workload(wl, k, args.max_live_s)
            pred, rep = simulate(rows_wl, config, cost_model, args.sla)
            if args.warmup_requests:
                warm = rows_wl.slice(0, min(args.warmup_requests, len(rows_wl)))
                replay(build_plan(warm, "completions", warmup_requests=len(warm)),
                       LoadGenConfig(url, "completions", progress=False, scrape_interval_s=0))
                wait_idle(url, 30.0)
            res = replay(build_plan(rows_wl, "completions", seed=args.seed),
                         LoadGenConfig(url, "completions", progress=not args.no_progress),
                         description=f"{load:.0%} live")
            m = summarize(res.records, args.sla)
            label = f"live conv-llm at {load:.0%} of capacity (x{k:.3f}, {len(rows_wl)} rows)"
            print(format_summary(m, label))
            tp = percentiles([(r.latency_s - r.ttft_s) / (r.tokens_received - 1) for r in res.records
                              if r.ok and r.tokens_received > 1], (50.0, 99.0))
            rows += [_row(load, k, "TTFT P50 ms", pred.ttft["p50"], m.ttft.get("p50", math.nan), 1e3),
                     _row(load, k, "TTFT P99 ms", pred.ttft["p99"], m.ttft.get("p99", math.nan), 1e3),
                     _row(load, k, "TPOT P50 ms", pred.tpot["p50"], tp["p50"], 1e3),
                     _row(load, k, "TPOT P99 ms", pred.tpot["p99"], tp["p99"], 1e3),
                     _row(load, k, "output tok/s", pred.output_tokens_per_s, m.output_tokens_per_s, 1.0)]
            diag += diagnosis_rows(load, rep, res, m)
            write_csv(res.records, out / f"records-llm-{int(load * 100)}.csv")
            runs.append(RunData(f"llm live {load:.0%}", res.records, m, res.metrics, {"rate_scale": k}))
            result["points"].append({"load": load, "rate_scale": k, "rows": len(rows_wl),
                                     "predicted": pred.to_dict(), "measured": m.to_dict(),
                                     "load_average_1m": os.getloadavg()[0]})
            wait_idle(url, 30.0)
    table = text_table(HEAD, rows)
    print("\nLLM fidelity: simulator prediction vs live measurement\n" + table, flush=True)
    print("\nWhere the time goes (means, ms; server histograms over the same runs)\n"
          + text_table(DIAG_HEAD, diag), flush=True)
    (out / "llm_fidelity.json").write_text(json.dumps(result, indent=2, default=str))
    report = write_report(out, runs, title="fidelity: conv-llm", sla_s=None,
                          sections=[("LLM fidelity: predicted vs measured", html_table(HEAD, rows)),
                                    ("Where the time goes", html_table(DIAG_HEAD, diag))])
    print(f"llm_fidelity.json and {report} written to {out}/ in {time.monotonic() - t0:.0f} s")
    return 0
