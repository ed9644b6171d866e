"""Does the simulator predict the live server? profile -> simulate -> serve -> replay -> compare.

1. Cost model: ``--profile profile.json`` or a fresh ``batchpilot profile`` run.
2. Capacity from the simulator: the highest rate scale of the slice whose simulated P99 meets the SLA
   (the same ``search_capacity`` as the live search, with a simulated probe).
3. For each load (default 50% and 80% of that capacity): simulate the slice at that rate scale with
   the config and cost model (prediction), then start ``batchpilot serve`` with the same config and
   profile on a free port and replay the same rows at the same times (measurement).
4. Table: predicted vs measured P50, P99, throughput and mean batch size (measured from the server's
   batch-size histogram on ``/metrics``), error and whether it is inside the target (P50/P99 10%,
   throughput 5%).
5. Tuner check (``--tuned-config``): the tuner's config against the default, both measured live at
   the same loads — goodput (requests within the SLA per second) ratio, plus the simulator's ratio.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..core.config import SchedulerConfig
from ..core.costmodel import CostModel
from ..sim.traces import Workload
from .capacity import CapacityConfig, CapacityResult, search_capacity, wait_idle
from .loadgen import LoadGenConfig, build_plan, load_tokenizer, replay
from .records import Summary, format_summary, summarize, write_csv
from .report import RunData, html_table, write_report
from .scrape import MetricsSeries
from .serverproc import serve

TARGETS = {"p50": 0.10, "p99": 0.10, "throughput": 0.05}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None, help="scheduler YAML (default: SchedulerConfig())")
    p.add_argument("--profile", default=None,
                   help="cost-model profile JSON (default: run batchpilot profile)")
    p.add_argument("--profile-args", default="", help="extra args for `batchpilot profile`")
    p.add_argument("--loads", type=float, nargs="+", default=[0.5, 0.8],
                   help="fractions of simulated capacity")
    p.add_argument("--noise", action="store_true", help="simulate with sampled residual noise")
    p.add_argument("--tuned-config", default=None, help="tuner's YAML: measure its goodput vs the default")
    p.add_argument("--warmup-requests", type=int, default=30, help="unmeasured requests before each live run")


def load_config(path: str | None) -> SchedulerConfig:
    if not path:
        return SchedulerConfig()
    import yaml

    return SchedulerConfig.from_dict(yaml.safe_load(Path(path).read_text()))


def sim_summary(workload: Workload, config: SchedulerConfig, cost_model: CostModel, sla_s: float,
                noise: bool = False, seed: int = 0) -> tuple[Summary, Any]:
    """Simulate ``workload`` and express the result as a ``Summary`` (plus the simulator's own report)."""
    from ..sim.metrics import summarize as sim_summarize
    from ..sim.target import simulate_encoder

    run = simulate_encoder(workload, config, cost_model, noise=noise, seed=seed)
    rep = sim_summarize(run, sla_s)
    lat = {k: rep.latency[k] for k in ("p50", "p90", "p99", "p99.9")}
    failed = rep.num_measured - rep.num_completed
    s = Summary(num_requests=rep.num_measured, num_ok=rep.num_completed, num_warmup=0,
                duration_s=rep.num_completed / rep.throughput_rps if rep.throughput_rps else 0.0,
                offered_rps=rep.offered_rps, throughput_rps=rep.throughput_rps, goodput_rps=rep.goodput_rps,
                sla_s=sla_s, sla_met=bool(rep.p99_all <= sla_s), latency=lat,
                latency_mean_s=rep.latency["mean"],
                latency_max_s=math.nan, send_lag={"p50": 0.0, "p99": 0.0}, send_lag_max_s=0.0,
                errors={"rejected/dropped/unfinished": failed} if failed else {})
    return s, rep


def sim_capacity(workload: Workload, config: SchedulerConfig, cost_model: CostModel, sla_s: float,
                 noise: bool = False) -> CapacityResult:
    cfg = CapacityConfig(sla_s=sla_s, rel_tol=0.02, max_probes=30, hi=256.0)
    return search_capacity(lambda k: sim_summary(workload.scale_rate(k), config, cost_model, sla_s, noise)[0],
                           cfg)


def run_profile(out: Path, extra: str = "") -> Path:
    """``batchpilot profile --out PATH`` (the models team's profiler) in a subprocess."""
    import shlex

    path = out / "profile.json"
    cmd = [sys.executable, "-m", "batchpilot.cli", "profile", "--output", str(path), *shlex.split(extra)]
    print("profiling:", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    return path


@dataclass
class LivePoint:
    summary: Summary
    mean_batch_size: float
    metrics: MetricsSeries | None
    records: list[Any] = field(default_factory=list)


def live_point(url: str, workload: Workload, texts: list[str], sla_s: float, warmup_requests: int,
               progress: bool, label: str) -> LivePoint:
    """Warm the server with a few unmeasured requests, let it drain, then replay ``workload`` exactly."""
    lg = LoadGenConfig(url, "embeddings", progress=progress)
    if warmup_requests:
        warm = workload.slice(0, warmup_requests)
        replay(build_plan(warm, texts=texts[:warmup_requests], warmup_requests=warmup_requests),
               LoadGenConfig(url, "embeddings", progress=False, scrape_interval_s=0))
        wait_idle(lg.base_url, 5.0)
    res = replay(build_plan(workload, texts=texts), lg, description=label)
    s = summarize(res.records, sla_s)
    mean_bs = math.nan
    if res.metrics is not None:
        name = res.metrics.find("batch", "size")
        if name:
            mean_bs = res.metrics.histogram_mean(name)
    return LivePoint(s, mean_bs, res.metrics, res.records)


def _err(pred: float, meas: float) -> float:
    return (pred - meas) / meas if meas and math.isfinite(meas) and math.isfinite(pred) else math.nan


def comparison_rows(load: float, scale: float, pred: Summary, pred_bs: float,
                    live: LivePoint) -> list[list[Any]]:
    m = live.summary
    rows = []
    for key, p, v in (("p50", pred.p50, m.p50), ("p99", pred.p99, m.p99),
                      ("throughput", pred.throughput_rps, m.throughput_rps),
                      ("mean batch size", pred_bs, live.mean_batch_size)):
        e = _err(p, v)
        tgt = TARGETS.get(key)
        ok = "" if tgt is None or not math.isfinite(e) else ("yes" if abs(e) <= tgt else "NO")
        unit = 1e3 if key in ("p50", "p99") else 1.0
        label = key + {"p50": " ms", "p99": " ms", "throughput": " req/s"}.get(key, "")
        rows.append([f"{load:.0%}", f"{scale:.3f}", label, round(p * unit, 2), round(v * unit, 2),
                     f"{e:+.1%}" if math.isfinite(e) else "-", f"±{tgt:.0%}" if tgt else "", ok])
    return rows


HEAD = ["load", "rate scale", "metric", "predicted", "measured", "error", "target", "within"]


def text_table(head: list[str], rows: list[list[Any]]) -> str:
    cells = [head] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(head))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in cells)


def main(args: argparse.Namespace) -> int:
    from ..sim.workloads import load_workload

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.monotonic()
    config = load_config(args.config)
    profile = Path(args.profile) if args.profile else run_profile(out, args.profile_args)
    cost_model = CostModel.load(profile)
    wl = load_workload(args.workload, 1.0, args.start, args.requests, trace=args.trace)
    print(f"workload {args.workload} rows [{args.start}, {args.start + len(wl)}) over {wl.duration_s:.1f} s "
          f"({wl.mean_rate:.2f} req/s); config {args.config or 'default'}; profile {profile}", flush=True)
    cap = sim_capacity(wl, config, cost_model, args.sla, args.noise)
    print(f"simulated capacity: rate scale {cap.rate_scale:.3f} = {cap.rps:.2f} req/s "
          f"(P99 <= {args.sla:g} s)")
    tok = load_tokenizer(args.tokenizer)
    texts = [p.body["input"] for p in build_plan(wl, tokenizer=tok, seed=args.seed)]
    serve_args = ["--profile", str(profile), *(["--config", args.config] if args.config else [])]
    serve_args += args.serve_args.split()
    rows: list[list[Any]] = []
    runs: list[RunData] = []
    result: dict[str, Any] = {"capacity_scale": cap.rate_scale, "capacity_rps": cap.rps, "points": []}
    with serve(serve_args, log_path=out / "serve.log") as url:
        for load in args.loads:
            k = load * cap.rate_scale
            scaled = wl.scale_rate(k)
            pred, rep = sim_summary(scaled, config, cost_model, args.sla, args.noise, args.seed)
            live = live_point(url, scaled, texts, args.sla, args.warmup_requests, not args.no_progress,
                              f"{load:.0%} live")
            print(format_summary(live.summary, f"live at {load:.0%} of capacity (x{k:.3f})"), flush=True)
            rows += comparison_rows(load, k, pred, rep.mean_batch_size, live)
            write_csv(live.records, out / f"records-{int(load * 100)}.csv")
            runs.append(RunData(f"live {load:.0%}", live.records, live.summary, live.metrics,
                                {"rate_scale": k}))
            result["points"].append({"load": load, "rate_scale": k, "predicted": pred.to_dict(),
                                     "predicted_mean_batch_size": rep.mean_batch_size,
                                     "measured": live.summary.to_dict(),
                                     "measured_mean_batch_size": live.mean_batch_size})
            wait_idle(url, 10.0)
    table = text_table(HEAD, rows)
    print("\nFidelity: simulator prediction vs live measurement\n" + table)
    sections = [("Fidelity: predicted vs measured", html_table(HEAD, rows))]
    if args.tuned_config:
        tuned = tuner_check(args, wl, texts, cap, cost_model, profile, config)
        result["tuner"] = tuned
        sections.append(("Tuner check", f"<pre>{json.dumps(tuned, indent=2)}</pre>"))
    (out / "fidelity.json").write_text(json.dumps(result, indent=2, default=str))
    report = write_report(out, runs, title=f"fidelity: {args.workload}", capacity=[cap], sla_s=args.sla,
                          sections=sections)
    print(f"fidelity.json and {report} written to {out}/ in {time.monotonic() - t_start:.0f} s")
    return 0


def tuner_check(args: argparse.Namespace, wl: Workload, texts: list[str], cap: CapacityResult,
                cost_model: CostModel, profile: Path, default: SchedulerConfig) -> dict[str, Any]:
    """Goodput of the tuner's config vs the default, both live, at the highest requested load (of the
    default's simulated capacity) where a better config should show; the simulator's ratio beside it."""
    tuned = load_config(args.tuned_config)
    load = max(args.loads)
    out: dict[str, Any] = {"load": load, "rate_scale": load * cap.rate_scale}
    scaled = wl.scale_rate(load * cap.rate_scale)
    for name, cfg_path, cfg in (("default", None, SchedulerConfig()), ("tuned", args.tuned_config, tuned)):
        pred, _ = sim_summary(scaled, cfg, cost_model, args.sla)
        serve_args = ["--profile", str(profile), *(["--config", cfg_path] if cfg_path else [])]
        log = Path(args.out) / f"serve-{name}.log"
        with serve(serve_args + args.serve_args.split(), log_path=log) as url:
            live = live_point(url, scaled, texts, args.sla, args.warmup_requests, not args.no_progress,
                              f"{name} live")
        print(format_summary(live.summary, f"{name} config live"), flush=True)
        out[name] = {"live_goodput_rps": live.summary.goodput_rps, "live_p99_s": live.summary.p99,
                     "sim_goodput_rps": pred.goodput_rps, "sim_p99_s": pred.p99}
    d, t = out["default"], out["tuned"]
    for kind in ("live", "sim"):
        base = d[f"{kind}_goodput_rps"]
        out[f"{kind}_goodput_ratio"] = t[f"{kind}_goodput_rps"] / base if base else math.nan
    print(f"tuner check at x{out['rate_scale']:.3f}: goodput tuned/default live "
          f"{out['live_goodput_ratio']:.3f}, "
          f"simulated {out['sim_goodput_ratio']:.3f}")
    return out
