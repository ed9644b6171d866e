"""The fidelity matrix as one markdown table: every point of `benchmarks/fidelity.py --out DIR`.

    .venv/bin/python benchmarks/fidelity_summary.py DIR

Reads DIR/<workload>-<cpus>/fidelity.json (what `batchpilot bench fidelity` writes) and prints, per
point: P50 and P99 predicted (the median over the simulator's noise draws) and measured with their
errors, the P99 band of the draws (5th-95th percentile) and whether the live P99 fell in it (and
below the table, how many live P50s fell in theirs), the
throughput error, the rejected counts, the mean batch size, the speed the recheck measured before the
point (the prediction is made at it) and the P50 / P99 errors of the profile alone (no recheck), the
run's speed against the profile and the errors at the run's own speed (hindsight, never the
prediction), and how many requests took the live P99 or longer and in how many distinct seconds of
the schedule they arrived (``records.tail_seconds``: one or two seconds means the P99 is one burst's,
and moves with the machine's state in that second). Then the counts within target, for the
prediction and for the profile alone.

Where the points were replayed (``benchmarks/fidelity.py ... -- --live-repeats 2``), a table of the
second replay against the first, counted under the same targets, beside the prediction counted
against each replay: how often the live server meets the targets against itself, back to back on
one server, which bounds how often any prediction made before the run can. Where the points hold their
score against the replays' spread (``spread``), the bias per metric and the latency cells inside it
over all folders (``fidelity.combine_results``).

A second table checks the serving path outside the batcher per point: the median of each answered
request's latency minus its `tokenize` and `batcher` parts (records-<load>.csv) beside what the
profile's `frontend` predicts for the same requests: the lone requests' line alone, and with the
delay under load (`FrontEnd.delay` at the arrival rate before each request), and with that delay
fitted through the profile's loaded segments below one slot's rate only (`below_one_slot`: what the
profile's own line is since `serving_delay` leaves the others out, and what an older profile's
would be), then each line's mean |error| and range against the live medians over the points.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import statistics
from pathlib import Path

import numpy as np

from batchpilot.bench.fidelity import combine_results, format_matrix, within_target
from batchpilot.bench.records import read_csv, tail_seconds
from batchpilot.profile.serving import LOADED_SHARES
from batchpilot.sim.service import FrontEnd, fit_line

SCORED = ("P50 ms", "P99 ms", "throughput req/s", "rejected")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", help="the --out folder of benchmarks/fidelity.py")
    args = ap.parse_args()
    print("| workload | cpus | load | P50 pred / meas ms | P50 err | P99 pred / meas ms | P99 err "
          "| P99 band of the draws ms | thr err | rejected pred / meas | batch pred / meas "
          "| speed checked before | P50 / P99 err, profile alone "
          "| speed vs profile (15 s windows) | P50 / P99 err at the run's speed "
          "| slowest 1%: requests / seconds they arrived in |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    within = {k: [0, 0] for k in SCORED}
    hindsight: dict[str, list[float]] = {"P50 ms": [], "P99 ms": []}
    in_band, p50_band = [0, 0], [0, 0]
    alone = {"P50 ms": [0, 0], "P99 ms": [0, 0]}  # within 10% without the recheck
    for run in sorted(Path(args.out).glob("*-*/fidelity.json")):
        name, cpus = run.parent.name.rsplit("-", 1)
        rows = json.loads(run.read_text())["table"]["rows"]
        for load in dict.fromkeys(r[0] for r in rows):
            r = {x[2]: x for x in rows if x[0] == load}
            for k in SCORED:
                within[k][1] += 1
                within[k][0] += r[k][7] == "yes"
            for k, v in hindsight.items():
                if r[k][9] != "-":
                    v.append(abs(float(r[k][9].rstrip("%"))))
            band = r["P99 ms"][10] if len(r["P99 ms"]) > 10 else "-"
            inside = "-"
            if band != "-":
                lo, hi = (float(x) for x in band.split(" .. "))
                inside = "yes" if lo <= float(r["P99 ms"][4]) <= hi else "no"
                in_band[0] += inside == "yes"
                in_band[1] += 1
            if len(r["P50 ms"]) > 10 and r["P50 ms"][10] != "-":
                lo, hi = (float(x) for x in r["P50 ms"][10].split(" .. "))
                p50_band[0] += lo <= float(r["P50 ms"][4]) <= hi
                p50_band[1] += 1
            p50, p99 = r["P50 ms"], r["P99 ms"]
            checked, first = (p50[11], f"{p50[12]} / {p99[12]}") if len(p50) > 12 else ("-", "-")
            for k, v in alone.items():
                if len(r[k]) > 12 and r[k][12] != "-":
                    v[1] += 1
                    v[0] += abs(float(r[k][12].rstrip("%"))) <= 10.0
            rej, size = r["rejected"], r["mean batch size"]
            records = run.parent / f"records-{load.rstrip('%')}.csv"
            tail = "{} / {}".format(*tail_seconds(read_csv(records))) if records.exists() else "-"
            print(f"| {name} | {cpus} | {load} | {p50[3]} / {p50[4]} | {p50[5]} | {p99[3]} / {p99[4]} "
                  f"| {p99[5]} | {band} ({inside}) | {r['throughput req/s'][5]} | {rej[3]} / {rej[4]} "
                  f"| {size[3]} / {size[4]} | {checked} | {first} | {p50[8]} | {p50[9]} / {p99[9]} "
                  f"| {tail} |")
    total = sum(v[0] for v in within.values())
    scored = sum(v[1] for v in within.values())
    print(f"\n{total} of {scored} scored cells within target: "
          + ", ".join(f"{k.split()[0]} {v[0]}/{v[1]}" for k, v in within.items()))
    print(f"live P99 inside the band of the draws: {in_band[0]}/{in_band[1]}; "
          f"live P50 inside its band: {p50_band[0]}/{p50_band[1]}")
    if alone["P50 ms"][1]:
        print("the profile alone (no recheck) within 10%: "
              + ", ".join(f"{k.split()[0]} {v[0]}/{v[1]}" for k, v in alone.items()))
    if all(hindsight.values()):
        print("median |error| at the run's speed: "
              + ", ".join(f"{k.split()[0]} {statistics.median(v):.1f}%" for k, v in hindsight.items()))
    folders = [run.parent for run in sorted(Path(args.out).glob("*-*/fidelity.json"))]
    if any(p.get("spread") for f in folders for p in json.loads((f / "fidelity.json").read_text())["points"]):
        print("against the spread of the live replays, over the whole matrix:\n"
              + format_matrix(combine_results(folders)))
    repeat_table(Path(args.out))
    delay_table(Path(args.out))
    return 0


def _live(summary: dict) -> list[float]:
    """P50 ms, P99 ms, throughput and refused or failed requests of a measured run's summary."""
    return [summary["latency"]["p50"] * 1e3, summary["latency"]["p99"] * 1e3, summary["throughput_rps"],
            summary["num_requests"] - summary["num_ok"]]


def repeat_table(out: Path) -> None:
    """Where the points were replayed (``-- --live-repeats 2``): the second replay against the first
    under the same targets (how far the live run agrees with itself, back to back on one server) beside
    the prediction against each replay."""
    head = True
    counts = {k: {"again vs first": 0, "predicted vs first": 0, "predicted vs again": 0} for k in SCORED}
    points = 0
    for run in sorted(out.glob("*-*/fidelity.json")):
        name, cpus = run.parent.name.rsplit("-", 1)
        doc = json.loads(run.read_text())
        rows = doc["table"]["rows"]
        for point in doc["points"]:
            if not point.get("repeats"):
                continue
            if head:
                print("\n| workload | cpus | load | P50 first / again / predicted ms | P50 again vs first "
                      "| P99 first / again / predicted ms | P99 again vs first "
                      "| speed vs profile, first / again |")
                print("|---|---|---|---|---|---|---|---|")
                head = False
            load = f"{point['load']:.0%}"
            r = {x[2]: x for x in rows if x[0] == load}
            first, again = _live(point["measured"]), _live(point["repeats"][0]["measured"])
            pred = [float(r[k][3]) for k in SCORED]
            points += 1
            for i, k in enumerate(SCORED):
                c = counts[k]
                c["again vs first"] += bool(within_target(k, again[i], first[i]))
                c["predicted vs first"] += bool(within_target(k, pred[i], first[i]))
                c["predicted vs again"] += bool(within_target(k, pred[i], again[i]))
            speeds = point["speed_vs_profile"], point["repeats"][0]["run_speed"]["speed_vs_profile"]
            print(f"| {name} | {cpus} | {load} | {first[0]:.2f} / {again[0]:.2f} / {pred[0]:.2f} "
                  f"| {again[0] / first[0] - 1:+.1%} | {first[1]:.2f} / {again[1]:.2f} / {pred[1]:.2f} "
                  f"| {again[1] / first[1] - 1:+.1%} | {speeds[0]:+.1%} / {speeds[1]:+.1%} |")
    if points:
        for who in ("again vs first", "predicted vs first", "predicted vs again"):
            print(f"{who}, within target over {points} points: "
                  + ", ".join(f"{k.split()[0]} {counts[k][who]}" for k in SCORED))


def delay_table(out: Path) -> None:
    print("\n| workload | cpus | load | outside the batcher, live median ms | lone line ms | "
          "with the delay under load ms | with it through the segments below one slot's rate ms |")
    print("|---|---|---|---|---|---|---|")
    errors: dict[str, list[float]] = {"the lone line": [], "with the delay under load": [],
                                      "through the segments below one slot's rate": []}
    for run in sorted(out.glob("*-*/fidelity.json")):
        name, cpus = run.parent.name.rsplit("-", 1)
        doc = json.loads(run.read_text())
        fe = FrontEnd.from_profile(doc["profile"])
        below = below_one_slot(fe, json.loads(Path(doc["profile"]).read_text()))
        for point in doc["points"]:
            path = run.parent / f"records-{int(point['load'] * 100)}.csv"
            if fe is None or not path.exists():
                continue
            rows = [r for r in csv.DictReader(path.open()) if r["status"] == "200" and r["warmup"] == "0"]
            rows.sort(key=lambda r: float(r["scheduled_s"]))
            live = [float(r["latency_s"]) - float(r["server_tokenize_s"]) - float(r["server_batcher_s"])
                    for r in rows]
            tokens = np.array([float(r["input_tokens"]) for r in rows])
            arrivals = np.array([float(r["scheduled_s"]) for r in rows])
            lone, loaded = np.median(fe.delay(tokens)), np.median(fe.delay(tokens, arrivals))
            ms = [round(float(x) * 1e3, 2) for x in (np.median(live), lone, loaded,
                                                     np.median(below.delay(tokens, arrivals)))]  # as printed
            print(f"| {name} | {cpus} | {point['load']:.0%} | {ms[0]:.2f} | {ms[1]:.2f} | {ms[2]:.2f} | "
                  f"{ms[3]:.2f} |")
            for label, value in zip(errors, ms[1:], strict=True):
                errors[label].append(value - ms[0])
    for label, errs in errors.items():
        if errs:
            print(f"{label} minus the live median: mean |error| {np.mean(np.abs(errs)):.2f} ms, "
                  f"range {min(errs):+.2f} .. {max(errs):+.2f} ms over {len(errs)} points")


def below_one_slot(fe: FrontEnd, profile: dict) -> FrontEnd:
    """``fe`` with its delay under load fitted again through the loaded segments below one slot's
    rate only (``serving_delay``), from the segments the profile kept: the same line for a profile
    written since the fit leaves the others out, the line it would have had for an older one."""
    segments = profile.get("serving_path", {}).get("loaded_delay", {}).get("segments", [])
    keep = [s for k, s in enumerate(segments) if s.get("share", LOADED_SHARES[k % len(LOADED_SHARES)]) < 1.0]
    if len(keep) < 2:
        return fe
    rates, excess = (np.array([s[k] for s in keep]) for k in ("rate", "median_excess_s"))
    const, coef = fit_line(rates, excess, trim=False)
    return dataclasses.replace(fe, delay_loaded_s=const, delay_rate_coef_s=coef)


if __name__ == "__main__":
    raise SystemExit(main())
