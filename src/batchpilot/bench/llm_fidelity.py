"""Fidelity for the LLM half: simulated vs measured TTFT, TPOT, output tokens/s and refusals on conv-llm.

``batchpilot bench fidelity --workload conv-llm [--profile llm_profile.json] [--config cfg.yaml] [--cpus 1]``:

1. Step cost model: ``--profile``, or a fresh ``batchpilot profile --llm`` of the model, device and
   precision of the engine the server builds, pinned to ``--cpus`` like the server
   (``fidelity.run_llm_profile``). Both come before the server starts: the prediction uses the
   profile and nothing measured afterwards.
2. Engine config: the deployment resolved as ``serve`` resolves it (``build_llm_engine(model, spec=spec)``,
   not started: ``core.deployment.resolve_llm_deployment`` with the model's limits and memory, the
   server-wide timeout and concurrency included); ``serve --llm`` gets the same deployment flags
   (``--config`` included), so the simulator refuses and expires what the server does.
3. Capacity from the simulator (``sim.llm.simulate_llm``): the highest rate scale of the ``--requests``
   rows whose simulated TTFT P99 meets ``--sla``.
4. At each ``--loads`` fraction of it (default 50% and 80%), the prediction, made before the server
   starts; then the live server replays the same rows (streamed ``/v1/completions``, token-id prompts of
   the trace's length, ``max_tokens`` from the trace, ``ignore_eos``) ``--live-repeats`` times,
   round-robin over the points, and the prediction is scored against the replays' median and widened
   [min, max] (``fidelity.score_spread``): TTFT P50/P99, TPOT P50/P99, output tokens/s and the rejected
   count, with the bias and the share of latency cells inside.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from batchpilot.bench.capacity import CapacityConfig, probe_workload, search_capacity, wait_idle
from batchpilot.bench.fidelity import (
    FidelityOptions,
    SpreadCell,
    ablation_table,
    print_spread,
    run_llm_profile,
    spread_cells,
    text_table,
    write_scored,
)
from batchpilot.bench.loadgen import LoadGenConfig, build_plan, replay
from batchpilot.bench.records import Summary, format_summary, summarize, write_csv
from batchpilot.bench.report import RunData
from batchpilot.bench.serverproc import client_keepalive_s, cores, pin_load_generator, serve
from batchpilot.core.costmodel import CostModel
from batchpilot.core.deployment import DeploymentSpec
from batchpilot.core.llm.config import LLMSchedulerConfig
from batchpilot.sim.llm import LLMServiceModel
from batchpilot.sim.traces import Workload

# What an LLM fidelity point scores: TTFT and TPOT percentiles, output tokens/s, refusals.

METRICS = ("TTFT P50 ms", "TTFT P99 ms", "TPOT P50 ms", "TPOT P99 ms", "output tok/s")


def _values(s: Summary) -> list[float]:
    """A run's value of each of ``METRICS``, in seconds for the latencies."""
    return [s.ttft.get("p50", math.nan), s.ttft.get("p99", math.nan), s.tpot.get("p50", math.nan),
            s.tpot.get("p99", math.nan), s.output_tokens_per_s]


SPREAD_METRICS = (*METRICS, "rejected")  # scored against the replays' spread (``fidelity.score_spread``)


def spread_values(s: Summary, rejected: int) -> list[float]:
    """A run's value of each of ``SPREAD_METRICS``, the latencies in ms as the tables show them."""
    return [v * (1.0 if m == "output tok/s" else 1e3) for m, v in zip(METRICS, _values(s), strict=True)] + [
        float(rejected)]


DEFAULT_REQUESTS = 200  # conv-llm rows replayed when --requests is not given


def engine_config_and_profile(out: Path, spec: DeploymentSpec, profile: str | None, cpus: str | None,
                              model: str | None = None) -> tuple[LLMSchedulerConfig, Path]:
    """The scheduler config of the engine ``serve --llm`` builds from ``spec`` (built here, never
    started, on ``cpus`` as the server runs), and the step profile: ``profile``, or a fresh ``batchpilot
    profile --llm`` of that engine's model, device and precision, pinned like the server
    (``fidelity.run_llm_profile``: the step cost model and the serving path around it)."""
    from batchpilot.runtime.llm.build import BuildOptions, build_llm_engine

    saved = os.sched_getaffinity(0) if cpus and hasattr(os, "sched_getaffinity") else None
    if saved is not None:
        os.sched_setaffinity(0, cores(cpus))  # type: ignore[arg-type]
    try:
        threads = len(os.sched_getaffinity(0)) if saved is not None else 0
        engine = build_llm_engine(model, spec, BuildOptions(start=False, threads=threads))
        config, runner = engine.config, engine.runner
        device, dtype = str(runner.device), str(runner.dtype).removeprefix("torch.")
        del engine, runner
    finally:
        if saved is not None:
            os.sched_setaffinity(0, saved)
    if profile:
        return config, Path(profile)
    return config, run_llm_profile(out, model, device, dtype, threads, cpus)


Predicted = tuple[Summary, Any]  # a simulated run as a Summary, and the simulator's own report


def simulate(workload: Workload, config: LLMSchedulerConfig, cost_model: CostModel,
             sla_s: float, service: LLMServiceModel | None = None) -> Predicted:
    """The simulated run as a ``Summary`` whose latency percentiles are TTFT (what the SLA is on), and
    the simulator's own report (``num_rejected``)."""
    from batchpilot.sim.llm import simulate_llm

    rep = simulate_llm(workload, config, cost_model, service=service).report()
    ttft = {"p50": rep.ttft_p50, "p90": math.nan, "p99": rep.ttft_p99, "p99.9": math.nan}
    n = rep.num_requests
    s = Summary(num_requests=n, num_ok=rep.num_finished, num_warmup=0, duration_s=rep.duration_s,
                offered_rps=workload.mean_rate, throughput_rps=rep.num_finished / rep.duration_s
                if rep.duration_s else 0.0, goodput_rps=math.nan, sla_s=sla_s,
                sla_met=bool(rep.num_finished == n and rep.ttft_p99 <= sla_s), latency=ttft,
                latency_mean_s=math.nan, latency_max_s=math.nan, send_lag={"p50": 0.0, "p99": 0.0},
                send_lag_max_s=0.0, errors={"rejected": rep.num_rejected} if rep.num_rejected else {},
                ttft=ttft, tpot={"p50": rep.tpot_p50, "p99": rep.tpot_p99},
                output_tokens_per_s=rep.output_tokens_per_s)
    return s, rep


def check_llm_fidelity(wl: Workload, start: int, opts: FidelityOptions) -> int:
    """``bench fidelity --workload conv-llm``: ``wl`` is the trace's rows from ``start``."""
    if opts.rescore:
        return rescore_llm(wl, start, opts)
    out, sla, cpus, model = opts.out, opts.sla_s, opts.cpus, opts.llm_model
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    config, profile_path = engine_config_and_profile(out, opts.spec, opts.profile, cpus, model)
    cost_model, service = CostModel.load(profile_path), LLMServiceModel.from_profile(profile_path)
    print(f"workload conv-llm rows [{start}, {start + len(wl)}) over {wl.duration_s:.1f} s "
          f"({wl.mean_rate:.2f} req/s); TTFT P99 SLA {sla:g} s; engine {config}", flush=True)
    search = CapacityConfig(sla_s=sla, rel_tol=0.03, max_probes=30, lo=1e-3, hi=256.0)
    cap = search_capacity(lambda k: simulate(wl.scale_rate(k), config, cost_model, sla, service)[0], search)
    bound = "" if cap.bracketed else f" (a lower bound: every rate up to x{search.hi:g} met the SLA)"
    print(f"simulated capacity: rate scale {cap.rate_scale:.3f} = {cap.rps:.2f} req/s{bound}", flush=True)
    result: dict[str, Any] = {
        "workload": "conv-llm", "start": start, "requests": len(wl), "sla_s": sla,
        "config": dataclasses.asdict(config), "profile": str(profile_path),
        "cost_model": cost_model.to_dict(), "capacity_scale": cap.rate_scale, "capacity_rps": cap.rps,
        "capacity_bracketed": cap.bracketed, "points": []}
    if cap.rate_scale <= 0:
        print("no rate meets the TTFT SLA in simulation; raise --sla or re-profile", flush=True)
        return 1
    points = []
    for load in opts.loads:  # every prediction made before the server starts
        k = load * cap.rate_scale
        rows_wl = probe_workload(wl, k, opts.max_live_s) if opts.max_live_s else wl.scale_rate(k)
        pred, rep = simulate(rows_wl, config, cost_model, sla, service)
        print(format_summary(pred, f"predicted conv-llm at {load:.0%} of capacity (x{k:.3f}, "
                                   f"{len(rows_wl)} rows)"), flush=True)
        points.append(LLMPoint(load, k, build_plan(rows_wl, "completions", seed=opts.seed), pred,
                               rep.num_rejected))
    pin_load_generator(cpus)
    serve_args = ["--llm", "--log-level", "warning", "--no-warmup", *opts.serve_flags]
    if model:
        serve_args += ["--llm-model", model]
    if cpus:
        serve_args += ["--threads", str(len(cores(cpus)))]
    runs: list[RunData] = []
    with serve(serve_args, log_path=out / "serve-llm.log", cpus=cpus) as url:
        keep = client_keepalive_s(serve_args, opts.keepalive_s)  # pooled as a gateway pools them
        quiet = LoadGenConfig(url, "completions", progress=False, scrape_interval_s=0, keepalive_s=keep)
        live = LoadGenConfig(url, "completions", progress=opts.progress, keepalive_s=keep)
        first = wl.slice(0, min(2, len(wl)))  # the server's first steps allocate: not measured
        replay(build_plan(first, "completions", warmup_requests=len(first)), quiet)
        wait_idle(url, 30.0)
        for j in range(1, opts.live_repeats + 1):  # round-robin: A #1, B #1, A #2, B #2, ...
            for p in points:
                if j == 1 and opts.warmup_requests:
                    warm = p.plan[:min(opts.warmup_requests, len(p.plan))]
                    replay([dataclasses.replace(r, warmup=True) for r in warm], quiet)
                    wait_idle(url, 30.0)
                label = f"{p.load:.0%} live #{j}"
                res = replay(p.plan, live, description=label)
                wait_idle(url, 30.0)
                meas = summarize(res.records, sla)
                print(format_summary(meas, f"live conv-llm {label}"), flush=True)
                p.replays.append(meas)
                write_csv(res.records, out / f"records-llm-{int(round(p.load * 100))}-{j}.csv")
                runs.append(RunData(f"llm {label}", res.records, meas, res.metrics,
                                    {"rate_scale": p.rate_scale}))
    report = write_scored(out, result, [p.result() for p in points], runs, "fidelity: conv-llm", None)
    print(f"fidelity.json and {report} written to {out}/ in {time.monotonic() - t0:.0f} s")
    return 0


@dataclass
class LLMPoint:
    """One load point: its prediction, its planned requests and every live replay of them."""

    load: float
    rate_scale: float
    plan: Any  # the point's replayed requests (``loadgen.build_plan``)
    pred: Summary
    pred_rejected: int
    replays: list[Summary] = field(default_factory=list)

    def result(self) -> dict[str, Any]:
        """The point's entry of fidelity.json: the prediction, each replay and the score against them."""
        cells = spread_cells(self.load, SPREAD_METRICS, spread_values(self.pred, self.pred_rejected),
                             [spread_values(m, m.num_requests - m.num_ok) for m in self.replays])
        return {"load": self.load, "rate_scale": self.rate_scale, "rows": len(self.plan),
                "predicted": self.pred.to_dict(), "predicted_rejected": self.pred_rejected,
                "replays": [m.to_dict() for m in self.replays], "spread": [c.to_dict() for c in cells]}


def rescore_llm(wl: Workload, start: int, opts: FidelityOptions) -> int:
    """``bench fidelity --workload conv-llm --rescore DIR [--ablate]``: DIR's points predicted again from
    its own profile and engine config with today's simulator, scored against DIR's replays (with each
    term of ``LLMServiceModel`` removed in turn with ``--ablate``); writes DIR/rescore.json."""
    folder = Path(str(opts.rescore))
    result = json.loads((folder / "fidelity.json").read_text())
    if (result.get("start"), result.get("requests")) != (start, len(wl)):
        print(f"{folder}/fidelity.json replayed conv-llm rows [{result.get('start')}, "
              f"+{result.get('requests')}); these flags give [{start}, +{len(wl)}): pass the run's own "
              "--start and --requests", file=sys.stderr)
        return 2
    config = LLMSchedulerConfig(**{k: tuple(v) if isinstance(v, list) else v
                                   for k, v in result["config"].items()})
    profile = Path(result["profile"])
    cost_model, service = CostModel.load(profile), LLMServiceModel.from_profile(profile)
    variants = {"as profiled": service}
    if opts.ablate:
        variants |= {f"without {term}": service.without(term) for term in LLMServiceModel.TERMS}
    scored: dict[str, list[dict[str, Any]]] = {}
    for name, model in variants.items():
        cells: list[SpreadCell] = []
        for pt in result["points"]:
            k = pt["rate_scale"]
            rows_wl = probe_workload(wl, k, opts.max_live_s) if opts.max_live_s else wl.scale_rate(k)
            pred, rep = simulate(rows_wl, config, cost_model, opts.sla_s, model)
            replays = [Summary(**r) for r in pt["replays"]]
            cells += spread_cells(pt["load"], SPREAD_METRICS, spread_values(pred, rep.num_rejected),
                                  [spread_values(m, m.num_requests - m.num_ok) for m in replays])
        scored[name] = [c.to_dict() for c in cells]
        if name == "as profiled":
            print_spread(cells)
    head, rows = ablation_table(scored, ("TTFT P50 ms", "TTFT P99 ms", "TPOT P50 ms", "output tok/s"))
    print(f"\n{text_table(head, rows)}")
    (folder / "rescore.json").write_text(json.dumps({"variants": scored}, indent=2))
    return 0
