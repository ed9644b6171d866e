"""Does a batch slow down with the request rate as its profile says? Every batch of a fidelity matrix.

    .venv/bin/python benchmarks/rate_slope.py DIR [--profiles OTHER_DIR] [--flat] [--refit]
        [--by rate|tokens|busy|point]

For each folder DIR/<workload>-<cpus>/ of `benchmarks/fidelity.py --out DIR`, reads the server's batch
log (`batches.jsonl`, every load point of the run) and prices each batch as the simulator does
(`FrontEnd.batch_seconds`: the cost model under serving load at the rate of the second before it, after
its idle time, at its size and busy share), against the profile it was predicted from
(DIR/<workload>-<cpus>/profile.json, or DIR/profile-<cpus>.json for a matrix run with `--profile-once`),
or OTHER_DIR's profile-<cpus>.json with `--profiles` (the same runs priced by other profiles); the
profiles' own loaded batches are priced too. It prints the batches' slot seconds over that price by
request rate (`fidelity.by_rate`'s bins), among the batches that started right behind another (under 2
ms idle) and among those after 10-100 ms idle, so that the idle factors do not mix into the rate: a line
whose rate slope is right stays flat across the rates. `--by tokens` bins by computed tokens instead,
`--by busy` by the busy share (`sim.service`), `--by window` prints how far the machine's speed
wanders within a run over windows of 6, 18 and 54 s (the profile's loaded phase is one such look), `--by
turnaround` the driver's mean time from a batch's end to the next one's start where the next one's
requests waited (what the simulator charges such a batch: `batch_gap_s`), then that gap by the size of
the batch before it and its least-squares line in that size (a driver that answers a batch before it
starts the next one has a slope), `--by point` one ratio per
load point of each run (its run speed with the logged arrivals) and their mean distance from 1.
`--refit` prices with each profile fitted again by this checkout's code, its cost model from its grid
points (`--linear`: on the four linear features, no `tokens_sq`) and its loaded line from the batches
it kept: a change to the model's shape, tried on matrices already run before a new one is;
`--part 0 0.33` refits it from the batches of the first third of the loaded phase only (how far a
shorter look at the machine puts the same runs). The rate is counted from the logged arrivals
(`fidelity.logged_rates`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
from pathlib import Path

import batchpilot.profile.serving as sl
from batchpilot.bench.fidelity import busy_before, by_rate, idle_before, logged_rates, priced_seconds, split
from batchpilot.core.costmodel import ENCODER_FEATURES, CostModel, ProfilePoint
from batchpilot.models.profiler import fitted_features
from batchpilot.profile.serving import LOADED_TOKEN_EDGES, Loaded, fit_loaded, frontend_fields, turnaround
from batchpilot.runtime.journal import LoggedBatch, read_batches
from batchpilot.sim.service import BUSY_EDGES, FACTOR_FIELDS, FrontEnd

IDLE_BINS = (("any idle", 0.0, float("inf")), ("idle < 2 ms", 0.0, 0.002), ("idle 10-100 ms", 0.01, 0.1))
MIN_BATCHES = 10  # a cell with fewer is left out
GAP_S = 5.0  # --by window: a pause this long ends a stretch of traffic (a load point)
WINDOWS_S = (6.0, 18.0, 54.0)


def own_batches(profile: Path) -> list[LoggedBatch]:
    """The loaded batches the profile fitted its line on (none when it does not keep them)."""
    loaded = json.loads(profile.read_text()).get("serving_path", {}).get("loaded", {})
    return [LoggedBatch(b["start"], b["slot_s"], int(b["features"].get("n", 1)), b["features"],
                        arrivals=tuple(b["arrivals"])) for b in loaded.get("measured", ())]


def gaps_by_size(batches: list[LoggedBatch], window_s: float) -> str:
    """``profile.serving.turnaround_gaps`` by the size of the batch before (1, 2-4, 5-8, 9+: mean ms and
    count), and ``turnaround_line``'s ``const + slope * size`` in ms."""
    pairs = sl.turnaround_gaps(batches, window_s)
    cells = []
    for lo, hi, label in ((1, 1, "1"), (2, 4, "2-4"), (5, 8, "5-8"), (9, math.inf, "9+")):
        gaps = [g for n, g in pairs if lo <= n <= hi]
        if gaps:
            cells.append(f"{label}: {statistics.mean(gaps) * 1e3:.2f} ({len(gaps)})")
    const, slope = sl.turnaround_line(batches, window_s=window_s)
    return "; ".join(cells) + f"; line {const * 1e3:.2f} + {slope * 1e3:.3f} ms per input before"


def priced_by(profile: Path, refit: bool = False, part: tuple[float, float] = (0.0, 1.0),
              linear: bool = False, wander: bool = True, slope: bool = True) -> tuple[CostModel, FrontEnd]:
    """The profile's cost model and serving path; ``refit``: both fitted again by this checkout's code
    from what the profile measured itself, the cost model from its grid points (on
    ``models.profiler.fitted_features``; ``linear``: the four linear features) and the loaded line from
    the batches it kept (``fit_loaded``, same competing CPU and token steps; ``slope`` False: without
    the competing CPU, the level in ``loaded_alpha``; ``wander`` False: no speed wander, the residuals
    whole), from the batches that started in the ``part`` of its loaded phase only (fractions of its
    span: a shorter look at the machine)."""
    doc = json.loads(profile.read_text())
    if doc.get("frontend") is None:
        raise SystemExit(f"{profile} has no serving path (profiled with --no-serving-path)")
    cost_model = CostModel.load(profile)
    if not refit:
        return cost_model, FrontEnd.from_dict(doc["frontend"])
    points = [ProfilePoint(q["features"], q["latency_s"], q.get("memory_bytes", 0.0)) for q in doc["points"]]
    # the profile's measurements beside the fit (collation's share: the deployment pipelines by it)
    cost_model = dataclasses.replace(CostModel.fit(points, ENCODER_FEATURES if linear else
                                                   fitted_features(len(points))), meta=cost_model.meta)
    # the factors are fitted again below: a profile from another line shape (other bins) loads too
    frontend = FrontEnd.from_dict({k: v for k, v in doc["frontend"].items() if k not in FACTOR_FIELDS})
    loaded = doc["serving_path"]["loaded"]
    own = own_batches(profile)
    t0, t1 = min(b.start for b in own), max(b.start for b in own)
    kept = [Loaded(b.features, b.slot_s, b.start, list(b.arrivals)) for b in own
            if t0 + part[0] * (t1 - t0) <= b.start <= t0 + part[1] * (t1 - t0)]
    line, details = fit_loaded(kept, cost_model, loaded["competing_cpu_s"] if slope else 0.0,
                               [lo for lo, _ in loaded["token_factors"]] or [0], wander)
    return cost_model, dataclasses.replace(frontend, **frontend_fields(line, details))


def by_point(run: Path, profile: Path, refit: bool, part: tuple[float, float] = (0.0, 1.0),
             models: tuple[CostModel, FrontEnd] | None = None) -> list[tuple[str, float, int]]:
    """Per load point of a fidelity run (its ``fidelity.json``: the last batches of the log, as many
    as each point's run speed counted), (load, slot / price, batches); priced by ``models`` (a cost
    model and serving path) when given, else by the profile's (``priced_by``)."""
    cost_model, frontend = models or priced_by(profile, refit, part)
    batches = sorted(read_batches(run / "batches.jsonl", 0)[0], key=lambda b: b.start)
    price = priced_seconds(batches, cost_model, frontend, logged_rates(batches))
    points = json.loads((run / "fidelity.json").read_text())["points"]
    out, end = [], len(batches)
    for point in reversed(points):
        begin = end - point["run_speed"]["batches"]
        took = sum(b.slot_s for b in batches[begin:end])
        out.append((f"{point['load']:.0%}", took / sum(price[begin:end]), end - begin))
        end = begin
    return out[::-1]


def window_spread(batches: list[LoggedBatch], profile: Path, window_s: float) -> list[float]:
    """Per stretch of traffic (a load point: batches less than ``GAP_S`` apart), the log of each full
    ``window_s`` window's slot / price less the stretch's mean: how far the machine's speed wanders
    within a run over windows of that length (the last, partial window and windows of fewer than
    ``MIN_BATCHES`` batches left out)."""
    cost_model, frontend = priced_by(profile)
    batches = sorted(batches, key=lambda b: b.start)
    price = priced_seconds(batches, cost_model, frontend, logged_rates(batches))
    stretches: list[list[tuple[LoggedBatch, float]]] = [[]]
    for b, p in zip(batches, price, strict=True):
        if stretches[-1] and b.start - stretches[-1][-1][0].start > GAP_S:
            stretches.append([])
        stretches[-1].append((b, p))
    out: list[float] = []
    for stretch in stretches:
        cells: dict[int, list[float]] = {}
        for b, p in stretch:
            cell = cells.setdefault(int((b.start - stretch[0][0].start) // window_s), [0.0, 0.0, 0.0])
            cell[0], cell[1], cell[2] = cell[0] + b.slot_s, cell[1] + p, cell[2] + 1
        logs = [math.log(t / p) for _, (t, p, n) in sorted(cells.items())[:-1] if n >= MIN_BATCHES and p > 0]
        out += [x - statistics.mean(logs) for x in logs] if len(logs) > 1 else []
    return out


def slot_over_price(batches: list[LoggedBatch], profile: Path, flat: bool = False, by: str = "rate",
                    refit: bool = False, linear: bool = False) -> dict[str, list[tuple[str, float, int]]]:
    """Per idle bin, per ``fidelity.RATE_BINS`` bin with enough batches: (rate bin, slot / price,
    batches), the price ``fidelity.priced_seconds``'s (``flat``: without the rate slope; ``refit``,
    ``linear``: as ``priced_by``)."""
    cost_model, frontend = priced_by(profile, refit, linear=linear)
    if flat:
        mean = json.loads(profile.read_text())["serving_path"]["loaded"]["rate_mean"]
        frontend = dataclasses.replace(frontend, loaded_rate_coef=0.0,
                                       loaded_alpha=frontend.loaded_alpha + frontend.loaded_rate_coef * mean)
    batches = sorted(batches, key=lambda b: b.start)
    rates = logged_rates(batches)
    idle = idle_before(batches)
    price = priced_seconds(batches, cost_model, frontend, rates, idle)
    if by in ("tokens", "busy"):
        edges = (0, *LOADED_TOKEN_EDGES, float("inf")) if by == "tokens" else (0, *BUSY_EDGES, float("inf"))
        bins = [(lo, hi, f"{lo:g}+" if hi == float("inf") else f"{lo:g}-{hi:g}")
                for lo, hi in zip(edges, edges[1:], strict=False)]
        keys = ([b.features.get("tokens", 0.0) for b in batches] if by == "tokens"
                else busy_before(batches))
        cells = split(batches, price, keys, bins)
        return {by: [(label, 1.0 + r, n) for label, n, r in cells if n >= MIN_BATCHES]}
    out: dict[str, list[tuple[str, float, int]]] = {}
    for name, lo, hi in IDLE_BINS:
        keep = [i for i, t in enumerate(idle) if lo <= t < hi]
        cells = by_rate([batches[i] for i in keep], [price[i] for i in keep], [rates[i] for i in keep])
        out[name] = [(label, 1.0 + r, n) for label, n, r in cells if n >= MIN_BATCHES]
    return out


def run_profile(run: Path, profiles: Path, given: str | None) -> Path:
    """The profile a run of the matrix was predicted from: its own (``RUN/profile.json``, made right
    before it) unless ``--profiles`` was given, else ``profile-<cpus>.json`` of ``profiles``."""
    own = run / "profile.json"
    return own if own.is_file() and not given else profiles / f"profile-{run.name.rsplit('-', 1)[1]}.json"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", help="the --out folder of benchmarks/fidelity.py")
    ap.add_argument("--profiles", help="price the runs with this folder's profile-<cpus>.json instead")
    ap.add_argument("--flat", action="store_true", help="price without the rate slope (module docstring)")
    ap.add_argument("--by", choices=("rate", "tokens", "busy", "point", "window", "turnaround"),
                    default="rate",
                    help="bin by request rate (and idle time), computed tokens, busy share, or load point; "
                         "window: how far the speed wanders within a run (`window_spread`); turnaround: "
                         "the driver's turnaround between batches (`serving_load.turnaround`)")
    ap.add_argument("--window-ms", type=float, default=5.0,
                    help="--by turnaround: the runs' batching window (bench fidelity's deployment: 5 ms)")
    ap.add_argument("--linear", action="store_true",
                    help="with --refit: the cost model on the four linear features (no tokens_sq)")
    ap.add_argument("--refit", action="store_true",
                    help="refit each profile's loaded line from the batches it kept (`priced_by`)")
    ap.add_argument("--part", type=float, nargs=2, default=(0.0, 1.0), metavar=("FROM", "TO"),
                    help="--by point: refit from the batches of this part of the loaded phase only")
    args = ap.parse_args()
    out = Path(args.out)
    profiles = Path(args.profiles) if args.profiles else out
    runs = sorted(p for p in out.iterdir() if (p / "batches.jsonl").is_file())
    own = [] if args.profiles else [r / "profile.json" for r in runs if (r / "profile.json").is_file()]
    sets = [(p.stem if p.parent == profiles else f"profile {p.parent.name}", own_batches(p), p)
            for p in [*sorted(profiles.glob("profile-*.json")), *own]]
    sets += [(run.name, read_batches(run / "batches.jsonl", 0)[0], run_profile(run, profiles, args.profiles))
             for run in runs]
    if args.by == "point":
        errors = []
        for run in sorted(p for p in out.iterdir() if (p / "fidelity.json").is_file()):
            cells = by_point(run, run_profile(run, profiles, args.profiles),
                             args.refit or tuple(args.part) != (0.0, 1.0), tuple(args.part))
            errors += [abs(r - 1.0) for _, r, _ in cells]
            print(f"{run.name:<16} " + "; ".join(f"{label}: {r:.3f} ({n})" for label, r, n in cells))
        print(f"mean |slot / price - 1| {sum(errors) / len(errors):.2%}, worst {max(errors):.2%}")
        return 0
    if args.by == "turnaround":
        for name, batches, _ in sets:  # the profiles' own loaded phases serve without a window
            window_s = 0.0 if name.startswith("profile") else args.window_ms / 1e3
            print(f"{name:<16} {turnaround(batches, window_s=window_s) * 1e3:.2f} ms from a batch's end "
                  f"to the next one's start, the next one's requests waiting; by the size of the batch "
                  f"before, {gaps_by_size(batches, window_s)}")
        return 0
    if args.by == "window":
        for cpus in sorted({run.name.rsplit("-", 1)[1] for run in runs}):
            logged = [(b, p) for name, b, p in sets
                      if not name.startswith("profile") and name.rsplit("-", 1)[1] == cpus]
            for window_s in WINDOWS_S:
                logs = [x for b, p in logged for x in window_spread(b, p, window_s)]
                print(f"cpus {cpus:<5} {window_s:3g} s windows: {len(logs):4d}, standard deviation of "
                      f"the log of slot / price around their run's mean {statistics.pstdev(logs):.2%}")
        return 0
    for label_, batches, profile in sets:
        if not batches:
            continue
        for name, cells in slot_over_price(batches, profile, args.flat, args.by, args.refit,
                                           args.linear).items():
            print(f"{label_:<16} {name:<15} "
                  + "; ".join(f"{label}: {r:.3f} ({n})" for label, r, n in cells))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
