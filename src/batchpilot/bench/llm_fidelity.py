"""Fidelity for the LLM half: simulated vs measured TTFT, TPOT, output tokens/s and refusals on conv-llm.

``batchpilot bench fidelity --workload conv-llm [--profile llm_profile.json] [--config cfg.yaml] [--cpus 1]``:

1. Step cost model: ``--profile``, or a fresh ``batchpilot profile --llm`` of the model, device and
   precision of the engine the server builds, pinned to ``--cpus`` like the server
   (``fidelity.run_llm_profile``). Both come before the server starts: the prediction uses the
   profile and nothing measured afterwards.
2. Engine config: the deployment resolved as ``serve`` resolves it (``build_llm_engine(model, spec=spec)``,
   not started: ``core.llm.config.resolve_llm_deployment`` with the model's limits and memory, the
   server-wide timeout and concurrency included); ``serve --llm`` gets the same deployment flags
   (``--config`` included), so the simulator refuses and expires what the server does.
3. Capacity from the simulator (``sim.llm.simulate_llm``): the highest rate scale of the ``--requests``
   rows whose simulated TTFT P99 meets ``--sla``.
4. At each ``--loads`` fraction of it (default 50% and 80%), the simulator and the live server replay the
   same rows (streamed ``/v1/completions``, token-id prompts of the trace's length, ``max_tokens``
   from the trace, ``ignore_eos``), the server ``--live-repeats`` times, round-robin over the points.
   The table holds TTFT P50/P99, TPOT P50/P99, output tokens/s and the rejected count, predicted against
   the first replay, with their targets; a second scores the prediction against all the replays'
   median and widened [min, max] (``fidelity.score_spread``), with the bias and the share inside.
5. With ``--speed-check``, before each point a speed check (``batchpilot profile --recheck``, pinned
   like the server): the step profile's own steps of under 50 ms timed again and the profile rescaled
   to the machine's speed now (``profile/speed_check.py``); the point is predicted from it, the
   profile-alone error beside.
6. Beside each point, "speed vs profile": the run's logged engine steps (``serve --llm-step-log``) against
   what the profile (step model and serving path) predicts for the same step shapes
   (``bench.llm_fidelity.speed_vs_profile``): how far the machine's speed moved. It is reported, never
   used to change the prediction.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from batchpilot.bench.capacity import CapacityConfig, probe_workload, search_capacity, wait_idle
from batchpilot.bench.fidelity import (
    FidelityOptions,
    SpreadCell,
    print_spread,
    run_llm_profile,
    run_recheck,
    spread_cells,
    text_table,
    within_target,
)
from batchpilot.bench.fidelity import relative_error as _err
from batchpilot.bench.loadgen import LoadGenConfig, build_plan, replay
from batchpilot.bench.records import Summary, format_summary, summarize, write_csv
from batchpilot.bench.report import RunData, html_table, write_report
from batchpilot.bench.serverproc import client_keepalive_s, cores, pin_load_generator, serve
from batchpilot.core.costmodel import CostModel
from batchpilot.core.deployment import DeploymentSpec
from batchpilot.core.llm.config import LLMSchedulerConfig
from batchpilot.runtime.journal import wait_written
from batchpilot.sim.llm import LLMFrontEnd, StepPricer, step_cycles
from batchpilot.sim.traces import Workload

# The LLM engine's step log (``serve --llm --llm-step-log PATH``) and how its steps ran against a profile.
#
# ``runtime.llm.engine.StepLog`` appends one JSON line per engine step: ``step``, ``start``
# (``time.perf_counter()`` when it was scheduled), ``wall_s`` (the whole step: schedule, forward, sample,
# detokenise, deliver), ``forward_s`` (of which forward + sampling), ``seqs``, ``after_idle`` (the step
# followed an idle wait) and ``features`` (the step's cost-model features). ``read_steps`` reads it
# while the server writes (whole lines only).
#
# ``speed_vs_profile`` is what ``bench fidelity --workload conv-llm`` prints beside each load point: the
# logged steps' seconds over what the profile (step model and serving path) predicts for the same step
# shapes. It reports how fast the machine ran against its profile; nothing is fitted on it.
# ``speed_by_seqs`` splits it by sequences per step: the forward against the profile's forward factor
# (``step_alpha`` and the factor of its count of sequences, or its prefill factor) times the step's
# price (``sim.llm.StepPricer``), and the rest of the step against the serving path's
# overhead line, where they part.
# ``python -m batchpilot.bench.llm_fidelity OUT [PROFILE] [--by-count] [--by-kind]`` prints it for a ``bench
# fidelity --workload conv-llm`` output folder (its ``steps.jsonl``, every logged step, against
# ``PROFILE``, by default the ``llm_profile.json`` the command wrote there); ``--by-count`` splits it by
# each count of sequences from 1 to 32 (steps of more in one row), ``--by-kind`` into decode-only steps
# and steps with a prefill chunk, the two kinds whose forward the profile prices apart.

@dataclass(frozen=True)
class LoggedStep:
    start: float
    wall_s: float
    forward_s: float
    seqs: int
    after_idle: bool
    features: dict[str, float]


def read_steps(path: str | Path, offset: int = 0) -> tuple[list[LoggedStep], int]:
    """Steps logged from byte ``offset`` on (whole lines only: the server may be writing one now), and
    the offset to read from next."""
    with open(path, "rb") as f:
        f.seek(offset)
        data = f.read()
    end = data.rfind(b"\n") + 1
    steps = []
    for line in data[:end].splitlines():
        if line.strip():
            d = json.loads(line)
            steps.append(LoggedStep(float(d["start"]), float(d["wall_s"]), float(d["forward_s"]),
                                    int(d["seqs"]), bool(d["after_idle"]),
                                    {k: float(v) for k, v in d["features"].items()}))
    return steps, offset + end


def speed_vs_profile(profile: CostModel, steps: Sequence[LoggedStep],
                     frontend: LLMFrontEnd | None = None) -> float:
    """The logged steps' seconds over the profile's for the same step shapes, minus 1 (+0.05: the steps
    took 5% longer than profiled); NaN without steps. With ``frontend`` (the profile's serving path),
    against what the simulator prices a step at, ``frontend.step_seconds``, and a step's seconds are the
    interval to the next step's start while the engine went straight on (its own ``wall_s`` before an
    idle wait: ``sim.llm.step_cycles``, as the profile measured them); without, ``wall_s``
    against the bare step model; both priced by ``StepPricer``."""
    if not steps:
        return math.nan
    pricer = StepPricer(profile)
    if frontend is None:
        predicted = sum(pricer.latency(s.features) for s in steps)
        took = sum(s.wall_s for s in steps)
    else:
        predicted = sum(frontend.step_seconds(pricer.latency(s.features), s.seqs, is_prefill(s))
                        for s in steps)
        took = float(step_cycles([s.start for s in steps], [s.wall_s for s in steps],
                                 [s.after_idle for s in steps]).sum())
    return took / predicted - 1.0 if predicted > 0 else math.nan


def is_prefill(step: LoggedStep) -> bool:
    """Whether the step carried a prefill chunk (its forward is priced by ``prefill_factor``)."""
    return step.features.get("prefill_tokens", 0.0) > 0


SEQS_BINS = ((1, 1), (2, 3), (4, 7), (8, 15), (16, 31), (32, 10**9))


def speed_by_seqs(profile: CostModel, steps: Sequence[LoggedStep], frontend: LLMFrontEnd,
                  bins: Sequence[tuple[int, int]] = SEQS_BINS,
                  prefill: bool | None = None) -> list[tuple[str, int, float, float]]:
    """Per bin of sequences per step (``bins``: ``(lo, hi)`` both included, default ``SEQS_BINS``; bins
    without steps left out): ``(label, steps, forward, overhead)``, ``forward`` the steps'
    ``forward_s`` over ``frontend.forward_factor`` (the speed under load, per count of sequences and
    kind of step) times ``StepPricer``'s prediction, minus 1, ``overhead`` the rest of their cycle
    (``step_cycles`` less the forward) over ``step_const_s + step_per_seq_s * seqs``, minus 1 (NaN
    where that line is 0). ``prefill``: only the steps with a prefill chunk (True) or only the
    decode-only ones (False); every step's cycle is still its interval to the next logged step."""
    if not steps:
        return []
    seqs = np.array([s.seqs for s in steps])
    fwd = np.array([s.forward_s for s in steps])
    pricer = StepPricer(profile)
    pred = np.array([pricer.latency(s.features) * frontend.forward_factor(s.seqs, is_prefill(s))
                     for s in steps])
    cycles = step_cycles([s.start for s in steps], [s.wall_s for s in steps], [s.after_idle for s in steps])
    rest = cycles - fwd
    line = frontend.step_const_s + frontend.step_per_seq_s * seqs
    out = []
    kind = np.array([prefill is None or is_prefill(s) == prefill for s in steps])
    for lo, hi in bins:
        m = (seqs >= lo) & (seqs <= hi) & kind
        if not m.any():
            continue
        label = str(lo) if lo == hi else (f"{lo}-{hi}" if hi < 10**9 else f"{lo}+")
        over = float(rest[m].sum() / line[m].sum() - 1.0) if line[m].sum() > 0 else math.nan
        out.append((label, int(m.sum()), float(fwd[m].sum() / pred[m].sum() - 1.0), over))
    return out


def format_by_seqs(rows: Sequence[tuple[str, int, float, float]]) -> str:
    return "; ".join(f"{label}: forward {f:+.1%}, overhead {o:+.1%} ({n})" for label, n, f, o in rows)


def steps_main(argv: Sequence[str] | None = None) -> int:
    """Print ``speed_by_seqs`` for a ``bench fidelity --workload conv-llm`` output folder (and the profile
    it ran with, when it was given one with ``--profile``)."""
    args = list(sys.argv[1:] if argv is None else argv)
    by_count, by_kind = "--by-count" in args, "--by-kind" in args
    args = [a for a in args if a not in ("--by-count", "--by-kind")]
    if len(args) not in (1, 2):
        print("usage: python -m batchpilot.bench.llm_fidelity OUT [PROFILE] [--by-count] [--by-kind]  "
              "(OUT: a "
              "bench fidelity --workload conv-llm folder; PROFILE: the LLM profile it ran with, "
              "OUT/llm_profile.json by default; --by-count: each count of sequences per step apart; "
              "--by-kind: decode-only steps and steps with a prefill chunk apart)")
        return 2
    out = Path(args[0])
    profile = Path(args[1]) if len(args) == 2 else out / "llm_profile.json"
    for path in (profile, out / "steps.jsonl"):
        if not path.is_file():
            print(f"llm_steps: {path} does not exist (with bench fidelity --profile P, pass P as PROFILE)")
            return 2
    steps = read_steps(out / "steps.jsonl")[0]
    bins = [(k, k) for k in range(1, 33)] + [(33, 10**9)] if by_count else SEQS_BINS
    model, frontend = CostModel.load(profile), LLMFrontEnd.from_profile(profile)
    kinds: list[tuple[str, bool | None]] = [("", None)]
    if by_kind:  # the two kinds the forward is priced apart (sim.llm)
        kinds = [("decode-only ", False), ("with a prefill chunk ", True)]
    for name, kind in kinds:
        count = sum(kind is None or is_prefill(s) == kind for s in steps)
        print(f"{count} {name}engine steps against {profile}, by sequences per step:")
        for label, n, f, o in speed_by_seqs(model, steps, frontend, bins, kind):
            print(f"  {label:>6} seqs  {n:7d} steps  forward {f:+7.1%}  overhead {o:+7.1%}")
    return 0


# The LLM fidelity check's tables: the prediction against the live run, and the live run against itself.

TARGETS = {"TTFT": 0.10, "TPOT": 0.10, "output": 0.05}
METRICS = ("TTFT P50 ms", "TTFT P99 ms", "TPOT P50 ms", "TPOT P99 ms", "output tok/s")
HEAD = ["load", "rate scale", "metric", "predicted", "measured", "error", "target", "within",
        "speed vs profile", "speed checked before", "error of the profile alone"]
REPEAT_HEAD = ["load", "metric", "live", "live again", "difference", "within target", "speed vs profile"]


def _values(s: Summary) -> list[float]:
    """A run's value of each of ``METRICS``, in seconds for the latencies."""
    return [s.ttft.get("p50", math.nan), s.ttft.get("p99", math.nan), s.tpot.get("p50", math.nan),
            s.tpot.get("p99", math.nan), s.output_tokens_per_s]


SPREAD_METRICS = (*METRICS, "rejected")  # scored against the replays' spread (``fidelity.score_spread``)


def spread_values(s: Summary, rejected: int) -> list[float]:
    """A run's value of each of ``SPREAD_METRICS``, the latencies in ms as the tables show them."""
    return [v * (1.0 if m == "output tok/s" else 1e3) for m, v in zip(METRICS, _values(s), strict=True)] + [
        float(rejected)]


def comparison_rows(load: float, k: float, pred: Summary, rejected_pred: int, meas: Summary,
                    speed: float, checked: float = math.nan,
                    alone: tuple[Summary, int] | None = None) -> list[list[Any]]:
    """Predicted vs measured with targets: TTFT and TPOT 10%, output tokens/s 5%, rejected within 10%
    or 5 requests; every row of the point carries its speed vs profile, the speed the recheck before
    the point measured (``pred`` is made at it) and the error of ``alone``, the prediction from the
    profile as it was (summary, rejected)."""
    sp = f"{speed:+.1%}" if math.isfinite(speed) else "-"
    ck = f"{checked:+.1%}" if math.isfinite(checked) else "-"
    first = _values(alone[0]) if alone else [math.nan] * 5
    rows: list[list[Any]] = []
    for metric, p, m, f in zip(METRICS, _values(pred), _values(meas), first, strict=True):
        unit = 1.0 if metric == "output tok/s" else 1e3
        e, target, ef = _err(p, m), TARGETS[metric.split()[0]], _err(f, m)
        rows.append([f"{load:.0%}", f"{k:.3f}", metric, f"{p * unit:.2f}", f"{m * unit:.2f}",
                     f"{e:+.1%}" if math.isfinite(e) else "-", f"{target:.0%}",
                     "yes" if within_target(metric, p, m, TARGETS) else "no", sp, ck,
                     f"{ef:+.1%}" if math.isfinite(ef) else "-"])
    rejected = meas.num_requests - meas.num_ok
    ok = within_target("rejected", rejected_pred, rejected)
    rows.append([f"{load:.0%}", f"{k:.3f}", "rejected", str(rejected_pred), str(rejected),
                 f"{rejected_pred - rejected:+d}", "10% or 5", "yes" if ok else "no", sp, ck,
                 f"{alone[1] - rejected:+d}" if alone else "-"])
    return rows


def repeat_rows(load: float, first: Summary, again: Summary, speeds: tuple[float, float]) -> list[list[Any]]:
    """The same rows replayed again on the same server, scored against the first replay under the
    prediction's targets (``bench fidelity --live-repeats``): how often the live run meets them against
    itself, back to back, which bounds how often a prediction made before the run can. ``speeds``: each
    replay's steps against the profile."""
    sp = " / ".join(f"{s:+.1%}" if math.isfinite(s) else "-" for s in speeds)
    rows: list[list[Any]] = []
    for metric, a, b in zip(METRICS, _values(first), _values(again), strict=True):
        unit = 1.0 if metric == "output tok/s" else 1e3
        e = _err(b, a)
        rows.append([f"{load:.0%}", metric, f"{a * unit:.2f}", f"{b * unit:.2f}",
                     f"{e:+.1%}" if math.isfinite(e) else "-",
                     "yes" if within_target(metric, b, a, TARGETS) else "no", sp])
    r1, r2 = first.num_requests - first.num_ok, again.num_requests - again.num_ok
    rows.append([f"{load:.0%}", "rejected", str(r1), str(r2), f"{r2 - r1:+d}",
                 "yes" if within_target("rejected", r2, r1) else "no", sp])
    return rows


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
             sla_s: float, frontend: LLMFrontEnd | None = None) -> Predicted:
    """The simulated run as a ``Summary`` whose latency percentiles are TTFT (what the SLA is on), and
    the simulator's own report (``num_rejected``)."""
    from batchpilot.sim.llm import simulate_llm

    rep = simulate_llm(workload, config, cost_model, frontend=frontend).report()
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


def _replay(plan: Any, config: LoadGenConfig, step_log: Path, label: str) -> tuple[Any, list[Any]]:
    """Replay ``plan`` on the server and wait until it is idle: the replay's result and the engine
    steps it logged."""
    wait_written()  # what ran before is in the log: this replay's steps start after it
    offset = step_log.stat().st_size if step_log.exists() else 0
    res = replay(plan, config, description=label)
    wait_idle(config.base_url, 30.0)
    wait_written()
    return res, (read_steps(step_log, offset)[0] if step_log.exists() else [])


def check_llm_fidelity(wl: Workload, start: int, opts: FidelityOptions) -> int:
    """``bench fidelity --workload conv-llm``: ``wl`` is the trace's rows from ``start``."""
    out, sla, cpus, model = opts.out, opts.sla_s, opts.cpus, opts.llm_model
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    config, profile_path = engine_config_and_profile(out, opts.spec, opts.profile, cpus, model)
    cost_model, frontend = CostModel.load(profile_path), LLMFrontEnd.from_profile(profile_path)
    check = opts.speed_check and "step_points" in cost_model.meta
    if opts.speed_check and not check:
        print(f"{profile_path} holds no step points: predicting without a speed check", flush=True)
    print(f"workload conv-llm rows [{start}, {start + len(wl)}) over {wl.duration_s:.1f} s "
          f"({wl.mean_rate:.2f} req/s); TTFT P99 SLA {sla:g} s; engine {config}", flush=True)
    search = CapacityConfig(sla_s=sla, rel_tol=0.03, max_probes=30, lo=1e-3, hi=256.0)
    cap = search_capacity(lambda k: simulate(wl.scale_rate(k), config, cost_model, sla, frontend)[0], search)
    bound = "" if cap.bracketed else f" (a lower bound: every rate up to x{search.hi:g} met the SLA)"
    print(f"simulated capacity: rate scale {cap.rate_scale:.3f} = {cap.rps:.2f} req/s{bound}", flush=True)
    result: dict[str, Any] = {
        "workload": "conv-llm", "start": start, "requests": len(wl), "sla_s": sla,
        "config": dataclasses.asdict(config),
        "cost_model": cost_model.to_dict(), "capacity_scale": cap.rate_scale, "capacity_rps": cap.rps,
        "capacity_bracketed": cap.bracketed,
        "points": []}
    if cap.rate_scale <= 0:
        print("no rate meets the TTFT SLA in simulation; raise --sla or re-profile", flush=True)
        return 1
    pin_load_generator(cpus)
    step_log = (out / "steps.jsonl").resolve()
    step_log.unlink(missing_ok=True)
    serve_args = ["--llm", "--log-level", "warning", "--no-warmup", "--llm-step-log", str(step_log),
                  *opts.serve_flags]
    if model:
        serve_args += ["--llm-model", model]
    if cpus:
        serve_args += ["--threads", str(len(cores(cpus)))]
    with serve(serve_args, log_path=out / "serve-llm.log", cpus=cpus) as url:
        keep = client_keepalive_s(serve_args, opts.keepalive_s)  # pooled as a gateway pools them
        run = LLMPoints(opts, url, keep, config, cost_model, frontend, profile_path, step_log, check)
        first = wl.slice(0, min(2, len(wl)))  # the server's first steps allocate: not measured
        replay(build_plan(first, "completions", warmup_requests=len(first)), run.quiet)
        wait_idle(url, 30.0)
        points = [run.point(wl, load, load * cap.rate_scale) for load in opts.loads]  # each's first replay
        for j in range(2, opts.live_repeats + 1):  # round-robin: A #2, B #2, A #3, B #3, ...
            for p in points:
                run.again(p, j)
    result["points"] = [run.finish(p) for p in points]
    report = write_llm_results(out, run, result)
    print(f"fidelity.json and {report} written to {out}/ in {time.monotonic() - t0:.0f} s")
    return 0


class LLMPoints:
    """The load points of one LLM fidelity check against one server: each predicted, replayed and
    compared, the rows of its tables gathered here."""

    def __init__(self, opts: FidelityOptions, url: str, keepalive_s: float, config: LLMSchedulerConfig,
                 cost_model: CostModel, frontend: LLMFrontEnd, profile: Path, step_log: Path,
                 check: bool) -> None:
        self.opts, self.config, self.cost_model, self.frontend = opts, config, cost_model, frontend
        self.profile, self.step_log, self.check = profile, step_log, check
        self.quiet = LoadGenConfig(url, "completions", progress=False, scrape_interval_s=0,
                                   keepalive_s=keepalive_s)
        self.live = LoadGenConfig(url, "completions", progress=opts.progress, keepalive_s=keepalive_s)
        self.rows: list[list[Any]] = []
        self.repeats: list[list[Any]] = []
        self.spread: list[SpreadCell] = []
        self.runs: list[RunData] = []

    def predict(self, rows_wl: Workload, load: float) -> tuple[Predicted, Predicted, float]:
        """The prediction from the profile alone, the point's prediction (from the profile rechecked now,
        with ``--speed-check``) and the speed the recheck measured (NaN without one)."""
        o = self.opts
        alone = simulate(rows_wl, self.config, self.cost_model, o.sla_s, self.frontend)
        if not self.check:
            return alone, alone, math.nan
        # the machine's speed now, before any of the point's traffic: the prediction's
        now = f"llm_profile-now-{int(round(load * 100))}.json"
        checked = run_recheck(o.out, self.profile, o.cpus, now)
        pred = simulate(rows_wl, self.config, CostModel.load(o.out / now), o.sla_s,
                        LLMFrontEnd.from_profile(o.out / now))
        return alone, pred, checked

    def point(self, wl: Workload, load: float, k: float) -> LLMPoint:
        """The point's prediction and its first replay (the rest: ``again``, then ``finish``)."""
        o = self.opts
        rows_wl = probe_workload(wl, k, o.max_live_s) if o.max_live_s else wl.scale_rate(k)
        alone, (pred, rep), checked = self.predict(rows_wl, load)
        if o.warmup_requests:
            warm = rows_wl.slice(0, min(o.warmup_requests, len(rows_wl)))
            replay(build_plan(warm, "completions", warmup_requests=len(warm)), self.quiet)
            wait_idle(self.live.base_url, 30.0)
        plan = build_plan(rows_wl, "completions", seed=o.seed)
        res, steps = _replay(plan, self.live, self.step_log, f"{load:.0%} live")
        meas = summarize(res.records, o.sla_s)
        speed = speed_vs_profile(self.cost_model, steps, self.frontend)
        print(format_summary(meas, f"live conv-llm at {load:.0%} of capacity (x{k:.3f}, "
                                   f"{len(rows_wl)} rows)"))
        by_seqs = speed_by_seqs(self.cost_model, steps, self.frontend)
        print(f"the run's {len(steps)} engine steps took {speed:+.1%} against the step profile; by "
              f"sequences per step: {format_by_seqs(by_seqs)}", flush=True)
        self.rows += comparison_rows(load, k, pred, rep.num_rejected, meas, speed, checked,
                                     (alone[0], alone[1].num_rejected) if self.check else None)
        write_csv(res.records, o.out / f"records-llm-{int(round(load * 100))}.csv")
        self.runs.append(RunData(f"llm live {load:.0%}", res.records, meas, res.metrics, {"rate_scale": k}))
        point = {"load": load, "rate_scale": k, "rows": len(rows_wl), "speed_vs_profile": speed,
                 "speed_checked_before": checked, "predicted_profile_alone": alone[0].to_dict(),
                 "steps": len(steps), "speed_by_seqs": by_seqs, "predicted": pred.to_dict(),
                 "predicted_rejected": rep.num_rejected, "measured": meas.to_dict(),
                 "measured_rejected": meas.num_requests - meas.num_ok, "repeats": [],
                 "load_average_1m": os.getloadavg()[0]}
        return LLMPoint(load, plan, spread_values(pred, rep.num_rejected), meas, speed, point)

    def again(self, p: LLMPoint, j: int) -> None:
        """Replay #``j`` of the point's rows: compared with the first (``repeat_rows``) and part of the
        spread the prediction is scored against (``finish``)."""
        o = self.opts
        res2, steps2 = _replay(p.plan, self.live, self.step_log, f"{p.load:.0%} live #{j}")
        meas2 = summarize(res2.records, o.sla_s)
        speed2 = speed_vs_profile(self.cost_model, steps2, self.frontend)
        self.repeats += repeat_rows(p.load, p.first, meas2, (p.speed, speed2))
        p.replays.append(meas2)
        p.point["repeats"].append({"measured": meas2.to_dict(), "speed_vs_profile": speed2,
                                   "steps": len(steps2)})
        write_csv(res2.records, o.out / f"records-llm-{int(round(p.load * 100))}-again{j}.csv")

    def finish(self, p: LLMPoint) -> dict[str, Any]:
        """The point scored against the spread of all its replays (``fidelity.spread_cells``): its result."""
        cells = spread_cells(p.load, SPREAD_METRICS, p.predicted,
                             [spread_values(m, m.num_requests - m.num_ok) for m in [p.first, *p.replays]])
        self.spread += cells
        p.point["spread"] = [c.to_dict() for c in cells]
        return p.point


@dataclass
class LLMPoint:
    """One load point between its first replay and its score: the prediction and every replay."""

    load: float
    plan: Any  # the point's replayed requests (``loadgen.build_plan``)
    predicted: list[float]  # ``spread_values`` of the prediction
    first: Summary
    speed: float  # the first replay's steps against the profile
    point: dict[str, Any]  # its entry of fidelity.json's points
    replays: list[Summary] = field(default_factory=list)  # the replays after the first


def write_llm_results(out: Path, run: LLMPoints, result: dict[str, Any]) -> Path:
    """The comparison tables printed, and fidelity.json and report.html written."""
    rows, repeats = run.rows, run.repeats
    within, scored = sum(r[7] == "yes" for r in rows), sum(r[7] in ("yes", "no") for r in rows)
    made = "the profile rechecked before each point" if run.check else "the profile alone"
    print(f"\nLLM fidelity: prediction ({made}) vs live measurement, {within} of {scored} cells within "
          f"target\n{text_table(HEAD, rows)}", flush=True)
    result["table"] = {"head": HEAD, "rows": rows}
    if repeats:
        hits = sum(r[5] == "yes" for r in repeats)
        print(f"\nThe live run against itself (the same rows replayed again on the same server): {hits} of "
              f"{len(repeats)} cells within the prediction's targets\n{text_table(REPEAT_HEAD, repeats)}",
              flush=True)
        result["repeat_table"] = {"head": REPEAT_HEAD, "rows": repeats}
    result["spread_table"], result["matrix"] = print_spread(run.spread)
    (out / "fidelity.json").write_text(json.dumps(result, indent=2, default=str))
    return write_report(out, run.runs, title="fidelity: conv-llm", sla_s=None,
                        sections=[("LLM fidelity: predicted vs measured", html_table(HEAD, rows))])


if __name__ == "__main__":
    raise SystemExit(steps_main())
