"""Does the tuner's ranking hold live? ``batchpilot bench tuner``.

    batchpilot bench tuner --workload conv-embed --requests 400 [--profile p.json] [--padded-profile q.json]
                           [--cpus 1]

1. Profile, before any measured traffic, once per forward path: padding-free (``--profile`` or a fresh
   ``batchpilot profile --padding none``) and padded (``--padded-profile`` or ``--padding dynamic``).
   The two forwards differ in more than their features count (one attention call per distinct length
   padding-free, one masked call per batch padded), so each config is priced, and served, with the
   profile of its own path. Then both are rechecked back to back (``batchpilot profile --recheck``,
   ``profile/speed_check.py``): each profile's own batches timed again and the file rescaled to the
   machine's speed now, so the two price their configs at one look at the machine's speed, not at two
   moments minutes apart (``--no-speed-check``: as profiled). The rechecked files are what the tuner
   searches with and what the servers run.
2. ``batchpilot tune``'s search on the slice (``sim.tune.Tuner``, the same deployment flags and that
   profile's serving path), once per profile over the padding modes it measured (``none``; ``max``,
   ``dynamic``, ``bucket``): every config measured at its last rung, merged into one ranking by
   predicted goodput (the highest rate scale whose P99, refusals counted as late, meets ``--sla``).
3. ``--configs`` of them spread over the predicted goodput (``pick``: the winner, the last, and the
   ones nearest to evenly spaced levels between) among those predicted at a third of the winner's
   goodput or more (a config far below the others orders itself), plus the default config when it is
   not among them (scored in the correlation only when it is within that third);
   each is written as a config file. Spread by goodput, not by rank position: most of a ranking sits
   within a few percent of the winner, closer than two live capacity searches on this machine agree,
   and a rank among configs predicted equal is not a prediction the check can test.
4. One ``batchpilot serve`` per config with its profile, all started at once (pinned alike with
   ``--cpus``), and one live capacity search per server on the same rows with the same definition as
   the tuner's (the whole slice per probe, P99 over it, stopped once lost), the probes interleaved
   round-robin (``bench.interleave``) so that a drift of the CPU's speed falls on every config alike.
5. Spearman's rank correlation of predicted and live goodput, and the tuned/default live ratio.
"""

from __future__ import annotations

import json
import math
import time
from contextlib import ExitStack
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from batchpilot.bench.capacity import CapacityConfig
from batchpilot.bench.fidelity import run_profile, run_recheck, text_table
from batchpilot.bench.interleave import interleaved_capacity
from batchpilot.bench.loadgen import build_plan, load_tokenizer
from batchpilot.bench.serverproc import client_keepalive_s, pin_load_generator, serve
from batchpilot.core.costmodel import CostModel
from batchpilot.core.deployment import DeploymentSpec
from batchpilot.settings import dump_spec
from batchpilot.sim.service import ServiceModel
from batchpilot.sim.traces import Workload
from batchpilot.sim.tune import TuneConfig

HEAD = ["tuner rank", "config", "kind", "profile", "predicted req/s", "live req/s", "live probes"]


@dataclass(frozen=True)
class TunerCheckOptions:
    """What ``bench tuner`` was asked (``bench/cli.py`` reads it off the flags)."""

    out: Path
    spec: DeploymentSpec  # the deployment flags: the base of every config searched and served
    sla_s: float = 1.0
    profile: str | None = None  # padding-free; None: profile first
    padded_profile: str | None = None  # None: profile first
    profile_args: str = ""
    cpus: str | None = None
    speed_check: bool = True  # recheck both profiles back to back before ranking
    configs: int = 5
    candidates: int = 32
    max_probes: int = 7
    tokenizer: str | None = None
    seed: int = 0
    serve_args: tuple[str, ...] = ()  # --serve-args, for every server
    keepalive_s: float | None = None


def spearman(x: list[float], y: list[float]) -> float:
    """Spearman's rank correlation (ties share their mean rank)."""
    def ranks(v: list[float]) -> np.ndarray:
        a = np.asarray(v, dtype=float)
        order = a.argsort(kind="stable")
        r = np.empty(len(a))
        r[order] = np.arange(len(a), dtype=float)
        for value in np.unique(a):  # mean rank for ties
            tie = a == value
            r[tie] = r[tie].mean()
        return r

    if len(x) < 2:
        return math.nan
    rx, ry = ranks(x), ranks(y)
    if rx.std() == 0 or ry.std() == 0:
        return math.nan
    return float(np.corrcoef(rx, ry)[0, 1])


def pick(rps: list[float], k: int) -> list[int]:
    """Indices of ``k`` configs spread over their predicted goodput ``rps`` (best first): for ``k``
    evenly spaced levels from the first to the last value, the nearest config not taken yet."""
    if len(rps) <= k:
        return list(range(len(rps)))
    out: list[int] = []
    for level in np.linspace(rps[0], rps[-1], k):
        out.append(min((i for i in range(len(rps)) if i not in out), key=lambda i: (abs(rps[i] - level), i)))
    return sorted(out)


PADDED = ("max", "dynamic", "bucket")
MIN_SHARE_OF_BEST = 1 / 3  # configs predicted below this share of the best goodput are not picked


def ranked_candidates(wl: Any, profiles: dict[str, Path], tc: Any,
                      spec: Any) -> tuple[list[Any], dict[int, Path]]:
    """One tuner search per profile over the padding modes it measured, merged best first; and the
    profile that priced each candidate (``id`` -> path)."""
    from batchpilot.sim.tune import Tuner

    merged, source = [], {}
    for family, path in profiles.items():
        modes = ("none",) if family == "none" else PADDED
        result = Tuner(wl, CostModel.load(path), replace(tc, paddings=modes), spec=spec,
                       service=ServiceModel.from_profile(path), log=print).run()
        for c in result.candidates:
            if c.config.planner.padding in modes and c.rps > 0:
                merged.append(c)
                source[id(c)] = path
    merged.sort(key=lambda c: (-c.rps, c.report.p99_all if c.report else math.inf))
    return merged, source


def check_tuner(wl: Workload, opts: TunerCheckOptions) -> int:
    """``bench tuner`` on the rows ``wl``: the tuner's ranking against live goodput."""
    out = opts.out
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    spec = opts.spec
    profiles = {
        "none": Path(opts.profile) if opts.profile else run_profile(
            out, "none", opts.profile_args, opts.cpus, "profile-none.json"),
        "padded": Path(opts.padded_profile) if opts.padded_profile else run_profile(
            out, "dynamic", opts.profile_args, opts.cpus, "profile-dynamic.json"),
    }
    if opts.speed_check:  # one look at the machine's speed for both
        for family, path in list(profiles.items()):
            speed = run_recheck(out, path, opts.cpus, f"profile-{family}-now.json")
            print(f"profile {path}: rechecked {speed:+.1%}", flush=True)
            profiles[family] = out / f"profile-{family}-now.json"
    tc = TuneConfig(sla_p99_s=opts.sla_s, candidates=opts.candidates, rungs=2, rel_tol=(0.1, 0.03),
                    min_rows=min(len(wl), 200), seed=opts.seed)
    ranked, source = ranked_candidates(wl, profiles, tc, spec)
    if not ranked:
        print("tuner: no config meets the SLA in simulation; was the machine busy while profiling?")
        return 1
    # the tuned config: the best search result, or the default when it predicts more (as the tuner picks)
    best = next(c for c in ranked if c.kind in ("search", "default"))
    # configs predicted under a third of the best would order themselves: the check picks among the rest
    eligible = [c for c in ranked if c.rps >= ranked[0].rps * MIN_SHARE_OF_BEST]
    chosen = [eligible[i] for i in pick([c.rps for c in eligible], opts.configs)]
    chosen += [c for c in ranked if (c is best or c.kind == "default") and c not in chosen]
    rank = {id(c): i + 1 for i, c in enumerate(ranked)}
    names = {id(c): f"c{rank[id(c)]}" for c in chosen}
    print(f"tuner: {len(ranked)} configs ranked; measuring live: "
          + "; ".join(f"#{rank[id(c)]} {c.label} ({c.rps:.2f} req/s)" for c in chosen), flush=True)
    pin_load_generator(opts.cpus)
    tok = load_tokenizer(opts.tokenizer)
    texts = [p.body["input"] for p in build_plan(wl, tokenizer=tok, seed=opts.seed)]
    ccfg = CapacityConfig(sla_s=opts.sla_s, growth=1.25, lo=0.05, hi=256.0, rel_tol=0.05,
                          max_probes=opts.max_probes, probe_s=1e9, cooldown_s=5.0)
    with ExitStack() as stack:
        urls = {}
        for c in chosen:
            # the file holds the whole deployment (encoder and server sections): no other flags
            name = names[id(c)]
            path = dump_spec(spec.replace(encoder=c.config), out / f"{name}.yaml", f"# {c.label}\n")
            serve_args = ["--profile", str(source[id(c)]), "--log-level", "warning", "--config", str(path),
                          *opts.serve_args]
            urls[name] = stack.enter_context(serve(serve_args, log_path=out / f"serve-{name}.log",
                                                   cpus=opts.cpus))
        starts = {names[id(c)]: 0.9 * c.capacity for c in chosen}
        keep = client_keepalive_s(list(opts.serve_args), opts.keepalive_s)  # as bench fidelity's
        live = interleaved_capacity(wl, urls, ccfg, texts, starts, keepalive_s=keep)
    rows, pred, meas = [], [], []
    for c in chosen:
        res = live[names[id(c)]]
        pred.append(c.rps)
        meas.append(res.rps)
        rows.append([f"#{rank[id(c)]}", c.label, c.kind, source[id(c)].name, f"{c.rps:.2f}",
                     f"{res.rps:.2f}" + ("" if res.bracketed else " (lower bound)"), str(len(res.probes))])
    scored = [i for i, c in enumerate(chosen) if c.rps >= ranked[0].rps * MIN_SHARE_OF_BEST]
    rho = spearman([pred[i] for i in scored], [meas[i] for i in scored])
    default = next((c for c in chosen if c.kind == "default"), None)
    ratio = (live[names[id(best)]].rps / live[names[id(default)]].rps
             if default is not None and live[names[id(default)]].rps > 0 else math.nan)
    pred_ratio = best.rps / default.rps if default is not None and default.rps > 0 else math.nan
    print("\nTuner check: predicted vs live goodput (highest rate with P99 <= "
          f"{opts.sla_s:g} s, refusals counted as late)\n{text_table(HEAD, rows)}")
    print(f"Spearman rank correlation, predicted vs live: {rho:.2f} over the {len(scored)} configs "
          f"predicted at {MIN_SHARE_OF_BEST:.2f} of the best or more\n"
          f"tuned ({best.label}) / default goodput: live {ratio:.3f}, predicted {pred_ratio:.3f}\n"
          f"{time.monotonic() - t0:.0f} s in all", flush=True)
    (out / "tuner_check.json").write_text(json.dumps({
        "workload": wl.name, "requests": len(wl), "profiles": {k: str(v) for k, v in profiles.items()},
        "spearman": rho, "spearman_configs": len(scored),
        "tuned_over_default_live": ratio, "tuned_over_default_predicted": pred_ratio,
        "rows": rows, "probes": {n: [(p.rate_scale, p.passed, p.summary.p99) for p in r.probes]
                                 for n, r in live.items()}}, indent=2, default=str))
    return 0

