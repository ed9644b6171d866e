"""Does a batch slow down with the request rate as its profile says? Every batch of a fidelity matrix.

    .venv/bin/python benchmarks/rate_slope.py DIR [--profiles OTHER_DIR] [--flat] [--by tokens]

For each folder DIR/<workload>-<cpus>/ of `benchmarks/fidelity.py --out DIR`, reads the server's batch
log (`batches.jsonl`, every load point of the run) and prices each batch as the simulator does
(`FrontEnd.batch_seconds`: the cost model under serving load at the rate of the second before it,
after its idle time), against DIR/profile-<cpus>.json, or OTHER_DIR's with `--profiles` (the same
runs priced by other profiles). It prints the batches' slot seconds over that price by request rate
(`run_speed.by_rate`'s bins), among the batches that started right behind another (under 2 ms
idle) and among those after 10-100 ms idle, so that the idle factors do not mix into the rate: a
line whose rate slope is right stays flat across the rates. The rate is counted from the batches'
own requests (the ones served in the second before), a stand-in for the arrivals that the batch
log does not hold.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from batchpilot.bench.run_speed import by_rate, idle_before, logged_rates, priced_seconds, split
from batchpilot.core.costmodel import CostModel
from batchpilot.runtime.batch_log import LoggedBatch, read_batches
from batchpilot.server.serving_load import LOADED_TOKEN_EDGES
from batchpilot.sim.frontend import FrontEnd

IDLE_BINS = (("any idle", 0.0, float("inf")), ("idle < 2 ms", 0.0, 0.002), ("idle 10-100 ms", 0.01, 0.1))
MIN_BATCHES = 10  # a cell with fewer is left out


def own_batches(profile: Path) -> list[LoggedBatch]:
    """The loaded batches the profile fitted its line on (none when it does not keep them)."""
    loaded = json.loads(profile.read_text()).get("serving_path", {}).get("loaded", {})
    return [LoggedBatch(b["start"], b["slot_s"], int(b["features"].get("n", 1)), b["features"],
                        arrivals=tuple(b["arrivals"])) for b in loaded.get("measured", ())]


def slot_over_price(batches: list[LoggedBatch], profile: Path, flat: bool = False,
                    by: str = "rate") -> dict[str, list[tuple[str, float, int]]]:
    """Per idle bin, per ``run_speed.RATE_BINS`` bin with enough batches: (rate bin, slot / price,
    batches), the price ``run_speed.priced_seconds``'s (``flat``: without the rate slope)."""
    cost_model, frontend = CostModel.load(profile), FrontEnd.from_profile(profile)
    if frontend is None:
        raise SystemExit(f"{profile} has no serving path (profiled with --no-serving-path)")
    if flat:
        mean = json.loads(profile.read_text())["serving_path"]["loaded"]["rate_mean"]
        frontend = dataclasses.replace(frontend, loaded_rate_coef=0.0,
                                       loaded_alpha=frontend.loaded_alpha + frontend.loaded_rate_coef * mean)
    batches = sorted(batches, key=lambda b: b.start)
    rates = logged_rates(batches)
    idle = idle_before(batches)
    price = priced_seconds(batches, cost_model, frontend, rates, idle)
    if by == "tokens":
        edges = (0, *LOADED_TOKEN_EDGES, float("inf"))
        bins = [(lo, hi, f"{lo:g}+" if hi == float("inf") else f"{lo:g}-{hi:g}")
                for lo, hi in zip(edges, edges[1:], strict=False)]
        cells = split(batches, price, [b.features.get("tokens", 0.0) for b in batches], bins)
        return {"tokens": [(label, 1.0 + r, n) for label, n, r in cells if n >= MIN_BATCHES]}
    out: dict[str, list[tuple[str, float, int]]] = {}
    for name, lo, hi in IDLE_BINS:
        keep = [i for i, t in enumerate(idle) if lo <= t < hi]
        cells = by_rate([batches[i] for i in keep], [price[i] for i in keep], [rates[i] for i in keep])
        out[name] = [(label, 1.0 + r, n) for label, n, r in cells if n >= MIN_BATCHES]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", help="the --out folder of benchmarks/fidelity.py")
    ap.add_argument("--profiles", help="price the runs with this folder's profile-<cpus>.json instead")
    ap.add_argument("--flat", action="store_true", help="price without the rate slope (module docstring)")
    ap.add_argument("--by", choices=("rate", "tokens"), default="rate")
    args = ap.parse_args()
    out = Path(args.out)
    profiles = Path(args.profiles) if args.profiles else out
    sets = [(p.stem, own_batches(p), p) for p in sorted(profiles.glob("profile-*.json"))]
    for run in sorted(p for p in out.iterdir() if (p / "batches.jsonl").is_file()):
        cpus = run.name.rsplit("-", 1)[1]
        sets.append((run.name, read_batches(run / "batches.jsonl", 0)[0], profiles / f"profile-{cpus}.json"))
    for label_, batches, profile in sets:
        if not batches:
            continue
        for name, cells in slot_over_price(batches, profile, args.flat, args.by).items():
            print(f"{label_:<16} {name:<15} "
                  + "; ".join(f"{label}: {r:.3f} ({n})" for label, r, n in cells))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
