"""Canary arms measured: the A/B verdict against the simulator's prediction, an A/A run, and the
rollback of a much worse candidate under replayed conv-embed load.

    .venv/bin/python benchmarks/rollout.py [--part ab|rollback|all] [--requests 3000] [--rate-scale 8]

Part ab (the no-op model with a fixed 20 ms per batch: a stand-in for a device-bound model, whose
batches wait on the device rather than on these two cores, so two arms do not slow each other):
  * primary: hybrid, max_batch_size 32; candidate "wait": window, max_wait 60 ms (the window held
    open whatever the load: wait_only_if_it_pays off), share 0.5.
  * The known difference: ``sim.arms.simulate_arms`` gives each arm the rows whose X-Client-Id the
    server's own ``core.rollout.arm_for`` sends to it and runs them through that arm's resolved
    deployment at the no-op model's exact cost (its delay); nothing is fitted on the live run.
  * Live: `batchpilot serve --noop --config primary --canary wait --no-rollback`, replayed once by
    `bench ab`'s functions (client-measured latency); the verdict must find the direction the
    simulator predicts. Then A/A: the candidate is the primary's own config, replayed ``--aa-runs``
    times (different client seeds); each verdict should be "no significant difference".

Part rollback (the embedded MiniLM, default deployment; the candidate "bad": batches of one padded
to 512 tokens, share 0.2; the default rules but a 30 s window and 30 answers per arm):
  * two servers on the same model and cores, one without arms and one with the candidate, replaying
    the same conv-embed rows alternately (``--rounds`` each; the candidate is re-enabled before each
    armed replay): when the candidate was rolled back (seconds into the replay, requests it had
    answered), and the primary's P99 in the armed server against the server without arms.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from batchpilot.bench.ab import samples, verdicts, with_clients  # noqa: E402
from batchpilot.bench.capacity import wait_idle  # noqa: E402
from batchpilot.bench.loadgen import LoadGenConfig, build_plan, load_tokenizer, replay  # noqa: E402
from batchpilot.bench.serverproc import serve  # noqa: E402
from batchpilot.core.abtest import ArmComparison  # noqa: E402
from batchpilot.core.costmodel import CostModel  # noqa: E402
from batchpilot.core.deployment import ModelLimits  # noqa: E402
from batchpilot.core.rollout import ArmSpec, RolloutSpec  # noqa: E402
from batchpilot.settings import load_spec  # noqa: E402
from batchpilot.sim.arms import client_keys, simulate_arms  # noqa: E402
from batchpilot.sim.metrics import summarize as sim_summarize  # noqa: E402
from batchpilot.sim.traces import (
    Workload,  # noqa: E402
    load_workload,  # noqa: E402
)

DELAY_S = 0.020
PRIMARY_YAML = "encoder:\n  policy: {name: hybrid, max_batch_size: 32}\n"
WAIT_YAML = ("encoder:\n  policy: {name: window, max_batch_size: 32, max_wait_s: 0.060, "
             "wait_only_if_it_pays: false}\n")
BAD_YAML = ("encoder:\n  policy: {name: window, max_batch_size: 1, max_wait_s: 0.0}\n"
            "  planner: {padding: max}\n")


def predict(wl: Workload, keys: list[str], primary: Path, candidate: Path) -> dict[str, dict[str, float]]:
    """Each arm's P50/P99 from ``sim.arms.simulate_arms``: the server's assignment, each arm's own
    deployment, the no-op model's exact cost."""
    cost = CostModel(latency_coef=(DELAY_S, 0.0, 0.0, 0.0), meta={"source": "noop"})
    rollout = RolloutSpec((ArmSpec("canary", 0.5, load_spec(candidate)),))
    runs = simulate_arms(wl, keys, load_spec(primary), rollout, cost, ModelLimits())
    out = {}
    for arm, run in runs.items():
        rep = sim_summarize(run, 1.0)
        out[arm] = {"p50": rep.latency["p50"], "p99": rep.latency["p99"], "n": float(rep.num_measured)}
    return out


def part_ab(args: argparse.Namespace, out: Path) -> None:
    (out / "primary.yaml").write_text(PRIMARY_YAML)
    (out / "wait.yaml").write_text(WAIT_YAML)
    wl = load_workload("conv-embed", args.rate_scale, args.start, args.requests)
    texts = [p.body["input"] for p in build_plan(wl, tokenizer=load_tokenizer(None), seed=0)]
    plan = with_clients(build_plan(wl, texts=texts), args.clients, seed=0)
    predicted = predict(wl, client_keys(len(wl), args.clients, 0), out / "primary.yaml", out / "wait.yaml")
    sim = {"primary": predicted["primary"], "wait": predicted["canary"]}
    print(f"conv-embed rows {args.start}..{args.start + len(wl)} at x{args.rate_scale} "
          f"({wl.mean_rate:.1f} req/s), {args.clients} clients, no-op model {DELAY_S * 1e3:.0f} ms/batch")
    for arm, s in sim.items():
        print(f"  simulated {arm:8s} n={s['n']:.0f} P50 {s['p50'] * 1e3:6.1f} ms  "
              f"P99 {s['p99'] * 1e3:6.1f} ms")
    print(f"  simulated P99 ratio wait/primary: {sim['wait']['p99'] / sim['primary']['p99']:.2f}")
    base = ["--noop", "--noop-delay-ms", str(DELAY_S * 1e3), "--no-warmup", "--config",
            str(out / "primary.yaml"), "--no-rollback", "--canary-share", "0.5"]
    live = LoadGenConfig("http://127.0.0.1", progress=False, scrape_interval_s=0)
    with serve([*base, "--canary", str(out / "wait.yaml")], log_path=out / "serve-ab.log") as url:
        by = samples(replay(plan, dataclasses.replace(live, url=url)).records)
        [v] = verdicts(by)
        q = {a: np.quantile(s.latencies, 0.99) * 1e3 for a, s in by.items()}
        same = (v.p99_ratio.estimate > 1) == (sim["wait"]["p99"] > sim["primary"]["p99"])
        print(f"  live      primary P99 {q['primary']:6.1f} ms, canary (wait) P99 {q['canary']:6.1f} ms")
        print(f"  live A/B verdict: canary {v.verdict}, {describe(v)}; direction as simulated: {same}")
    with serve([*base, "--canary", str(out / "primary.yaml")], log_path=out / "serve-aa.log") as url:
        calls = 0
        for seed in range(args.aa_runs):
            p = with_clients(build_plan(wl, texts=texts), args.clients, seed=100 + seed)
            [v] = verdicts(samples(replay(p, dataclasses.replace(live, url=url)).records))
            calls += v.significant
            print(f"  A/A run {seed}: {v.verdict}, {describe(v)}")
            wait_idle(url, 10.0)
        print(f"  A/A: {calls} of {args.aa_runs} runs called a difference")


def describe(v: ArmComparison) -> str:
    r = v.p99_ratio
    return (f"P99 ratio {r.estimate:.2f} (interval {r.low:.2f}-{r.high:.2f}) "
            f"at n = {v.n_primary}/{v.n_candidate}")


def part_rollback(args: argparse.Namespace, out: Path) -> None:
    (out / "bad.yaml").write_text(BAD_YAML)
    wl = load_workload("conv-embed", args.rollback_rate_scale, args.start, args.rollback_requests)
    texts = [p.body["input"] for p in build_plan(wl, tokenizer=load_tokenizer(None), seed=0)]
    plan = with_clients(build_plan(wl, texts=texts), args.clients, seed=0)
    common = ["--no-startup-profile", "--threads", "1"]
    armed_args = [*common, "--canary", str(out / "bad.yaml"), "--canary-share", "0.2", "--rollback-window-s",
                  "30", "--rollback-min-samples", "30"]
    print(f"conv-embed rows {args.start}..{args.start + len(wl)} at x{args.rollback_rate_scale} "
          f"({wl.mean_rate:.1f} req/s, {wl.duration_s:.0f} s), MiniLM, one torch thread per server")
    live = LoadGenConfig("http://127.0.0.1", progress=False, scrape_interval_s=0)
    with serve(common, log_path=out / "serve-plain.log") as plain, \
            serve(armed_args, log_path=out / "serve-armed.log") as armed:
        ratios = []
        for r in range(args.rounds):
            wait_idle(plain, 10.0)
            recs = replay(plan, dataclasses.replace(live, url=plain)).records
            plain_p99 = float(np.quantile([x.latency_s for x in recs if x.ok], 0.99))
            httpx.post(armed + "/v1/arms/canary/enable")
            wait_idle(armed, 10.0)
            t0 = time.monotonic()
            by = samples(replay(plan, dataclasses.replace(live, url=armed)).records)
            wall = time.monotonic() - t0
            rb = httpx.get(armed + "/v1/arms").json()["data"][0]["arms"][1].get("rollback")
            primary_p99 = float(np.quantile(by["primary"].latencies, 0.99))
            ratios.append(primary_p99 / plain_p99)
            bad = by.get("canary")
            bad_p99 = (np.quantile(bad.latencies, 0.99) * 1e3 if bad and len(bad.latencies)
                       else math.nan)
            when = (f"at {wall - rb['seconds_ago']:.1f} s into the replay ({rb['detail']})" if rb
                    else "never")
            print(f"  round {r}: plain P99 {plain_p99 * 1e3:.0f} ms; armed: primary P99 "
                  f"{primary_p99 * 1e3:.0f} ms, candidate answered {bad.total if bad else 0} "
                  f"(P99 {bad_p99:.0f} ms), rolled back {when}")
        print("  primary P99 armed / plain, per round: " + ", ".join(f"{x:.2f}" for x in ratios))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=("ab", "rollback", "all"), default="all")
    ap.add_argument("--start", type=int, default=0)
    ap.add_argument("--requests", type=int, default=3000, help="part ab: conv-embed rows")
    ap.add_argument("--rate-scale", type=float, default=8.0, help="part ab: rate x")
    ap.add_argument("--clients", type=int, default=200)
    ap.add_argument("--aa-runs", type=int, default=3)
    ap.add_argument("--rollback-requests", type=int, default=600)
    ap.add_argument("--rollback-rate-scale", type=float, default=2.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default="/tmp/batchpilot-rollout")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.part in ("ab", "all"):
        part_ab(args, out)
    if args.part in ("rollback", "all"):
        part_rollback(args, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
