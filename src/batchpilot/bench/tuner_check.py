"""The tuner check of ``bench fidelity``: the tuner's config against a baseline, both served live.

Each config gets a bounded live capacity search (starting at 0.8x its simulated capacity) and a run at
one shared rate (the tuned config's simulated capacity, over the busiest window of the slice); the
capacity and goodput ratios tuned/baseline are printed live and simulated side by side.
"""

from __future__ import annotations

import argparse
import math
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

from ..core.costmodel import CostModel
from ..sim.traces import Workload
from .capacity import CapacityConfig, live_capacity, probe_rows, wait_idle
from .fidelity import DEFAULT_REQUESTS, load_config, served_config, sim_capacity, simulate
from .live_run import measure, warm_up
from .loadgen import LoadGenConfig
from .records import format_summary
from .serverproc import serve


def run_tune(out: Path, args: argparse.Namespace, profile: Path) -> str:
    path = out / "tuned.yaml"
    cmd = [sys.executable, "-m", "batchpilot.cli", "tune", "--workload", args.workload, "--start",
           str(args.start), "--requests", str(args.requests or DEFAULT_REQUESTS), "--profile", str(profile),
           "--sla-p99", str(args.sla), "-o", str(path), *shlex.split(args.tune_args)]
    print("tuning:", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    return str(path)


def tuner_check(args: argparse.Namespace, wl: Workload, texts: list[str], cost_model: CostModel,
                profile: Path, tuned_path: str) -> dict[str, Any]:
    """The tuner's config against the default, both live: bounded live capacity search starting from
    each config's simulated capacity, and goodput at one shared rate (the tuned config's simulated
    capacity, where the default should already be past its own)."""
    base = args.baseline_config
    configs = {"default": (base, load_config(base)), "tuned": (tuned_path, load_config(tuned_path))}
    sims = {name: sim_capacity(wl, cfg, cost_model, args.sla) for name, (_, cfg) in configs.items()}
    shared = sims["tuned"].capacity
    out: dict[str, Any] = {"tuned_config": tuned_path, "baseline_config": base or "SchedulerConfig()",
                           "shared_rate_scale": shared}
    for name, (path, cfg) in configs.items():
        serve_args = ["--profile", str(profile), "--log-level", "warning",
                      *(["--config", path] if path else []), *shlex.split(args.serve_args)]
        with serve(serve_args, log_path=Path(args.out) / f"serve-{name}.log", cpus=args.cpus) as url:
            start = max(sims[name].capacity * 0.8, 0.05)
            # growth 1.5 and 9 probes: a stale profile can be off by 2-3x on a shared machine
            ccfg = CapacityConfig(sla_s=args.sla, start=start, growth=1.5, lo=0.05, hi=256.0, rel_tol=0.1,
                                  max_probes=9, probe_s=args.probe_s, cooldown_s=10.0)
            lg = LoadGenConfig(url, progress=False)
            warm_up(url, wl, texts, max(args.warmup_requests, 20))  # a cold server fails its first probes
            cap = live_capacity(wl, lg, ccfg, texts=texts)
            print(f"{name}: live capacity\n{cap.table()}", flush=True)
            wait_idle(url, 10.0)
            # the busiest window: where a better config shows (the burst), the same rows for both configs
            first, count = probe_rows(wl, shared, args.max_live_s, busiest=True)
            rows = wl.slice(first, count).scale_rate(shared)
            at = measure(url, rows, texts[first: first + count], args.sla, args.warmup_requests, False, name)
            pred = simulate(rows, served_config(cfg, args.serve_args), cost_model, args.sla)
        print(format_summary(at.summary, f"{name} live at x{shared:.3f}"), flush=True)
        out[name] = {"sim_capacity_scale": sims[name].capacity, "sim_capacity_rps": sims[name].rps,
                     "live_capacity_scale": cap.rate_scale, "live_capacity_rps": cap.rps,
                     "live_goodput_rps_at_shared": at.summary.goodput_rps,
                     "live_p99_s_at_shared": at.summary.p99,
                     "sim_goodput_rps_at_shared": pred.summary.goodput_rps,
                     "sim_p99_s_at_shared": pred.summary.p99}
    d, t = out["default"], out["tuned"]
    ratio = lambda a, b: a / b if b else math.nan  # noqa: E731
    out["ratios"] = {
        "capacity tuned/default, live": ratio(t["live_capacity_scale"], d["live_capacity_scale"]),
        "capacity tuned/default, simulated": ratio(t["sim_capacity_scale"], d["sim_capacity_scale"]),
        "goodput at shared rate tuned/default, live": ratio(t["live_goodput_rps_at_shared"],
                                                            d["live_goodput_rps_at_shared"]),
        "goodput at shared rate tuned/default, simulated": ratio(t["sim_goodput_rps_at_shared"],
                                                                 d["sim_goodput_rps_at_shared"]),
    }
    print("tuner check:\n" + "\n".join(f"  {k}: {v:.3f}" for k, v in out["ratios"].items()), flush=True)
    return out
