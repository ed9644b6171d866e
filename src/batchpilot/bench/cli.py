"""``batchpilot bench``: replay a workload against a live server, compare servers, find capacity, check
the simulator's fidelity, or run the padding benchmark.

    batchpilot bench --url http://127.0.0.1:8000 --workload conv-embed --rate-scale 3 --requests 300
    batchpilot bench --compare http://127.0.0.1:8000 http://127.0.0.1:8001 cfg.yaml --rate-scale 2 3
    batchpilot bench capacity --url http://127.0.0.1:8000 --workload conv-embed --probe-s 30
    batchpilot bench fidelity --workload conv-embed --config cfg.yaml [--profile profile.json]
    batchpilot bench tuner --workload conv-embed --requests 400 [--profile profile.json]
    batchpilot bench ab --url http://127.0.0.1:8000 --requests 2000   (a server with arms: which is better)
    batchpilot bench padding ...            (the padding modes benchmark, batchpilot.bench.padding)

``--compare`` takes server URLs and/or scheduler YAML files; a YAML starts ``batchpilot serve --config``
on a free port for its run. Every run writes ``records-<label>.csv``, ``summary.json``, the PNGs and
``report.html`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import sys
from contextlib import nullcontext
from pathlib import Path
from typing import Any

from batchpilot.settings import add_deployment_args, deployment_flags, spec_from_args
from batchpilot.sim.draws import DEFAULT_DRAWS

SUBS = ("run", "capacity", "fidelity", "tuner", "ab", "padding")


def _workload_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--workload", default="conv-embed", help="conv-embed, conv-llm or a trace file")
    g.add_argument("--trace", default=None, help="the Azure trace CSV for conv-* (default: bundled copy)")
    g.add_argument("--start", type=int, default=0, help="first row of the contiguous slice")
    g.add_argument("--requests", type=int, default=None, help="rows in the slice (default: all)")
    g.add_argument("--warmup", type=int, default=0, help="first N requests are sent but not measured")
    g.add_argument("--warmup-s", type=float, default=0.0,
                   help="not measured: requests due in the first S s")
    g.add_argument("--endpoint", choices=("embeddings", "completions"), default=None,
                   help="default: completions for conv-llm, else embeddings")
    g.add_argument("--model", default=None, help="model name sent in requests (default: GET /v1/models)")
    g.add_argument("--tokenizer", default=None, help="HF tokenizer for exact-length texts (default: MiniLM)")
    g.add_argument("--prompt", choices=("ids", "text"), default="ids",
                   help="completions prompts as token ids (exact length) or real text")
    g.add_argument("--sla", type=float, default=1.0, help="P99 latency SLA in seconds")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--timeout", type=float, default=60.0, help="per-request timeout (s)")
    g.add_argument("--out", default="bench-out", help="directory for records, summary and report")
    g.add_argument("--no-progress", action="store_true")
    g.add_argument("--keepalive-s", type=float, default=None,
                   help="the load generator closes a connection idle this long (default: 2 s against --url, "
                        "the server's keep-alive less 5 s against a server bench starts)")
    g.add_argument("--serve-args", default="", help="extra args for `batchpilot serve` when a YAML is given")
    g.add_argument("--tenant", action="append", default=None, metavar="NAME:rate=R[,weight=W,...]",
                   help="run: a tenant's traffic, as `simulate --tenant` (repeat for each; replaces "
                        "--workload); each request is sent with X-Client-Id: NAME, or its --tenant-key")
    g.add_argument("--tenant-key", action="append", default=None, metavar="NAME=KEY",
                   help="run: the API key a tenant sends (a server with --api-keys)")
    g.add_argument("--duration-s", type=float, default=60.0, help="--tenant: seconds of traffic")


def _run_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default=None, help="server root, e.g. http://127.0.0.1:8000")
    p.add_argument("--compare", nargs="+", default=None, metavar="URL_OR_YAML",
                   help="several servers (URLs) and/or scheduler configs (YAML, served one after the other)")
    p.add_argument("--rate-scale", type=float, nargs="+", default=[1.0], help="one run per value")
    _workload_args(p)


def _fidelity_args(p: argparse.ArgumentParser) -> None:
    add_deployment_args(p)
    p.add_argument("--profile", default=None, help="profile JSON (default: run `batchpilot profile` first)")
    p.add_argument("--profile-args", default="", help="extra args for `batchpilot profile`")
    p.add_argument("--loads", type=float, nargs="*", default=[0.5, 0.8],
                   help="fractions of the predicted capacity")
    p.add_argument("--lengths", default="lognormal:median=128,sigma=0.8",
                   help="synthetic workloads: input lengths (as `simulate --lengths`)")
    p.add_argument("--batcher-only", action="store_true",
                   help="predict without the profile's service model (HTTP, JSON, tokens, loaded batches)")
    p.add_argument("--rescore", default=None, metavar="OUT",
                   help="no server: predict the points of an earlier run's OUT folder again (its "
                        "profile, today's simulator) and score them against its replays; give the run's "
                        "workload flags")
    p.add_argument("--ablate", action="store_true",
                   help="with --rescore: also predict with each term of the service model removed")
    p.add_argument("--warmup-requests", type=int, default=30, help="unmeasured requests before each point")
    p.add_argument("--live-repeats", type=int, default=3,
                   help="replay each point this many times on the same server, round-robin over the points; "
                        "the prediction is scored against the replays' median and min-max widened by 10%%")
    p.add_argument("--draws", type=int, default=DEFAULT_DRAWS,
                   help="service-noise draws per prediction: each metric is predicted as its median over "
                        "them, with the 5-95%% band beside it (sim.draws)")
    p.add_argument("--noop-delay-ms", type=float, default=None,
                   help="serve the no-op model with this fixed time per batch, profiled as exactly that: "
                        "checks the serving path (HTTP, tokenise, batcher, loop) without model noise")
    p.add_argument("--cpus", default=None,
                   help="pin the profiler and the server to these cores (taskset -c syntax, e.g. 1); the "
                        "load generator runs on the others")
    # read by --workload conv-llm only (bench/llm_fidelity.py)
    p.add_argument("--llm-model", default=None,
                   help="conv-llm: local HF causal-LM folder, profiled and served (default: the built-in "
                        "tiny random Llama)")


def _tuner_args(p: argparse.ArgumentParser) -> None:
    add_deployment_args(p)
    p.add_argument("--profile", default=None,
                   help="padding-free profile JSON (default: run `batchpilot profile --padding none` first)")
    p.add_argument("--padded-profile", default=None,
                   help="padded profile JSON (default: run `batchpilot profile --padding dynamic` first)")
    p.add_argument("--profile-args", default="", help="extra args for `batchpilot profile`")
    p.add_argument("--lengths", default="lognormal:median=128,sigma=0.8",
                   help="synthetic workloads: input lengths (as `simulate --lengths`)")
    p.add_argument("--configs", type=int, default=5, help="configs picked across the tuner's ranking")
    p.add_argument("--candidates", type=int, default=32, help="grid points the tuner samples")
    p.add_argument("--max-probes", type=int, default=7, help="live probes per config")
    p.add_argument("--cpus", default=None, help="pin the profiler and every server to these cores")
    p.add_argument("--no-speed-check", action="store_true",
                   help="rank with the profiles as they were made, not rechecked back to back first")


def _ab_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", required=True, help="the server with arms")
    p.add_argument("--rate-scale", type=float, default=1.0)
    p.add_argument("--clients", type=int, default=64, help="simulated clients (X-Client-Id values)")
    p.add_argument("--confidence", type=float, default=0.95)
    p.add_argument("--json", default=None, metavar="PATH", help="also write the verdict as JSON")
    p.add_argument("--api-key", default=None, help="for a server started with --api-key")


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("bench", help="load-test a server (open loop), capacity, fidelity",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _run_args(p)
    p.set_defaults(func=main_run, bench_command="run")
    sub = p.add_subparsers(dest="bench_command", metavar="{run,capacity,fidelity,tuner,ab,padding}")
    r = sub.add_parser("run", help="replay a workload (the default)")
    _run_args(r)
    r.set_defaults(func=main_run)
    c = sub.add_parser("capacity", help="highest rate scale whose P99 meets the SLA (live)")
    c.add_argument("--url", required=True)
    _workload_args(c)
    c.add_argument("--probe-s", type=float, default=30.0, help="seconds of arrivals per probe")
    c.add_argument("--start-scale", type=float, default=1.0)
    c.add_argument("--lo", type=float, default=0.05)
    c.add_argument("--hi", type=float, default=64.0)
    c.add_argument("--tol", type=float, default=0.1, help="relative width at which bisection stops")
    c.add_argument("--max-probes", type=int, default=10)
    c.set_defaults(func=main_capacity)
    f = sub.add_parser("fidelity", help="simulated vs measured P50/P99/throughput/batch size")
    _fidelity_args(f)
    _workload_args(f)
    f.set_defaults(func=_fidelity)
    t = sub.add_parser("tuner", help="the tuner's ranking against live goodput (Spearman), interleaved")
    _tuner_args(t)
    _workload_args(t)
    t.set_defaults(func=_tuner)
    ab = sub.add_parser("ab", help="the arms of a server compared: which is better, and is it significant")
    _ab_args(ab)
    _workload_args(ab)
    ab.set_defaults(func=_ab)
    # prefix_chars="+": every "-..." token after "padding" (--help included) is the padding benchmark's
    pad = sub.add_parser("padding", help="padding modes benchmark (batchpilot.bench.padding)", add_help=False,
                         prefix_chars="+")
    pad.add_argument("args", nargs=argparse.REMAINDER)
    pad.set_defaults(func=_padding)


def _padding(args: argparse.Namespace) -> int:
    from batchpilot.bench import padding  # imported only when asked for

    return int(padding.main(list(args.args)) or 0)


def _fidelity(args: argparse.Namespace) -> int:
    from batchpilot.bench.fidelity import FidelityOptions, check_fidelity

    opts = FidelityOptions(
        out=Path(args.out), spec=spec_from_args(args),
        serve_flags=(*deployment_flags(args), *shlex.split(args.serve_args)), sla_s=args.sla,
        loads=tuple(args.loads), profile=args.profile, profile_args=args.profile_args, cpus=args.cpus,
        batcher_only=args.batcher_only, warmup_requests=args.warmup_requests,
        rescore=args.rescore, ablate=args.ablate,
        live_repeats=args.live_repeats, draws=args.draws, noop_delay_ms=args.noop_delay_ms,
        tokenizer=args.tokenizer, seed=args.seed, keepalive_s=args.keepalive_s, progress=not args.no_progress,
        llm_model=args.llm_model)
    if args.workload == "conv-llm":
        from batchpilot.bench.llm_fidelity import DEFAULT_REQUESTS, check_llm_fidelity
        from batchpilot.sim.traces import load_workload

        rows = load_workload("conv-llm", 1.0, args.start, args.requests or DEFAULT_REQUESTS, trace=args.trace)
        return check_llm_fidelity(rows, args.start, opts)
    return check_fidelity(fidelity_workload(args), opts)


def fidelity_workload(args: argparse.Namespace) -> Any:
    """What ``bench fidelity`` and ``bench tuner`` replay: a standard workload or trace (rows
    ``--start``..), or a synthetic spec with ``--lengths``; ``--requests`` rows (default 1000)."""
    from batchpilot.bench.fidelity import DEFAULT_REQUESTS
    from batchpilot.sim.synthetic import named_workload

    return named_workload(args.workload, trace=args.trace, start=args.start,
                          requests=args.requests or DEFAULT_REQUESTS, lengths=args.lengths, seed=args.seed)


def _tuner(args: argparse.Namespace) -> int:
    from batchpilot.bench.tuner_check import TunerCheckOptions, check_tuner

    opts = TunerCheckOptions(
        out=Path(args.out), spec=spec_from_args(args), sla_s=args.sla, profile=args.profile,
        padded_profile=args.padded_profile, profile_args=args.profile_args, cpus=args.cpus,
        speed_check=not args.no_speed_check, configs=args.configs, candidates=args.candidates,
        max_probes=args.max_probes, tokenizer=args.tokenizer, seed=args.seed,
        serve_args=tuple(shlex.split(args.serve_args)), keepalive_s=args.keepalive_s)
    return check_tuner(fidelity_workload(args), opts)


def _ab(args: argparse.Namespace) -> int:
    from batchpilot.bench.ab import ABOptions, run_ab

    opts = ABOptions(
        url=args.url, endpoint=_endpoint(args), model=args.model, rate_scale=args.rate_scale,
        clients=args.clients, confidence=args.confidence, seed=args.seed, timeout_s=args.timeout,
        warmup_requests=args.warmup, warmup_s=args.warmup_s, tokenizer=args.tokenizer, api_key=args.api_key,
        progress=not args.no_progress, json_path=args.json)
    return run_ab(load_args_workload(args, args.rate_scale), opts)


def _endpoint(args: argparse.Namespace) -> str:
    return args.endpoint or ("completions" if args.workload == "conv-llm" else "embeddings")


def load_args_workload(args: argparse.Namespace, rate_scale: float = 1.0) -> Any:
    from batchpilot.sim.traces import load_workload

    if getattr(args, "tenant", None):
        from batchpilot.sim.tenants import TenantLoad, tenant_mix

        wl = tenant_mix([TenantLoad.parse(t) for t in args.tenant], args.duration_s, args.seed, args.trace)[0]
        return wl.scale_rate(rate_scale) if rate_scale != 1.0 else wl
    return load_workload(args.workload, rate_scale, args.start, args.requests, trace=args.trace)


def tenant_keys(args: argparse.Namespace) -> dict[str, str]:
    """``--tenant-key NAME=KEY`` as a dict."""
    keys = {}
    for item in getattr(args, "tenant_key", None) or ():
        name, eq, key = item.partition("=")
        if not eq or not name or not key:
            raise ValueError(f"--tenant-key wants NAME=KEY, got {item!r}")
        keys[name] = key
    return keys


def _label(target: str) -> str:
    if target.startswith("http"):
        return re.sub(r"^https?://", "", target).rstrip("/")
    return Path(target).stem


def main_run(args: argparse.Namespace) -> int:
    from batchpilot.bench.loadgen import (
        KEEPALIVE_EXPIRY_S,
        LoadGenConfig,
        build_plan,
        load_tokenizer,
        replay,
        with_tenants,
    )
    from batchpilot.bench.records import by_tenant, format_summary, summarize, write_csv
    from batchpilot.bench.report import RunData, write_report
    from batchpilot.bench.serverproc import client_keepalive_s, serve

    targets = args.compare or ([args.url] if args.url else [])
    if not targets:
        print("batchpilot bench: give --url URL or --compare URL_OR_YAML ...", file=sys.stderr)
        return 2
    endpoint = _endpoint(args)
    base = load_args_workload(args)
    tok = load_tokenizer(args.tokenizer) if endpoint == "embeddings" or args.prompt == "text" else None
    base_plan = build_plan(base, endpoint, tokenizer=tok, prompt=args.prompt, seed=args.seed)  # type: ignore[arg-type]
    texts = [p.body.get("input") or p.body.get("prompt") for p in base_plan] if tok is not None else None
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs: list[RunData] = []
    summaries: dict[str, Any] = {}
    for target in targets:
        is_url = target.startswith(("http://", "https://"))
        serve_args = ["--config", target, *shlex.split(args.serve_args)]
        log = out / f"serve-{_label(target)}.log"
        keep = client_keepalive_s(serve_args, args.keepalive_s) if not is_url else \
            KEEPALIVE_EXPIRY_S if args.keepalive_s is None else args.keepalive_s
        ctx = nullcontext(target) if is_url else serve(serve_args, log_path=log)
        with ctx as url:
            for k in args.rate_scale:
                wl = base.scale_rate(k) if k != 1.0 else base
                plan = build_plan(wl, endpoint, texts=texts, prompt=args.prompt, seed=args.seed,  # type: ignore[arg-type]
                                  warmup_requests=args.warmup, warmup_s=args.warmup_s / k)
                plan = with_tenants(plan, wl, tenant_keys(args))
                label = _label(target) + (f" x{k:g}" if len(args.rate_scale) > 1 else "")
                keys = tenant_keys(args)  # a server with keys: the first one asks GET /v1/models
                auth = {"Authorization": f"Bearer {next(iter(keys.values()))}"} if keys else None
                cfg = LoadGenConfig(url, endpoint, args.model, args.timeout, progress=not args.no_progress,  # type: ignore[arg-type]
                                    keepalive_s=keep, headers=auth)
                res = replay(plan, cfg, description=label)
                s = summarize(res.records, args.sla)
                print(format_summary(s, label))
                if wl.tenant is not None:
                    for name, ts in by_tenant(res.records, args.sla).items():
                        print(format_summary(ts, f"{label} tenant {name}"))
                safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", label)
                write_csv(res.records, out / f"records-{safe}.csv")
                info = {"url": url, "workload": args.workload, "rate_scale": k, "start": args.start,
                        "requests": len(plan), "model": res.model, "endpoint": endpoint}
                runs.append(RunData(label, res.records, s, res.metrics, info))
                summaries[label] = {**info, **s.to_dict()}
    (out / "summary.json").write_text(json.dumps(summaries, indent=2, default=str))
    report = write_report(out, runs, title=f"batchpilot bench: {args.workload}", sla_s=args.sla)
    print(f"records, summary.json and {report} written to {out}/")
    return 0


def main_capacity(args: argparse.Namespace) -> int:
    from batchpilot.bench.capacity import CapacityConfig, live_capacity
    from batchpilot.bench.loadgen import KEEPALIVE_EXPIRY_S, LoadGenConfig
    from batchpilot.bench.report import write_report

    cfg = CapacityConfig(sla_s=args.sla, start=args.start_scale, lo=args.lo, hi=args.hi, rel_tol=args.tol,
                         max_probes=args.max_probes, probe_s=args.probe_s, warmup_requests=args.warmup)
    lg = LoadGenConfig(args.url, _endpoint(args), args.model, args.timeout, progress=not args.no_progress,  # type: ignore[arg-type]
                       keepalive_s=KEEPALIVE_EXPIRY_S if args.keepalive_s is None else args.keepalive_s)
    wl = load_args_workload(args)

    def show(p: Any) -> None:
        s = p.summary
        print(f"  probe x{p.rate_scale:.3f}: offered {s.offered_rps:.2f} req/s, P99 {s.p99 * 1e3:.0f} ms, "
              f"{s.num_requests - s.num_ok} failed -> {'pass' if p.passed else 'FAIL'}", flush=True)

    result = live_capacity(wl, lg, cfg, on_probe=show)
    print(result.table())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "capacity.json").write_text(json.dumps(
        {"rate_scale": result.rate_scale, "rps": result.rps, "sla_s": result.sla_s,
         "probes": [{"rate_scale": p.rate_scale, "passed": p.passed, **p.summary.to_dict()}
                    for p in result.probes]},
        indent=2, default=str))
    report = write_report(out, [], title=f"capacity: {args.url}", capacity=[result], sla_s=args.sla)
    print(f"capacity.json and {report} written to {out}/")
    return 0
