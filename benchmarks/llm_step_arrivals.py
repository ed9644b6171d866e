"""Do a live engine's steps run slower while new requests arrive? Its logged steps against the profile,
by how recently a step carried a prompt's prefill.

    .venv/bin/batchpilot bench fidelity --workload conv-llm --requests 1000 --sla 2.0 \\
        --warmup-requests 2 --out OUT
    .venv/bin/python benchmarks/llm_step_arrivals.py OUT [PROFILE]

Reads OUT's ``steps.jsonl`` (every engine step of the live run) and the profile (OUT's
``llm_profile.json`` unless PROFILE is given). A step with a prefill chunk marks a request that has
just arrived: its HTTP request, tokenising and first chunk ran on the same cores shortly before or
beside that step. For the decode-only steps of at least ``MIN_SEQS`` sequences, grouped by the steps
since the last one with a prefill chunk, it prints their forward seconds over what the profile prices
them at (``frontend.forward_factor`` times ``StepPricer``'s price, as ``bench.llm_fidelity.speed_by_seqs``)
and
their mean sequences per step. Then the same for the steps with a prefill chunk, by sequences per
step. Nothing is fitted; the numbers are the run's own against its profile.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from batchpilot.bench.llm_fidelity import is_prefill, read_steps
from batchpilot.core.costmodel import CostModel
from batchpilot.sim.llm import LLMFrontEnd, StepPricer

MIN_SEQS = 4
SINCE_BINS = ((1, 1), (2, 5), (6, 20), (21, 100), (101, 10**9))  # steps since the last prefill step
SEQS_BINS = ((1, 3), (4, 7), (8, 15), (16, 31), (32, 10**9))


def label(lo: int, hi: int) -> str:
    return str(lo) if lo == hi else (f"{lo}-{hi}" if hi < 10**9 else f"{lo}+")


def main() -> int:
    if len(sys.argv) not in (2, 3):
        print(__doc__)
        return 2
    out = Path(sys.argv[1])
    profile = Path(sys.argv[2]) if len(sys.argv) == 3 else out / "llm_profile.json"
    steps = read_steps(out / "steps.jsonl")[0]
    cost, frontend = CostModel.load(profile), LLMFrontEnd.from_profile(profile)
    seqs = np.array([s.seqs for s in steps])
    fwd = np.array([s.forward_s for s in steps])
    prefill = np.array([is_prefill(s) for s in steps])
    pricer = StepPricer(cost)
    price = np.array([pricer.latency(s.features) * frontend.forward_factor(s.seqs, bool(p))
                      for s, p in zip(steps, prefill, strict=True)])
    since = np.zeros(len(steps), dtype=int)
    last = -10**9
    for i, p in enumerate(prefill):
        since[i] = i - last
        if p:
            last = i
    print(f"{len(steps)} engine steps of {out} against {profile}: forward over its price")
    decode = ~prefill & (seqs >= MIN_SEQS)
    print(f"decode-only steps of {MIN_SEQS}+ sequences, by steps since the last step with a prefill chunk:")
    for lo, hi in SINCE_BINS:
        m = decode & (since >= lo) & (since <= hi)
        if m.any():
            print(f"  {label(lo, hi):>6} steps since  {int(m.sum()):6d} steps  forward "
                  f"{fwd[m].sum() / price[m].sum() - 1:+7.1%}  mean seqs {seqs[m].mean():5.1f}")
    print("decode-only and with a prefill chunk, by sequences per step:")
    for lo, hi in SEQS_BINS:
        for name, kind in (("decode-only", ~prefill), ("prefill", prefill)):
            m = kind & (seqs >= lo) & (seqs <= hi)
            if m.sum() >= 10:
                print(f"  {label(lo, hi):>6} seqs  {name:>11}  {int(m.sum()):6d} steps  forward "
                      f"{fwd[m].sum() / price[m].sum() - 1:+7.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
